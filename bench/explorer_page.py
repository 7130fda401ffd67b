"""How quickly a saved explorer page opens and answers a click, in Chromium (Playwright).

A saved page is written as `glassformer trace --html` writes one (viewer/source.write_page): a
4-layer model (d 128, 4 heads, 2 KV heads, V 8192) over a sentence of --tokens tokens, which fills the
page's 5 MB budget. Then, for each width (a phone's 390 px and a laptop's 1366 px), over --loads fresh
loads of the file:
  first paint        the browser's first-contentful-paint entry (the header, before the data is drawn)
  interactive        when glass.js has drawn every view and set body[data-ready] (every number's
                     button and handler is in place)
and, on the last load, --clicks clicks on numbers of the page (the "every number" table, the next-token
cards), each from the click to the frame that shows its calculation (the drawer below 1100 px):
  click latency      click() → the calculation's title drawn → the next animation frame has run
                     (and, apart, the part before the frame: the handler and the layout of the calculation)
Medians (and the slowest click) go to bench/results/explorer_page.json. The goal is ≤ 100 ms a click.
With --screenshots DIR it writes instead the walkthrough's page at 390, 768, 1024, 1366 and 1920 px,
the query of `cats` clicked open, as DIR/explorer-WIDTHpx.png (docs/viewer.md's pictures).

    python bench/explorer_page.py [--tokens 24] [--loads 5] [--clicks 20]
    python bench/explorer_page.py --screenshots docs/img
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from glassformer import ModelConfig, Transformer
from glassformer.viewer import source

RESULTS = Path(__file__).parent / "results" / "explorer_page.json"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
WIDTHS = [(390, 844), (1366, 768)]

# Records when glass.js marks the page drawn (body[data-ready]) on the page's own clock.
READY = """
new MutationObserver((_, obs) => {
  if (document.body && document.body.dataset.ready && !window.__ready) { window.__ready = performance.now(); obs.disconnect(); }
}).observe(document, { subtree: true, attributes: true, attributeFilter: ['data-ready'] });
"""
# One click, timed in the page: the handler and the drawing of the calculation, up to the next frame.
CLICK = """async (i) => {
  const nums = Array.from(document.querySelectorAll('#numbers button.num, #next button.num'));
  const b = nums[(i * 7) % nums.length];
  b.scrollIntoView({ block: 'center' });
  await new Promise((r) => requestAnimationFrame(() => r()));
  const before = document.querySelector('#explain-body').firstChild;
  const t0 = performance.now();
  b.click();
  while (document.querySelector('#explain-body').firstChild === before) await new Promise((r) => setTimeout(r, 0));
  document.body.offsetHeight; // its layout
  const t1 = performance.now();
  await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));
  return [performance.now() - t0, t1 - t0];
}"""


class NumberTokenizer:
    """Text '17 4 99 …' <-> ids: the page needs ids, not a trained vocabulary."""

    vocab_size = 8192

    def encode(self, text):
        return [int(w) for w in text.split()]

    def id_to_piece(self, i):
        return f"t{i}"

    def decode(self, ids):
        return " ".join(map(str, ids))


def write(folder: Path, tokens: int) -> Path:
    cfg = ModelConfig(vocab_size=8192, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    text = " ".join(str((7 * i + 3) % cfg.vocab_size) for i in range(tokens))
    return source.write_page(folder / "page.html", model, NumberTokenizer(), text, model_name="bench")


def chromium() -> str:
    for path in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if path:
            return path
    raise SystemExit("no Chromium: apt-get install chromium (scripts/ensure_browser.sh)")


def measure(browser, url: str, width: int, height: int, loads: int, clicks: int) -> dict:
    paint, ready, clicked, handled = [], [], [], []
    for n in range(loads):
        page = browser.new_page(viewport={"width": width, "height": height})
        page.add_init_script(READY)
        page.goto(url)
        page.wait_for_function("window.__ready !== undefined", timeout=60000)
        paint.append(page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime"))
        ready.append(page.evaluate("window.__ready"))
        if n == loads - 1:
            clicked, handled = zip(*[page.evaluate(CLICK, i) for i in range(clicks)])
        page.close()
    return {"width": width, "height": height, "first_paint_ms": statistics.median(paint),
            "interactive_ms": statistics.median(ready), "click_ms": statistics.median(clicked),
            "click_max_ms": max(clicked), "click_handler_ms": statistics.median(handled),
            "loads": {"first_paint": paint, "interactive": ready}, "clicks": list(clicked), "handler": list(handled)}


SHOTS = [(390, 844), (768, 1024), (1024, 768), (1366, 768), (1920, 1080)]


def screenshots(browser, folder: Path) -> None:
    """The worked page at each width with a calculation open (the drawer below 1100 px)."""
    with tempfile.TemporaryDirectory() as tmp:
        url = source.write_worked_page(Path(tmp) / "worked.html").as_uri()
        for w, h in SHOTS:
            page = browser.new_page(viewport={"width": w, "height": h})
            page.emulate_media(reduced_motion="reduce")
            page.goto(url)
            page.wait_for_selector("body[data-ready]")
            page.locator('#numbers tr[data-probe="blocks.0.attn.q"] button.num').first.click()
            page.wait_for_function("document.getElementById('explain').classList.contains('open')")
            page.screenshot(path=str(folder / f"explorer-{w}px.png"))
            page.close()
            print(folder / f"explorer-{w}px.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--clicks", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--screenshots", metavar="DIR", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from playwright.sync_api import sync_playwright

    if args.screenshots is not None:
        args.screenshots.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
            screenshots(browser, args.screenshots)
            browser.close()
        return

    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), args.tokens)
        size = path.stat().st_size
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=ARGS)
            rows = [measure(browser, path.as_uri(), w, h, args.loads, args.clicks) for w, h in WIDTHS]
            version = browser.version
            browser.close()
    out = {"page_bytes": size, "tokens": args.tokens, "chromium": version, "machine": platform.processor() or platform.machine(),
           "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
           "widths": rows}
    RESULTS.write_text(json.dumps(out, indent=1))
    print(f"saved page: {size / 1e6:.2f} MB ({args.tokens} tokens), Chromium {version}")
    for r in rows:
        print(f"{r['width']:>5} px: first paint {r['first_paint_ms']:.0f} ms, interactive {r['interactive_ms']:.0f} ms, "
              f"click {r['click_ms']:.1f} ms median ({r['click_max_ms']:.1f} ms slowest of {len(r['clicks'])}; "
              f"{r['click_handler_ms']:.1f} ms of it before the frame)")
    print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
