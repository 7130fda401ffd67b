"""The families' view (static/families.js) in Chromium: a saved page of a gpt-oss-like mixture with
sinks draws each token's route through the experts and every head's sink weight (under its attention
map too), and a click on a route's weight or a sink's weight opens that number's calculation."""

from __future__ import annotations

import pytest

from glassformer.explaining.explain import explain
from glassformer.viewer import render, source

from ..support import NumberTokenizer
from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_families import IDS, TEXT, family_model

pytestmark = pytest.mark.browser


def test_the_routes_and_sinks_drawn_and_explained(browser, tmp_path):  # noqa: F811
    model = family_model("gpt_oss")
    tr, args = source.page_args(model, NumberTokenizer(), TEXT, model_name="oss", mode="server")
    path = render.write_html(tmp_path / "oss.html", tr, explain=lambda p, i: explain(tr, p, i, model=model),
                             **{k: v for k, v in args.items() if k != "tokenizer"})
    page = open_page(browser, path.as_uri())
    assert page.events["errors"] == [] and not page.locator("#message").is_visible()
    assert page.locator("#view-families").is_visible()
    ids = tr["blocks.0.ffn.expert_ids"]
    chosen = page.locator("#fam-moe tr[data-token] td.chosen")
    assert chosen.count() == len(IDS) * 2  # k = 2 filled cells a row, in the experts the router chose
    first = page.locator('#fam-moe tr[data-token="0"] td.chosen')
    assert sorted(int(x) for x in first.evaluate_all("es => es.map(e => e.dataset.expert)")) == sorted(ids[0].tolist())
    first.first.locator(".num").click()
    body = page.locator("#explain-body").inner_text()
    assert "Σ_slot p_r[expert]" in body  # the renormalised weight's calculation
    sinks = page.locator("#heatmaps .fam-sink-row .num")
    assert sinks.count() == 4 * len(IDS)  # every head's map of the shown layer: one per query
    sinks.first.click()
    assert "exp(sink − m)" in page.locator("#explain-body").inner_text()
