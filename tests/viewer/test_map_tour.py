"""The model map (#model-map, static/map.js) and the guided walk ([data-tour-step], static/tour.js)
in a real browser: the map is drawn from the live config (one [data-block] per layer, its heads,
its experts), a click on a part opens its numbers, the flow stands still under reduced motion; the
walk has the walkthroughs' steps in order, opens at the step its address names, moves with the
arrow keys, and on the walkthrough's model shows every figure the walkthrough prints in its step.
"""

from __future__ import annotations

import re

import pytest

from glassformer.viewer import source
from glassformer.viewer.server import make_server

from ..support import fixture_trace, tiny_model
from .test_viewer_browser import FIGURES, browser, open_page  # noqa: F401  (browser: the shared fixture)

pytestmark = pytest.mark.browser

STEP_TITLES = [
    "Words to vectors", "Queries, keys and values", "RoPE: turning by position", "Scores", "Scale and mask", "Softmax",
    "The weighted sum", "Heads, and GQA / MQA", "The residual addition", "RMSNorm", "The feed-forward network",
    "Pre-norm and post-norm", "The stream through the blocks", "Prefill and decode", "FlashAttention’s tiles",
    "The head and the next token", "What it costs",
]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """The worked page (one block, one head) and a tiny model's page (two blocks, 4 query / 2 KV heads)."""
    out = tmp_path_factory.mktemp("map")
    worked = source.write_worked_page(out / "worked.html")
    model = tiny_model()
    tiny = source.write_trace_page(fixture_trace(model, [1, 2, 3, 4, 5], list("abcde")), out / "tiny.html", model=model)
    return {"worked": worked, "tiny": tiny, "tiny_config": model.config}


@pytest.fixture(scope="module")
def worked_server():
    server = make_server(source.worked_explorer(), port=0)
    server.start_in_thread()
    yield server
    server.stop()


def test_map_is_drawn_from_the_config(browser, pages):  # noqa: F811
    page = open_page(browser, pages["worked"].as_uri())
    assert page.locator("#model-map [data-block]").evaluate_all("bs => bs.map(b => b.dataset.block)") == ["0"]
    assert page.locator('#model-map [data-block="0"] .map-head').count() == 1
    # The map is the first view, the walk's start the second.
    assert page.evaluate("[...document.querySelectorAll('#views > section')].slice(0, 2).map(s => s.id)") == [
        "view-map", "view-tour"]
    page.close()

    cfg = pages["tiny_config"]
    page = open_page(browser, pages["tiny"].as_uri())
    blocks = page.locator("#model-map [data-block]").evaluate_all("bs => bs.map(b => b.dataset.block)")
    assert blocks == [str(i) for i in range(cfg.n_layers)] and cfg.n_layers == 2
    heads = page.locator('#model-map [data-block="1"] .map-head')
    assert heads.count() == cfg.n_heads == 4
    # Heads are coloured by the KV head they read: 4 query heads over 2 KV heads, two of each.
    assert heads.evaluate_all("hs => hs.map(h => h.classList.contains('kv1'))") == [False, False, True, True]
    assert page.locator("#model-map .map-lane").count() == 5
    assert page.locator("#model-map .map-lane.sel").get_attribute("data-token") == "4"

    # A trace's page written with its model carries the walk's weights: W_Q's columns in step 2.
    page.click("#tour-start")
    page.click("#tour-next")
    assert "W_Q column 0 (block 0, head 0)" in page.locator('[data-tour-step="2"]').text_content()
    # The embedding table is a part of its own, over the lanes' height too.
    page.locator('#model-map [data-part="embed"]').click()
    assert page.locator("#numbers .num.active").first.get_attribute("data-probe") == "embed"
    # A click on block 1's feed-forward selects layer 1 and opens its first number's calculation.
    page.locator('#model-map [data-block="1"] [data-part="ffn"]').click()
    assert page.locator("#num-layer").input_value() == "1"
    active = page.locator("#numbers .num.active").first
    assert active.get_attribute("data-probe").startswith("blocks.1.ffn.")
    assert page.locator("#explain-body .calc-title").text_content()
    # The LM head opens the selected token's next-token logits: the first one's calculation.
    page.locator('#model-map [data-part="lm_head"]').click()
    assert page.locator("#next .num.active").first.get_attribute("data-index").startswith("[4,")
    # Another token chosen above: its lane is the lit one; a click on a lane chooses its token.
    page.locator('#tokens .tok[data-token="1"]').click()
    assert page.locator("#model-map .map-lane.sel").get_attribute("data-token") == "1"
    page.locator('#model-map .map-lane-hit[data-token="3"]').last.click()
    assert page.locator("#tokens .tok.sel").get_attribute("data-token") == "3"
    assert page.locator("#model-map .map-lane.sel").get_attribute("data-token") == "3"

    # The flow moves, and stands still when the user asks for reduced motion.
    flow = "getComputedStyle(document.querySelector('#model-map .map-flow')).animationName"
    assert page.evaluate(flow) == "map-flow"
    page.emulate_media(reduced_motion="reduce")
    assert page.evaluate(flow) == "none"
    assert page.events["errors"] == []
    page.close()


def test_map_draws_experts(browser, tmp_path):  # noqa: F811
    pytest.importorskip("glassformer.moe", reason="the mixture-of-experts layer has not landed")
    model = tiny_model(n_experts=4, n_active_experts=2)
    tr = fixture_trace(model, [1, 2, 3, 4], list("abcd"))
    page = open_page(browser, source.write_trace_page(tr, tmp_path / "moe.html").as_uri())  # the map needs no model
    for i in range(model.config.n_layers):
        experts = page.locator(f'#model-map [data-block="{i}"] .map-expert')
        assert experts.count() == 4
        chosen = sorted(int(x) for x in experts.evaluate_all("es => es.filter(e => e.classList.contains('on')).map(e => e.dataset.expert)"))
        assert chosen == sorted(tr["probes"][f"blocks.{i}.ffn.expert_ids"]["data"][3])
    assert page.events["errors"] == []
    page.close()


def shown_step(page):
    return page.evaluate("[...document.querySelectorAll('[data-tour-step]')].filter(s => !s.hidden).map(s => s.dataset.tourStep)")


def address(page, step):
    """The address names the step once the walk rests (tour.js writes it a moment after the last move)."""
    page.wait_for_function(f"location.hash === '#step={step}'", timeout=5000)
    return True


def test_walk_steps_address_and_keys(browser, worked_server):  # noqa: F811
    page = open_page(browser, worked_server.url + "#step=4")
    assert page.locator("[data-tour-step]").count() == len(STEP_TITLES)
    titles = page.locator("[data-tour-step] h3").all_text_contents()
    assert titles == [f"{i}. {t}" for i, t in enumerate(STEP_TITLES, 1)]
    assert shown_step(page) == ["4"]
    assert page.locator("#tour-title").text_content() == "Step 4 of 17: Scores"
    # The arrow keys move through the walk, and the address follows.
    page.locator("body").press("ArrowRight")
    assert shown_step(page) == ["5"] and address(page, 5)
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    assert shown_step(page) == ["3"] and address(page, 3)
    # ...but not while typing a sentence.
    page.locator("#sentence").press("ArrowLeft")
    assert shown_step(page) == ["3"]
    page.click("#tour-next")
    assert shown_step(page) == ["4"]
    # A number in a step opens its calculation in the panel.
    page.locator('[data-tour-step="4"]:not([hidden])').wait_for()
    page.click("#tour-next")
    button = page.locator('[data-tour-step="5"] .num').first
    button.click()
    title = page.locator("#explain-body .calc-title").text_content()
    assert title.startswith("s[I][I]") and title.endswith(f"= {button.text_content()}"), title
    # The first and last steps stop there.
    page.select_option("#tour-menu", "17")
    assert page.locator("#tour-next").is_disabled() and address(page, 17)
    page.keyboard.press("ArrowRight")
    assert shown_step(page) == ["17"]
    page.close()

    # ?step=N opens that step too; without one the walk waits behind its start button.
    page = open_page(browser, worked_server.url + "?step=2")
    assert shown_step(page) == ["2"]
    page.close()
    page = open_page(browser, worked_server.url)
    assert page.locator("[data-tour-step]").count() == 0
    page.click("#tour-start")
    assert shown_step(page) == ["1"] and address(page, 1)
    assert page.events["errors"] == []
    page.close()


# ----------------------------------------------------------------------------- the walkthrough's figures

def _steps_of_figures(f: dict) -> dict[int, list]:
    """{step: [figure, ...]}: every number the walkthrough prints, in the step that shows it.
    A list is a vector that must appear whole and in order."""
    h, mh, ffn, fl, dec, kv = f["head0"], f["multi_head"], f["ffn"], f["flash_attention_tiles_of_2_row_cats"], \
        f["decode_step"], f["llama3_8b_kv_cache"]
    down_1 = float(re.search(r"= ([\d.]+),", ffn["down_1_cats"]).group(1))
    return {
        1: [f["sentence_ids"], f["d_model"], f["embedding"]["cats"], f["vocabulary"]["unused_ids"]]
           + [f["vocabulary"][w] for w in ("I", "like", "cats", "too")],
        2: [f["d_head"], *f["W_Q_columns"].values(), *h["query"].values(), *h["key"].values(), *h["value"].values()],
        3: [*h["rotated_query"].values(), *h["rotated_key"].values(), h["unrotated_dot_cats_cats"]],
        4: [h["scores_row_cats_unscaled"]],
        5: [h["scores_row_cats_scaled"]],
        6: [h["attention_weights_row_cats"], h["attention_weights_row_I"]],
        7: [h["attention_output_cats"], h["attention_result_after_W_O_cats"]],
        8: [mh["n_heads"], mh["mha_head1_weights_cats_over_I_like_cats"], mh["mha_head0_weights_cats_over_I_like_cats"],
            mh["gqa_shared_key_I"], mh["head1_key_I"], mh["gqa_head1_weights_cats"], mh["gqa_head0_weights_cats"],
            mh["gqa_head0_output_cats"], list(mh["kv_cache_numbers_per_token"].values())],
        9: [f["residual_after_attention_cats"], f["rms_cats"]["before"], f["rms_cats"]["after_attention_residual"]],
        10: [f["rmsnorm"]["epsilon"], f["rmsnorm"]["normalized_cats"]],
        11: [ffn["W_up_shape"], ffn["W_up_column0"], ffn["up_0_cats"], ffn["relu_zeroes"], ffn["W_down_shape"], down_1,
             ffn["block_output_cats"]],
        12: [f["two_blocks_prenorm_rms_cats"]],
        14: [dec["position"], dec["value"], dec["cats_weight_on_itself_unchanged"]],
        15: [fl["tile0"]["scaled_scores"], fl["tile0"]["m"], fl["tile0"]["l"], fl["tile0"]["o"], fl["tile1"]["score_cats"],
             fl["tile1"]["m"], fl["tile1"]["alpha"], fl["result"]],
        17: [kv[k] for k in ("layers", "query_heads", "kv_heads", "head_dim", "bytes_per_number", "bytes_per_token",
                             "tokens", "gqa_total_bytes", "mha_total_bytes")],
    }


def _numbers(value) -> list[float]:
    """Every number in a figure (nested lists and dicts of numbers)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    items = value.values() if isinstance(value, dict) else value
    return [x for v in items for x in _numbers(v)]


def _tolerance(x: float) -> float:
    """Half a unit of the last digit the walkthrough prints, plus the page's own rounding (3 decimals)."""
    text = repr(x)
    if "e" in text:
        return abs(x) * 1e-3
    decimals = len(text.split(".")[1].rstrip("0")) if "." in text else 0
    return 0.5 * 10 ** -decimals + 6e-4


def _appears(figure, shown: list[float]) -> bool:
    want = _numbers(figure)
    n = len(want)
    return any(all(abs(shown[i + k] - w) <= _tolerance(w) for k, w in enumerate(want)) for i in range(len(shown) - n + 1))


def test_every_walkthrough_figure_is_in_its_step(browser, pages):  # noqa: F811
    steps = _steps_of_figures(FIGURES)
    # Every number of the walkthrough's figures has a step (a figure added there must be placed here too).
    # (Prose entries hold no figure, except down_1_cats's sum, placed above from its text.)
    placed = [x for figs in steps.values() for fig in figs for x in _numbers(fig)]
    missing = [x for x in _numbers(FIGURES) if not any(abs(x - p) <= 1e-9 for p in placed)]
    assert not missing, f"figures without a step: {missing}"

    page = open_page(browser, pages["worked"].as_uri() + "#step=1")
    shown = page.evaluate("""[...document.querySelectorAll('[data-tour-step]')].map(s =>
        [...s.querySelectorAll('.num, .fig')].map(e => e.textContent.replace(/,/g, '')))""")
    for step, figures in steps.items():
        values = []
        for text in shown[step - 1]:
            try:
                values.append(float(text))
            except ValueError:
                continue
        for figure in figures:
            assert _appears(figure, values), f"step {step} ({STEP_TITLES[step - 1]}) does not show {figure}: {values}"
    assert "masked: too" in page.locator('[data-tour-step="15"]').text_content()
    # RoPE: each token's key drawn turning by its position's angle, one radian a position.
    captions = page.locator('[data-tour-step="3"] .tour-arrows figcaption').all_text_contents()
    assert [c.replace("\u00a0", " ") for c in captions] == [f"k {w}: {p} rad" for p, w in enumerate(["I", "like", "cats", "too"])]
    # Prefill and decode: the grid of weights with the new token's row lit, or every row at once.
    page.select_option("#tour-menu", "14")
    step = page.locator('[data-tour-step="14"]')
    assert step.locator("tr.new").count() == 1 and step.locator("tr.new td").first.text_content().startswith("too")
    assert step.locator("tr.cached").count() == 3
    page.locator('[data-tour-step="14"] button[data-mode="prefill"]').click()
    step = page.locator('[data-tour-step="14"]')
    assert step.locator("tr.new").count() == 0 and step.locator("tr.cached").count() == 0
    assert shown_step(page) == ["14"]
    assert page.events["errors"] == []
    page.close()


def test_walk_weights_are_the_ones_the_forward_uses():
    """tour_part's W_Q columns: the float weight's, and an int8 model's dequantized ones (not its integers)."""
    import copy

    from glassformer.convert.quantize import quantize_int8
    from glassformer.viewer.tour import tour_part

    model = tiny_model()
    wq = model.blocks[0].attn.wq.weight.detach().T  # math layout [in, out]
    cols = tour_part(model)["weights"]["W_Q"]
    assert cols["shape"] == list(wq.shape)
    assert cols["columns"]["1"] == pytest.approx(wq[:8, 1].tolist(), abs=1e-6)
    q = quantize_int8(copy.deepcopy(model))
    want = q.blocks[0].attn.wq.dequantized().T
    got = tour_part(q)["weights"]["W_Q"]["columns"]["1"]
    assert got == pytest.approx(want[:8, 1].tolist(), abs=1e-6) and got == pytest.approx(wq[:8, 1].tolist(), abs=0.02)
    assert "multi_head" not in tour_part(model) and tour_part(model, walkthrough=True)["multi_head"]["n_heads"] == 4
