"""The explorer's guided walk in Chromium: how long a step of the walk takes, key press to painted frame.

Two saved pages: the walkthrough's toy model ('I like cats too') and the tiny preset with GPT-2's
vocabulary size (50,257 ids, random weights, a small trained tokenizer) over --tokens tokens, near
the 5 MB a saved page may take. Each page opens on step 1 of the walk; then, --rounds times, the
→ key is dispatched for every step to the last and ← back to the first, each timed in the page
from the key event to the first frame after it (requestAnimationFrame, then a task: the frame
with the new step has been produced), 5 s after the walk opened (the map's flow has stopped, as
it has by the time a reader has read a step). Also timed: opening the walk (its Start button
draws all the steps). Goal: a step within 100 ms (issue 47).

    python bench/explorer_walk.py [--rounds 3] [--tokens 24] [--screenshots docs/img]

--screenshots writes the docs' pictures of the map (map.png) and of a step of the walk (walk.png),
from the worked page at 1366 px.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer.config import ModelConfig  # noqa: E402
from glassformer.model import Transformer  # noqa: E402
from glassformer.text.tokenizer import Tokenizer  # noqa: E402
from glassformer.viewer import source  # noqa: E402

FLOW_MS = 5000  # the map's flow runs four turns of 1.1 s after the page is drawn (tour.css)
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
TEXT = ("The cat sat on the mat and looked at the dog, who did not look back; "
        "the morning was quiet and the kettle had not yet begun to sing in the kitchen.")

# One step, timed in the page: the key event, then the first frame after it.
STEP_JS = """async (key) => {
  const t0 = performance.now();
  document.dispatchEvent(new KeyboardEvent('keydown', { key, bubbles: true }));
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""
OPEN_JS = """async () => {
  const t0 = performance.now();
  document.getElementById('tour-start').click();
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  return performance.now() - t0;
}"""


def chromium() -> str:
    for path in (os.environ.get("GLASSFORMER_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("no Chromium found: run scripts/ensure_browser.sh (apt-get install chromium)")


def big_page(folder: Path, tokens: int) -> Path:
    """The tiny preset at GPT-2's vocabulary size, over the first `tokens` tokens of TEXT."""
    torch.manual_seed(0)
    tok = Tokenizer.train([TEXT] * 20, vocab_size=300)
    ids = tok.encode(TEXT)[:tokens]
    text = tok.decode(ids)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=50257)).eval()
    return source.write_page(folder / "big.html", model, tok, text, model_name="tiny, 50,257 ids")


def time_walk(browser, path: Path, rounds: int) -> dict:
    # The page's CSP pins its own script; the timing code evaluated here is the bench's.
    page = browser.new_page(viewport={"width": 1366, "height": 900}, bypass_csp=True)
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready]")
    opened = page.evaluate(OPEN_JS)
    page.wait_for_timeout(FLOW_MS)  # a reader reads before pressing →: the map's flow has stopped by then
    n = page.locator("[data-tour-step]").count()
    steps = []
    for _ in range(rounds):
        steps += [page.evaluate(STEP_JS, "ArrowRight") for _ in range(n - 1)]
        steps += [page.evaluate(STEP_JS, "ArrowLeft") for _ in range(n - 1)]
    page.wait_for_function("location.hash === '#step=1'", timeout=5000)  # the walk came back to step 1
    page.close()
    steps.sort()
    return {"page_bytes": path.stat().st_size, "steps": n, "open_ms": round(opened, 2), "timed_steps": len(steps),
            "step_median_ms": round(statistics.median(steps), 2), "step_p90_ms": round(steps[int(0.9 * (len(steps) - 1))], 2),
            "step_max_ms": round(steps[-1], 2)}


def screenshots(browser, worked: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1366, "height": 900})
    page.emulate_media(reduced_motion="reduce")  # the still picture: every label drawn
    page.goto(worked.as_uri())
    page.wait_for_selector("body[data-ready]")
    page.locator("#view-map").screenshot(path=str(out / "map.png"))
    page.goto(worked.as_uri() + "#step=3")
    page.reload()
    page.wait_for_selector("body[data-ready]")
    page.locator("#view-tour").screenshot(path=str(out / "walk.png"))
    page.close()
    print(f"wrote {out / 'map.png'} and {out / 'walk.png'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--screenshots", type=Path, default=None, help="folder for map.png and walk.png")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "explorer_walk.json")
    a = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pages = {"worked": source.write_worked_page(folder / "worked.html"), "tiny_50257": big_page(folder, a.tokens)}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
            result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "load_average_1min": os.getloadavg()[0],  # a shared machine: the timings move with it
                      "chromium": browser.version, "rounds": a.rounds, "pages": {}}
            for name, path in pages.items():
                result["pages"][name] = time_walk(browser, path, a.rounds)
                print(name, result["pages"][name])
            if a.screenshots:
                screenshots(browser, pages["worked"], a.screenshots)
            browser.close()
    write_json(a.out, result)


if __name__ == "__main__":
    main()
