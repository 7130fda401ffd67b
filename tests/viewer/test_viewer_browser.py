"""The explorer page in a real browser: Playwright driving Debian's Chromium.

`scripts/ensure_browser.sh` (run by `make test`) installs Debian's `chromium` with apt;
Playwright's own browser download needs the open internet, so the tests launch that
binary by path. Without it (or without the playwright package) they skip with a reason.
A screenshot of the worked page is written to test-artifacts/.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from glassformer.text.labels import token_label
from glassformer.viewer import render, source
from glassformer.viewer.server import make_server

from ..support import tiny_model, REPO, WORKED_FIGURES
from ..support import fixture_trace

pytestmark = pytest.mark.browser

ROOT = REPO
ARTIFACTS = ROOT / "test-artifacts"
FIGURES = json.loads(WORKED_FIGURES.read_text())
HOSTILE = "<img src=x onerror=alert(1)>"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str | None:
    for path in (os.environ.get("GLASSFORMER_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser")):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium found: run scripts/ensure_browser.sh (apt-get install chromium) to enable browser tests")
    with sync_api.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        except Exception as e:  # a broken install: say why and skip
            pytest.skip(f"Chromium at {exe} does not start: {str(e).splitlines()[0]}")
        yield b
        b.close()


@pytest.fixture(scope="module")
def worked_server():
    server = make_server(source.worked_explorer(), port=0)
    server.start_in_thread()
    yield server
    server.stop()


def open_page(browser, url, bypass_csp=True):
    """A fresh page that records dialogs, page errors, console messages and every request.

    By default the page's Content-Security-Policy is bypassed: the tests evaluate their own
    probes in the page, and the escaping must hold on its own, without the CSP behind it.
    """
    page = browser.new_page(viewport={"width": 1440, "height": 1000}, bypass_csp=bypass_csp)
    page.events = {"dialogs": [], "errors": [], "requests": [], "console": []}
    page.on("console", lambda m: page.events["console"].append(m.text))
    page.on("dialog", lambda d: (page.events["dialogs"].append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: page.events["errors"].append(str(e)))
    page.on("request", lambda r: page.events["requests"].append(r.url))
    page.add_init_script("window.__alerted = 0; window.alert = () => { window.__alerted += 1; };")
    page.goto(url)
    page.wait_for_selector("body[data-ready]")
    return page


def numbers(page, probe):
    return page.locator(f'#numbers tr[data-probe="{probe}"] .num').all_text_contents()


def lane_labels(page):
    return page.locator("#lanes .lane-label").all_text_contents()


def shown_number(text):
    """The exact number a button shows: '1.106'; '158,016 (158 k)', '1.09 kFLOP (1.088e+3)'."""
    head, _, inner = text.partition(" (")
    for part in (inner.rstrip(")"), head.split(" ")[0]):
        try:
            return float(part.replace(",", ""))
        except ValueError:
            continue
    raise AssertionError(f"no number in {text!r}")


def check_rms_click(page, kind, step):
    """Click the table's RMS of `kind` at `step` for the selected token: the panel shows its
    calculation, and its terms, recomputed here, give the number clicked."""
    button = page.locator(f'#norm .num[data-rms="{kind}"][data-step="{step}"]')
    shown = shown_number(button.text_content())
    button.click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('RMS(')")
    body = page.locator("#explain-body").text_content()
    assert "√(Σ_i x[i]²/D)" in body and "= the traced value ✓" in body
    data = page.evaluate("JSON.parse(document.getElementById('glass-data').textContent)")
    t = int(button.get_attribute("data-token"))
    calc = data["norm"]["calc"][kind][t][step]
    st = calc["steps"][-1]
    total = sum(math.prod(o["value"] ** o.get("power", 1) for o in term) for term in st["terms"])
    total += (st.get("rest") or {}).get("value", 0.0)
    assert math.sqrt(total) == pytest.approx(shown, abs=5e-4)
    assert page.locator("#explain-body .calc-title").text_content().endswith(f"= {button.text_content()}".rstrip("0"))
    return calc


def check_cost_click(page, key):
    """Click a cost: the panel shows its formula with the numbers put in; evaluated here, it
    is the figure shown."""
    button = page.locator(f'#costs .num[data-cost="{key}"]')
    shown = shown_number(button.text_content())
    button.click()
    page.wait_for_function(f"document.querySelector('#explain-body .calc-title').textContent.startsWith('{key} =')")
    lines = page.locator("#explain-body .calc-text").text_content().splitlines()
    filled = lines[1].strip().removeprefix("= ")
    assert re.fullmatch(r"[0-9+\-·/(). ceil]*", filled), filled
    got = eval(filled.replace("·", "*"), {"__builtins__": {}, "ceil": math.ceil})  # noqa: S307
    assert got == pytest.approx(shown, rel=1e-9)
    assert "glassformer.cost’s figure ✓" in page.locator("#explain-body").text_content()
    return got


def heatmap_cells(page):
    """Per head card: {(q, k): (masked, text)}."""
    cards = []
    for card in page.locator("#heatmaps .heatmap-card").all():
        cells = card.locator(".cell").evaluate_all(
            "cs => cs.map(c => [Number(c.dataset.q), Number(c.dataset.k), c.classList.contains('masked'), c.textContent])")
        cards.append({(q, k): (m, t) for q, k, m, t in cells})
    return cards


def test_worked_page_live(browser, worked_server):
    page = open_page(browser, worked_server.url)
    assert lane_labels(page) == ["I", "like", "cats", "too"]

    # The page opens on 'cats'; its query is the walkthrough's [1, -1].
    assert page.locator(".tok.sel").text_content().endswith("cats")
    q = numbers(page, "blocks.0.attn.q")
    assert q == [str(x) for x in FIGURES["head0"]["query"]["cats"]] == ["1", "-1"]

    # Click the 1: its calculation is the dot product of the normed input with W_Q's column 0.
    page.locator('#numbers tr[data-probe="blocks.0.attn.q"] .num').first.click()
    calc = page.locator("#explain-body")
    calc.locator(".calc-title").wait_for()
    assert re.search(r"q\[cats\]\[0\].*= 1$", calc.locator(".calc-title").text_content())
    text = calc.locator(".calc-text").text_content()
    assert "W_Q" in text and text.rstrip().endswith("= 1")
    assert "= the traced value" in calc.text_content()
    # Its operands link to their own calculations: follow the normed input of cats.
    link = calc.locator('.link[data-probe="blocks.0.attn_norm"]').first
    link.click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.includes('attn_norm')")
    assert "RMS" in calc.text_content()
    page.locator("#explain-back").click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.includes('q[cats]')")

    # The pre/post-norm table's RMS and the costs are clickable too. The comparison's models
    # are the walkthrough's two-block ones, not this page's: their operands are not links.
    calc = check_rms_click(page, "post", 2)
    assert page.locator("#explain-body .link").count() == 0 and len(calc["steps"][-1]["terms"]) == 4
    assert check_cost_click(page, "kv_cache_bytes_per_token") == 2 * 1 * 1 * 2 * 4  # 2·L·K·H·b
    check_cost_click(page, "flops_forward")

    # One heatmap per head, T×T cells, exactly the upper triangle masked; the cats row is
    # the walkthrough's weights.
    cards = heatmap_cells(page)
    assert len(cards) == 1
    T = 4
    assert sorted(cards[0]) == [(i, j) for i in range(T) for j in range(T)]
    assert all(cards[0][(i, j)][0] == (j > i) for i in range(T) for j in range(T))
    assert all(cards[0][(i, j)][1] == "" for i in range(T) for j in range(T) if j > i)
    row = [float(cards[0][(2, j)][1]) for j in range(3)]
    assert row == pytest.approx(FIGURES["head0"]["attention_weights_row_cats"][:3], abs=5e-4)
    # Hovering a cell shows query, key, score and weight.
    page.locator('#heatmaps .cell[data-q="2"][data-k="0"]').hover()
    tip = page.locator("#tooltip").text_content()
    assert "query cats" in tip and "key   I" in tip and "score 0.817" in tip and "weight 0.412" in tip

    # FlashAttention, row cats, tiles of 2: the kernel's own m, l, α, step by step.
    flash = FIGURES["flash_attention_tiles_of_2_row_cats"]
    rows = page.locator("#flash table.grid tr").all()
    assert len(rows) == 2  # the header and the first tile
    cells = rows[1].locator("td").all_text_contents()
    assert [float(cells[2]), float(cells[4])] == pytest.approx([flash["tile0"]["m"], flash["tile0"]["l"]], abs=5e-4)
    page.click("#flash-next")
    cells = page.locator("#flash table.grid tr").nth(2).locator("td").all_text_contents()
    assert [float(cells[2]), float(cells[3])] == pytest.approx([flash["tile1"]["m"], flash["tile1"]["alpha"]], abs=5e-4)
    assert "✓ the same" in page.locator("#flash").text_content()
    assert page.locator("#flash .tile.skipped").count() == 1  # (I, like) reading (cats, too)

    ARTIFACTS.mkdir(exist_ok=True)
    page.mouse.move(0, 0)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "viewer-worked.png"), full_page=True)

    # A new sentence: the lanes and heatmaps redraw for it.
    page.fill("#sentence", "you like dogs")
    page.click("#run")
    page.wait_for_function("document.querySelectorAll('#lanes .lane-label').length === 3")
    assert lane_labels(page) == ["you", "like", "dogs"]
    assert len(heatmap_cells(page)[0]) == 9

    # A word outside the vocabulary: a message, and the page keeps what it showed.
    page.fill("#sentence", "I like birds")
    page.click("#run")
    page.locator("#message").wait_for(state="visible")
    assert "unknown word 'birds'" in page.locator("#message").text_content()
    assert lane_labels(page) == ["you", "like", "dogs"]

    # The hostile sentence comes back in the message as text and runs nothing.
    page.fill("#sentence", HOSTILE)
    page.click("#run")
    page.wait_for_function("document.querySelector('#message').textContent.includes('<img')")
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__alerted") == 0 and page.events["dialogs"] == []
    assert page.events["errors"] == []
    page.close()


def test_live_page_asks_for_another_rows_parts(browser, worked_server):
    """The live page's answer holds the focus row's walks and RMS calculations; a click on
    another token asks the server for that row's (POST api/explain, viewer/source.py LiveParts)."""
    page = open_page(browser, worked_server.url)
    asked = lambda: [u for u in page.events["requests"] if u.endswith("/api/explain")]  # noqa: E731
    assert asked() == []
    page.locator('#tokens .tok[data-token="1"]').click()  # 'like'
    # Its row of the pre/post table: drawn disabled, then clickable once its calculations come.
    button = page.locator('#norm .num[data-rms="pre"][data-step="2"][data-token="1"]')
    page.wait_for_function("!document.querySelector('#norm .num[data-rms=\"pre\"][data-step=\"2\"]').disabled")
    shown = button.text_content()
    button.click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('RMS(')")
    body = page.locator("#explain-body").text_content()
    assert "like" in page.locator("#explain-body .calc-title").text_content() and "= the traced value ✓" in body
    assert page.locator("#explain-body .calc-title").text_content().endswith(f"= {shown}".rstrip("0"))
    # Its FlashAttention walk, tiles of 2 (one tile: the kernel's result is shown at once), then of 1.
    page.wait_for_function("document.querySelector('#flash').textContent.includes('✓ the same')")
    assert "Query row “like”" in page.locator("#flash").text_content()
    page.select_option("#flash-tile", "1")
    page.wait_for_function("document.querySelector('#flash-step').textContent.startsWith('step 1 of 2')")
    assert page.locator("#flash table.grid tr td.muted").count() == 2  # keys too and cats: skipped
    page.click("#flash-next")
    assert "✓ the same" in page.locator("#flash").text_content()
    assert len(asked()) == 3  # the RMS row, the walks at 2, the walks at 1: each once
    page.locator('#tokens .tok[data-token="2"]').click()  # back to 'cats': its RMS row is in the answer,
    page.wait_for_function("document.querySelector('#flash-step').textContent.includes(' of 3 on this row')")
    page.locator('#tokens .tok[data-token="1"]').click()  # its walks at 1 were not; 'like' again: asked before
    page.wait_for_function("document.querySelector('#flash-step').textContent.includes(' of 2 on this row')")
    assert len(asked()) == 4 and page.events["errors"] == []
    page.close()


def test_saved_pages_offline_and_hostile_tokens_are_text(browser, tmp_path):
    # The self-contained worked page: opens from a file, fetches nothing, and its numbers'
    # calculations are stored in it.
    path = source.write_worked_page(tmp_path / "worked.html")
    # With its Content-Security-Policy in force, the page still draws and reports no violation.
    page = open_page(browser, path.as_uri(), bypass_csp=False)
    assert lane_labels(page) == ["I", "like", "cats", "too"]
    assert not [m for m in page.events["console"] if "Content Security Policy" in m], page.events["console"]
    page.close()
    page = open_page(browser, path.as_uri())
    assert {u for u in page.events["requests"]} == {path.as_uri()}
    assert numbers(page, "blocks.0.attn.q") == ["1", "-1"]
    page.locator('#numbers tr[data-probe="blocks.0.attn.k_rot"] .num').first.click()
    assert page.locator("#explain-body .calc-title").text_content().endswith(
        f"= {FIGURES['head0']['rotated_key']['cats'][0]}")
    assert "cos" in page.locator("#explain-body").text_content()
    assert page.locator("#sentence").is_disabled()
    page.close()

    # The page of a trace file: its RMS operands are its own stream numbers, and link to
    # their calculations (stored in the file).
    model = tiny_model()
    tr = fixture_trace(model, [1, 2, 3, 4], ["a", "b", "c", "d"])
    out = source.write_trace_page(tr, tmp_path / "trace.html")
    page = open_page(browser, out.as_uri())
    check_rms_click(page, model.config.norm_placement, 1)
    link = page.locator("#explain-body .link").first
    name, idx = link.get_attribute("data-probe"), json.loads(link.get_attribute("data-index"))
    assert name == "blocks.0.resid_mid" and idx[0] == 3
    value = float(link.locator("xpath=..").locator(".val").text_content().lstrip("="))
    link.click()
    page.wait_for_function("(t => t.includes('resid_mid[d]') && !t.startsWith('RMS('))"
                           "(document.querySelector('#explain-body .calc-title').textContent)")
    title = page.locator("#explain-body .calc-title").text_content()
    assert shown_number(title.rsplit("= ", 1)[1]) == pytest.approx(value, abs=5e-4)
    assert "= the traced value ✓" in page.locator("#explain-body").text_content()
    check_cost_click(page, "params")
    assert page.events["errors"] == []
    page.close()

    # A page whose tokens are themselves HTML shows them as text.
    toks = ["the", HOSTILE, "</script><script>alert(2)</script>", "mat"]
    out = render.write_html(tmp_path / "hostile.html", fixture_trace(model, [1, 2, 3, 4], toks), sentence=" ".join(toks))
    page = open_page(browser, out.as_uri())
    chips = page.locator("#tokens .tok").all_text_contents()
    assert [c[1:] for c in chips] == [token_label(t) for t in toks]  # each chip: its position digit, then the token
    assert lane_labels(page)[1].startswith("<img\u2423src=x")
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__alerted") == 0 and page.events["dialogs"] == []
    assert page.events["errors"] == []
    page.close()


def test_newline_and_leading_space_tokens_are_drawn(browser, tmp_path):
    # A newline token was an empty box and a leading space was not there at all.
    toks = ["the", " cat", "\n", "sat"]
    pieces = lambda i: "\n" if i % 2 else f" w{i}"  # noqa: E731
    out = render.write_html(tmp_path / "spaces.html", fixture_trace(tiny_model(), [1, 2, 3, 4], toks),
                            sentence="the cat\nsat", pieces=pieces)
    page = open_page(browser, out.as_uri())
    chips = page.locator("#tokens .tok").all_text_contents()
    assert [c[1:] for c in chips] == ["the", "\u2423cat", "\u21b5", "sat"]
    shown = page.locator("#next .cand .piece").all_text_contents()
    assert "\u21b5" in shown and any(s.startswith("\u2423w") for s in shown)
    assert not [s for s in shown if not s or re.search(r"\s", s)]
    assert page.events["errors"] == []
    page.close()


def test_one_heatmap_per_head_gqa(browser):
    server = make_server(source.worked_explorer("gqa"), port=0)
    server.start_in_thread()
    try:
        page = open_page(browser, server.url)
        cards = heatmap_cells(page)
        T = 4
        assert len(cards) == 4
        for card in cards:
            assert sorted(card) == [(i, j) for i in range(T) for j in range(T)]
            assert all(card[(i, j)][0] == (j > i) for i in range(T) for j in range(T))
        mh = FIGURES["multi_head"]
        for h, key in ((0, "gqa_head0_weights_cats"), (1, "gqa_head1_weights_cats")):
            assert [float(cards[h][(2, j)][1]) for j in range(3)] == pytest.approx(mh[key], abs=5e-3)
        assert page.events["errors"] == []
        page.close()
    finally:
        server.stop()
