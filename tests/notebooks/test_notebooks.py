"""The teaching notebooks (notebooks/*.ipynb): committed clean, and each runs top to bottom in fast
mode (GLASSFORMER_NOTEBOOK_FAST=1) through nbclient, in a working folder of its own. Their exercise
cells assert the learner's worked answers against the project's numbers, so a notebook that runs
is one whose asserts held."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import pytest

from ..support import REPO

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

_spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

PATHS = runner.notebook_paths()
NAMES = [p.stem for p in PATHS]
# What each notebook must leave in its working folder when it has run (fast mode).
LEFT_BEHIND = {
    "01-worked-by-hand": ["worked.html"],
    "02-train-shakespeare": ["data/meta.json", "runs/shakespeare/metrics.jsonl", "runs/shakespeare/step-000030/COMPLETE",
                             "trained.html"],
    "03-attention-kernels": ["flash.html"],
    "04-kv-cache": ["kv.html"],
    "05-interventions-logit-lens": ["heads.html"],
    "06-cost-predicted-measured": ["costs.html"],
}


def _read(path):
    return nbformat.read(path, as_version=4)


def _code(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_the_six_notebooks_are_there():
    assert NAMES == sorted(LEFT_BEHIND)
    readme = (REPO / "notebooks" / "README.md").read_text(encoding="utf-8")
    assert all(f"{name}.ipynb" in readme for name in NAMES)


@pytest.mark.parametrize("path", PATHS, ids=NAMES)
def test_committed_without_outputs(path):
    nb = _read(path)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: a code cell keeps its outputs"
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", PATHS, ids=NAMES)
def test_shape_of_a_teaching_notebook(path):
    """One guarded %pip cell, the fast switch, the explorer's page embedded, exercises checked by asserts."""
    code = _code(_read(path))
    installs = [c for c in code if "%pip install" in c]
    assert len(installs) == 1 and re.search(r"try:\s+import glassformer\s+except ImportError:\s+%pip install", installs[0])
    assert any('os.environ.get("GLASSFORMER_NOTEBOOK_FAST") == "1"' in c for c in code)
    assert any("show_page(" in c for c in code[1:]), "the explorer's page is embedded"
    md = " ".join(c.source for c in _read(path).cells if c.cell_type == "markdown")
    exercises = re.findall(r"\*\*Exercise \d+\.\*\*", md)
    assert len(exercises) >= 3
    assert sum("assert " in c for c in code) >= len(exercises)


EXECUTED: dict[str, object] = {}  # name -> the executed notebook, for the browser test after these


@pytest.mark.parametrize("path", PATHS, ids=NAMES)
def test_runs_in_fast_mode(path, tmp_path):
    nb = _read(path)
    runner.run_notebook(nb, tmp_path, fast=True, timeout=300)  # raises at the first cell that raises
    EXECUTED[path.stem] = nb
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "fast mode" in "".join(o.get("text", "") for o in outputs)
    for name in LEFT_BEHIND[path.stem]:
        assert (tmp_path / name).is_file(), f"{path.name} did not write {name}"
    page = next(tmp_path / n for n in LEFT_BEHIND[path.stem] if n.endswith(".html"))
    frames = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert any("<iframe srcdoc=" in f for f in frames), "the page is shown inline"
    # The inline page is the saved file itself: its embedded data block survives the escaping.
    shown = max(frames, key=len)
    assert "glassformer-explorer" in page.read_text(encoding="utf-8") and "glassformer-explorer" in shown
    if path.stem.startswith("02"):
        _check_fast_training(tmp_path)


def _check_fast_training(folder):
    """The training notebook honoured the fast switch: the tiny preset for 30 steps (read from its run)."""
    run = folder / "runs" / "shakespeare"
    config = json.loads((run / "step-000030" / "config.json").read_text())["model"]
    assert config["dim"] == 64 and config["n_layers"] == 2  # the tiny preset
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 30


def _inline_pages(nb) -> list[str]:
    return [o["data"]["text/html"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "<iframe srcdoc=" in o.get("data", {}).get("text/html", "")]


@pytest.mark.browser
@pytest.mark.parametrize("name", ["01-worked-by-hand", "02-train-shakespeare"])
def test_the_inline_page_draws_in_a_browser(name, tmp_path):
    """The page shown in the notebook's output draws inside its iframe, under its own CSP (no
    bypass), with no script error: the toy model's page and the trained model's."""
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = next((p for p in (os.environ.get("GLASSFORMER_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"))
                if p and os.access(p, os.X_OK)), None)
    if exe is None:
        pytest.skip("no Chromium found: run scripts/ensure_browser.sh to enable browser tests")
    nb = EXECUTED.get(name)
    if nb is None:  # run alone (-k): execute it here
        nb = _read(REPO / "notebooks" / f"{name}.ipynb")
        runner.run_notebook(nb, tmp_path / "work", fast=True, timeout=300)
    host = tmp_path / "output.html"  # the output cell as a notebook front-end holds it
    host.write_text("<!doctype html><html><body>" + _inline_pages(nb)[-1] + "</body></html>", encoding="utf-8")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--headless", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(host.as_uri())
            frame = page.frames[1]
            frame.wait_for_selector("body[data-ready]", timeout=30_000)
            assert frame.locator("#numbers .num").count() > 0 and not errors
        finally:
            browser.close()
