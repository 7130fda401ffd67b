"""The Training view in a real browser (Playwright, Debian's Chromium: see test_viewer_browser.py):
its curves have metrics.jsonl's points, and moving the checkpoint slider from the keyboard redraws
the attention maps, head summaries and logit lens of that checkpoint, equal to a trace of the
checkpoint loaded here on its own; a calculation asked then is of that checkpoint's numbers."""

from __future__ import annotations

import json
import re

import pytest

from glassformer.checkpoint.loading import load
from glassformer.tracing.interventions import logit_lens_top
from glassformer.tracing.trace import trace
from glassformer.viewer.server import make_server

from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_training import TEXT, trained, training_run  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser

# Every cell of the page's attention maps, with its head, query, key and drawn weight (its shade).
CELLS = """() => [...document.querySelectorAll('#heatmaps .heatmap-card')].flatMap((card) =>
  [...card.querySelectorAll('.cell:not(.masked)')].map((c) => [Number(card.dataset.head), Number(c.dataset.q),
    Number(c.dataset.k), c.style.backgroundColor]))"""


@pytest.fixture(scope="module")
def server(trained):  # noqa: F811
    s = make_server(trained[1], port=0)
    s.start_in_thread()
    yield s
    s.stop()


def at_checkpoint(page, name: str) -> None:
    page.wait_for_function(f"document.getElementById('view-training').dataset.checkpoint === {json.dumps(name)}"
                           " && !document.getElementById('view-training').classList.contains('stale')")


def check_drawn(page, run, name: str) -> None:
    """The page's maps (layer 0), head summaries and logit lens are those of checkpoint `name`'s own trace."""
    model, tok = load(run / name)
    ids = tok.encode(TEXT)
    w = trace(model.eval(), ids)["blocks.0.attn.weights"]  # (T, N, T)
    cells = page.evaluate(CELLS)
    assert len(cells) == len(ids) * (len(ids) + 1) // 2 * model.config.n_heads
    for h, q, k, color in cells:
        m = re.fullmatch(r"rgba?\(47, 111, 214(?:, ([0-9.]+))?\)", color)  # rgb(...): alpha 1
        assert m, color
        alpha = float(m.group(1) or 1.0)
        # Chromium keeps a colour's alpha in 8 bits and writes it with 2 or 3 decimals.
        assert (alpha - 0.06) / 0.94 == pytest.approx(float(w[q, h, k]), abs=0.011), (h, q, k)
    # The numbers the maps were drawn from, to the 6 decimals the server sends.
    sent = page.evaluate("() => window.Glass.P().trace.probes['blocks.0.attn.weights'].data")
    for q, row in enumerate(sent):
        for h, keys in enumerate(row):
            for k, x in enumerate(keys):
                assert (x is None) == (k > q) and (x is None or abs(x - float(w[q, h, k])) < 1e-6), (q, h, k)
    for card in page.locator("#heatmaps .heatmap-card").all():
        h = int(card.get_attribute("data-head"))
        shares = [float(s.rstrip("%")) for s in card.locator(".bar-row > span:last-child").all_text_contents()]
        T = len(ids)
        prev = sum(float(w[i, h, i - 1]) for i in range(1, T)) / (T - 1)
        first = sum(float(w[i, h, 0]) for i in range(1, T)) / (T - 1)
        self_ = sum(float(w[i, h, i]) for i in range(1, T)) / (T - 1)
        assert shares == pytest.approx([100 * prev, 100 * first, 100 * self_], abs=0.51)
    lens = logit_lens_top(model, ids, 3)
    drawn = page.locator("#train-lens .lens-cell").evaluate_all(
        "cs => cs.map(c => [Number(c.dataset.layer), Number(c.dataset.token), Number(c.dataset.id)])")
    assert drawn == [[l, t, lens["ids"][l][t][0]] for l in range(model.config.n_layers) for t in range(len(ids))]
    assert f"{run.name}/{name}" in page.locator("#model-summary").text_content()


def test_the_slider_redraws_each_checkpoints_maps(browser, server, trained):  # noqa: F811
    run, _ = trained
    lines = [json.loads(s) for s in (run / "metrics.jsonl").read_text().splitlines() if s.strip()]
    page = open_page(browser, server.url)
    page.fill("#sentence", TEXT)
    page.click("#run")
    page.wait_for_function(f"window.Glass.P().sentence === {json.dumps(TEXT)}")
    at_checkpoint(page, "step-000024")
    assert page.locator("#view-training").is_visible()
    points = dict(page.locator("#train-loss .legend-item").evaluate_all("xs => xs.map(x => [x.dataset.series, Number(x.dataset.points)])"))
    assert points == {"train": sum("loss" in r for r in lines), "held-out": sum("val_loss" in r for r in lines)}
    assert page.locator("#train-ckpts .ckpt").all_text_contents() == ["6", "12", "18", "24"]
    check_drawn(page, run, "step-000024")

    page.focus("#train-ckpt")
    page.keyboard.press("Home")  # to the first snapshot, from the keyboard
    at_checkpoint(page, "step-000006")
    check_drawn(page, run, "step-000006")
    assert page.locator(".train-marker").first.get_attribute("data-step") == "6"

    # A calculation asked now is the early checkpoint's: the value shown is its traced weight.
    model, tok = load(run / "step-000006")
    w = float(trace(model.eval(), tok.encode(TEXT))["blocks.0.attn.weights"][2, 0, 1])
    page.locator('#heatmaps .heatmap-card[data-head="0"] .cell[data-q="2"][data-k="1"]').click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title') !== null")
    title = page.locator("#explain-body .calc-title").text_content()
    assert float(title.rsplit("= ", 1)[1]) == pytest.approx(w, abs=5e-4)

    page.focus("#train-ckpt")
    page.keyboard.press("ArrowRight")
    at_checkpoint(page, "step-000012")
    check_drawn(page, run, "step-000012")
    assert page.events["errors"] == []
    page.close()
