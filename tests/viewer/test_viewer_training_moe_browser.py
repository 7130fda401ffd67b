"""The Training view of a mixture of experts in a real browser: the per-expert load grid shows each
mixture layer's load as metrics.jsonl logged it (the latest step, or the chosen checkpoint's), and the
load-balancing loss is drawn with a point per logged step. (A dense run's payload has no mixture part:
test_moe_training.py; the section then stays hidden.)"""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.viewer.server import make_server

from ..support import make_prepared
from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_training import TEXT, run_explorer, train_run

pytestmark = pytest.mark.browser
MOE = "n_experts=4,n_active_experts=2,router_aux_loss_coef=0.01"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-training")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_run(make_prepared(root / "data"), root / "run", "--model", MOE)
    finally:
        torch.set_num_threads(n)
    return root / "run"


def _served(explorer):
    s = make_server(explorer, port=0)
    s.start_in_thread()
    return s


def _cells(page):
    return page.locator("#train-moe-load .moe-load").evaluate_all(
        "cs => cs.map(c => [Number(c.dataset.layer), Number(c.dataset.expert), Number(c.dataset.share)])")


def test_the_load_grid_is_metrics_jsonl(browser, moe_run):  # noqa: F811
    lines = [json.loads(s) for s in (moe_run / "metrics.jsonl").read_text().splitlines() if s.strip()]
    logged = [r for r in lines if "moe_load" in r]
    server = _served(run_explorer(moe_run))
    try:
        page = open_page(browser, server.url)
        page.fill("#sentence", TEXT)
        page.click("#run")
        page.wait_for_function("document.getElementById('view-training').dataset.checkpoint === 'step-000024'")
        assert page.locator("#train-moe").is_visible()
        last = logged[-1]["moe_load"]  # the page opened at the last checkpoint: the last logged step
        assert _cells(page) == [[l, e, pytest.approx(x, abs=1e-6)] for l, layer in enumerate(last) for e, x in enumerate(layer)]
        aux = page.locator("#train-moe-aux .legend-item").first
        assert int(aux.get_attribute("data-points")) == len(logged)

        page.focus("#train-ckpt")
        page.keyboard.press("Home")  # the first snapshot, step 6: the grid shows the load logged at step 6
        page.wait_for_function("document.getElementById('view-training').dataset.checkpoint === 'step-000006'")
        at6 = next(r for r in logged if r["step"] == 6)["moe_load"]
        assert _cells(page) == [[l, e, pytest.approx(x, abs=1e-6)] for l, layer in enumerate(at6) for e, x in enumerate(layer)]
        assert page.events["errors"] == []
        page.close()
    finally:
        server.stop()

