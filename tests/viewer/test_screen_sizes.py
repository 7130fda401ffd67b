"""The explorer at every screen size (issue 47): at 390, 768, 1024, 1366 and 1920 px the page never
scrolls sideways; a click on a number shows its calculation inside the screen (a drawer below 1100 px,
with its back chain); Tab reaches a number, Enter opens it and Escape closes the drawer and gives the
focus back; the section menu lists the sections in page order, the tokenizer first. One browser, one
saved worked page, one page load per width; a screenshot per width goes to test-artifacts/."""

from __future__ import annotations

import pytest

from glassformer.viewer import source

from .test_viewer_browser import ARTIFACTS, browser  # noqa: F401  (a fixture: Debian's Chromium)

pytestmark = pytest.mark.browser

# (width, height): a phone, a tablet upright, a tablet lying down, a laptop, a desktop.
SIZES = [(390, 844), (768, 1024), (1024, 768), (1366, 768), (1920, 1080)]
DRAWER_BELOW = 1100  # glass.css: narrower than this, #explain is a drawer


@pytest.fixture(scope="module")
def worked_page(tmp_path_factory):
    return source.write_worked_page(tmp_path_factory.mktemp("sizes") / "worked.html").as_uri()


def _in_view(page, selector: str) -> bool:
    return page.evaluate("""(sel) => { const r = document.querySelector(sel).getBoundingClientRect();
        const s = getComputedStyle(document.querySelector(sel));
        return s.visibility !== 'hidden' && s.display !== 'none' && r.height > 0 && r.top >= -1 && r.left >= -1
            && r.bottom <= innerHeight + 1 && r.right <= innerWidth + 1; }""", selector)


def _title(page) -> str:
    return page.locator("#explain-body .calc-title").text_content()


@pytest.mark.parametrize("width,height", SIZES, ids=[f"{w}px" for w, _ in SIZES])
def test_the_page_at_every_width(browser, worked_page, width, height):  # noqa: F811
    page = browser.new_page(viewport={"width": width, "height": height}, bypass_csp=True)  # the test's own probes
    page.set_default_timeout(5000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.emulate_media(reduced_motion="reduce")  # the drawer opens without its slide
    page.goto(worked_page)
    page.wait_for_selector("body[data-ready]")
    page.wait_for_function("document.querySelectorAll('#section-list a').length > 0")
    narrow = width < DRAWER_BELOW

    # No sideways scrolling: nothing is wider than the screen.
    wide = page.evaluate("""() => Array.from(document.querySelectorAll('body *')).filter((e) => {
        const r = e.getBoundingClientRect(); return r.width > 0 && r.right > innerWidth + 1 && !e.closest('.view, .heatmap-card, .scroll');
      }).slice(0, 5).map((e) => e.tagName + '#' + e.id + '.' + e.className)""")
    assert page.evaluate("document.documentElement.scrollWidth") <= width, wide

    # The section menu: every section shown, in page order, numbered as the page numbers them; the tokenizer
    # comes before the sections that read its ids.
    ids = page.evaluate("Array.from(document.querySelectorAll('#section-list a')).map((a) => a.dataset.section)")
    shown = page.evaluate("Array.from(document.querySelectorAll('#views > section.view')).filter((s) => !s.hidden).map((s) => s.id)")
    assert ids == shown and ids.index("view-tokenizer") < ids.index("view-lanes")
    numbers = page.evaluate("Array.from(document.querySelectorAll('#views > section.view:not([hidden]) h2 .n')).map((n) => n.textContent)")
    assert numbers == [str(k + 1) for k in range(len(numbers))]
    page.locator("#section-menu summary").click()
    page.locator('#section-list a[data-section="view-decode"]').click()
    page.wait_for_function("Math.abs(document.getElementById('view-decode').getBoundingClientRect().top) < 120")

    # A click on a number deep in the page: its calculation inside the screen; an operand's, then back.
    number = page.locator('#numbers tr[data-probe="blocks.0.attn.q"] button.num').first  # its operands link on
    number.click()
    page.wait_for_selector("#explain-body .calc-title")
    first = _title(page)
    page.wait_for_function("document.getElementById('explain').classList.contains('open')")
    assert _in_view(page, "#explain"), f"the calculation is outside the screen at {width} px"
    assert _in_view(page, "#explain-back")
    link = page.locator("#explain-body .operands button.link").first
    link.click()
    page.wait_for_function("(t) => document.querySelector('#explain-body .calc-title').textContent !== t", arg=first)
    assert _in_view(page, "#explain")
    page.locator("#explain-back").click()
    assert _title(page) == first
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"explorer-{width}px.png"))

    # Escape closes the drawer and gives the focus back to the number; Tab reaches a number, Enter opens it.
    page.keyboard.press("Escape")
    page.wait_for_function("!document.getElementById('explain').classList.contains('open')")
    if narrow:
        page.wait_for_function("getComputedStyle(document.getElementById('explain')).visibility === 'hidden'")
    page.locator("#num-layer").focus()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.matches('#numbers button.num')")
    focused = page.evaluate("document.activeElement.title")
    page.keyboard.press("Enter")
    page.wait_for_function("document.getElementById('explain').classList.contains('open')")
    assert _in_view(page, "#explain")
    page.keyboard.press("Escape")
    page.wait_for_function("!document.getElementById('explain').classList.contains('open')")
    assert page.evaluate("document.activeElement.title") == focused  # the focus is back on the number
    assert errors == []
    page.close()
