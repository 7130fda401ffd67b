"""research.js in Chromium: the saved page `patch --html` writes and the live explorer's section draw
the grid and the bars, and a click on a cell or a bar shows its numbers in the calculation panel."""

from __future__ import annotations

import json

import pytest

from ..support import run_cli, tiny_checkpoint
from ..viewer.test_viewer_browser import browser  # noqa: F401  (the shared Chromium fixture)

pytestmark = pytest.mark.browser
TEXT = "the cat sat on the mat. the dog sat on the log. "
ARGS = ["--answer", " mat", "--wrong", " log"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser") / "ckpt"
    model, tok = tiny_checkpoint(folder, TEXT * 20)
    return folder, model, tok


def test_the_saved_pages_cells_and_bars_open_their_calculations(browser, checkpoint, tmp_path, capsys):  # noqa: F811
    folder = checkpoint[0]
    grid, bars = tmp_path / "grid.html", tmp_path / "bars.html"
    assert run_cli(["patch", "--checkpoint", str(folder), "--clean", "the cat sat on the", "--corrupt", "the dog sat on the",
                    "--site", "z", "--method", "both", "--json", "--html", str(grid)] + ARGS) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert run_cli(["attribute", "--checkpoint", str(folder), "--text", "the cat sat on the", "--html", str(bars)] + ARGS) == 0
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(grid.as_uri())
    cells = page.locator("#research-grid button.num")
    assert cells.count() == 2 * 4
    cells.nth(5).click()  # layer 1, head 1
    panel = page.locator("#explain-body").inner_text()
    want = out["patched_answer"][1][1] - out["patched_wrong"][1][1]
    assert "layer 1 · head 1" in panel and "the corrupted run with blocks.1.attn.z[:, h1]" in panel
    assert f"{want:.3f}"[:5] in panel and "attribution patching" in panel
    page.goto(bars.as_uri())
    page.locator('#research-bars button.num[data-part="blocks.0.attn.head2"]').click()
    assert "frozen" in page.locator("#explain-body").inner_text()
    assert not errors
    page.close()


def test_the_live_explorer_patches_and_attributes(browser, checkpoint):  # noqa: F811
    from glassformer.viewer.server import make_server
    from glassformer.viewer.source import explorer

    _, model, tok = checkpoint
    server = make_server(explorer(model, tok, "the cat sat on the", model_name="tiny"), port=0)
    server.start_in_thread()
    try:
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector("#research-clean")
        assert page.locator("#research-clean").input_value() == "the cat sat on the"
        page.fill("#research-corrupt", "the dog sat on the")
        page.fill("#research-answer", " mat")
        page.fill("#research-wrong", " log")
        page.click("#research-patch")
        page.wait_for_selector("#research-grid button.num")
        page.locator("#research-grid button.num").first.click()
        assert "patched metric" in page.locator("#explain-body").inner_text()
        page.click("#research-attribute")
        page.wait_for_selector("#research-bars button.num")
        assert page.locator("#research-bars button.num").count() >= 8
        assert not errors
        page.close()
    finally:
        server.stop()
