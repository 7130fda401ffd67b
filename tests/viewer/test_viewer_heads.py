"""The head switch (viewer/heads.py): MHA / GQA / MQA of one model in the page, without a restart,
by averaging the KV heads as `convert --kv-heads` does: the switched model is the walkthrough's own
GQA/MQA variant, the page says the heads were averaged, each averaged weight shown recomputes as the
mean of its group, and every later request of the page (explain) is answered by the switched model."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.convert.heads import convert_kv_heads
from glassformer.errors import UserError
from glassformer.viewer import heads, source
from glassformer.viewer.server import make_server
from glassformer.worked import model as worked

from ..support import NumberTokenizer, reinit, tiny_model
from .test_viewer_browser import browser  # noqa: F401  (a fixture: Debian's Chromium)
from .test_viewer_server import post_json

TEXT = worked.SENTENCE


@pytest.fixture(scope="module")
def ex():
    return source.worked_explorer()


def _weights(payload, layer=0):
    return payload["trace"]["probes"][f"blocks.{layer}.attn.weights"]["data"]


def test_the_worked_page_switches_to_the_walkthroughs_gqa_and_mqa(ex):
    opened = ex.payload(TEXT)
    h = opened["heads"]
    assert h["options"] == [4, 2, 1] and h["kv_heads"] is None and h["opened"].startswith("as opened: 1 query")
    assert h["kinds"] == {"4": "MHA", "2": "GQA", "1": "MQA"} and not h["pooled"]
    for k, variant in ((2, "gqa"), (1, "mqa"), (4, "mha")):
        got = ex.payload(TEXT, heads.kv_name(k))
        want = source.worked_explorer(variant).payload(TEXT)
        assert got["trace"]["config"]["n_kv_heads"] == k and got["trace"]["config"]["n_heads"] == 4
        assert _weights(got) == _weights(want)  # the same model as `view --worked --variant gqa`
        assert got["checkpoint"] == heads.kv_name(k) and got["heads"]["kv_heads"] == k
        assert got["heads"]["pooled"] == (k < 4)
        if k < 4:
            assert "averaged" in got["heads"]["about"] and "averaged" in got["model_name"]
    # The walkthrough's GQA variant says its heads were averaged too, and can go back to MHA.
    gqa = source.worked_explorer("gqa").payload(TEXT)["heads"]
    assert gqa["pooled"] and gqa["kv_heads"] == 2 and "averaged" in gqa["about"]


def test_every_averaged_weight_shown_is_the_mean_of_its_group(ex):
    h = ex.payload(TEXT, heads.kv_name(2))["heads"]
    four = worked.build_four_heads()
    assert {(w["matrix"], w["head"]) for w in h["weights"]} == {("k", 0), ("k", 1), ("v", 0), ("v", 1)}
    for w in h["weights"]:
        old = getattr(four.blocks[w["layer"]].attn, f"w{w['matrix']}").weight  # (4·H, D)
        H = four.config.head_dim
        group = [float(old[(2 * w["head"] + g) * H, w["row"]]) for g in range(2)]
        assert w["calc"]["result"] == pytest.approx(sum(group) / 2, abs=1e-12)
        assert w["value"] == pytest.approx(w["calc"]["result"], abs=1e-6)  # the switched model's own weight


def test_a_checkpoints_heads_average_into_each_divisor():
    model = reinit(tiny_model(), std=0.3).eval()  # 4 query heads, 2 KV heads
    tok = NumberTokenizer(model.config.vocab_size)

    text = "5 9 2 7"
    ex = source.switchable(source.explorer(model, tok, text, model_name="tiny"), model, tok, text, model_name="tiny")
    assert ex.payload(text)["heads"]["options"] == [2, 1] and ex.payload(text)["heads"]["kv_heads"] == 2
    assert ex.at(heads.kv_name(2)) is ex
    one = ex.at(heads.kv_name(1)).payload(text)
    ref = source.explorer(convert_kv_heads(model, 1), tok, text, model_name="ref").payload(text)
    assert _weights(one) == _weights(ref) and one["trace"]["config"]["n_kv_heads"] == 1


def test_api_heads_answers_and_later_requests_name_the_switched_model(ex):
    server = make_server(ex, port=0)
    server.start_in_thread()
    try:
        status, _, body = post_json(server, "/api/heads", {"text": TEXT, "kv_heads": 1})
        assert status == 200
        page = json.loads(body)
        assert page["trace"]["config"]["n_kv_heads"] == 1 and page["checkpoint"] == "kv_heads=1"
        k = page["trace"]["probes"]["blocks.0.attn.k"]["data"]
        status, _, body = post_json(server, "/api/explain", {"text": TEXT, "probe": "blocks.0.attn.k", "index": [2, 0, 0],
                                                             "checkpoint": page["checkpoint"]})
        assert status == 200 and json.loads(body)["result"] == pytest.approx(k[2][0][0], abs=1e-5)
        for bad, words in (({"kv_heads": 3}, "averaged into 4, 2, 1"), ({"kv_heads": "two"}, "whole number")):
            status, _, body = post_json(server, "/api/heads", {"text": TEXT, **bad})
            assert status == 400 and words in json.loads(body)["error"], body
        status, _, body = post_json(server, "/api/heads", {"text": TEXT})  # none: the model as opened
        assert status == 200 and json.loads(body)["trace"]["config"]["n_heads"] == 1
    finally:
        server.stop()


@pytest.mark.browser
def test_the_page_switches_heads_and_says_they_were_averaged(browser, ex):  # noqa: F811
    server = make_server(ex, port=0)
    server.start_in_thread()
    page = browser.new_page(viewport={"width": 1366, "height": 900}, bypass_csp=True)  # the test's own probes
    page.set_default_timeout(10000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready]")
        assert page.locator("#heads-averaged").count() == 0
        ready = page.evaluate("document.body.dataset.ready")
        page.select_option("#kv-heads", "2")
        page.wait_for_function("(r) => document.body.dataset.ready !== r", arg=ready)
        assert "averaged in groups of 2 into 2" in page.locator("#heads-averaged").text_content()
        assert "4 query / 2 KV" in page.locator("#model-summary").text_content()
        assert page.locator("#heatmaps .heatmap-card").count() == 4
        page.locator("#heads-switch summary").click()
        page.locator("#heads-switch .heads-weights .num").first.click()
        assert "the averaged model's weight ✓" in page.locator("#explain-body").text_content()
        page.locator('#numbers tr[data-probe="blocks.0.attn.k"] .num').first.click()  # asked with the switched model
        page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('k[')")
        assert "✓" in page.locator("#explain-body").text_content() and errors == []
    finally:
        page.close()
        server.stop()


def test_quantized_weights_are_refused_with_a_reason():
    model = reinit(tiny_model(), std=0.3).eval()
    model.blocks[0].attn.wk = type("Int8", (torch.nn.Module,), {})()  # stands in for a quantized layer
    with pytest.raises(UserError, match="quantized or wrapped"):
        heads.pooled_model(model, 1)
    with pytest.raises(UserError, match="averaged into 2, 1"):
        heads.pooled_model(model, 3)
