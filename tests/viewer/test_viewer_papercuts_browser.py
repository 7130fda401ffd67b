"""Issue 47's small things, in a real browser: numbers keep their significant digits, a negative
square keeps its parentheses, a max step says what it left out (not "summed"), a sampling stage that
cut nothing says so, and the GQA heat maps' row labels stand beside their grid."""

from __future__ import annotations

import re

import pytest

from glassformer.text.tokenizer import Tokenizer
from glassformer.viewer import source

from ..support import reinit, synthetic_text, tiny_model
from .test_viewer_browser import browser  # noqa: F401  (a fixture: Debian's Chromium)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def tiny_page(tmp_path_factory, one_thread):
    """A saved page of a tiny random model with a 300-entry BPE vocabulary: wider than a step lists."""
    tok = Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)
    model = reinit(tiny_model(vocab_size=tok.vocab_size), std=0.5).eval()
    path = tmp_path_factory.mktemp("cuts") / "tiny.html"
    return source.write_page(path, model, tok, "the king and the queen", model_name="tiny").as_uri()


@pytest.fixture(scope="module")
def page(browser, tiny_page):  # noqa: F811
    p = browser.new_page(viewport={"width": 1440, "height": 1000}, bypass_csp=True)
    p.set_default_timeout(5000)
    p.goto(tiny_page)
    p.wait_for_selector("body[data-ready]")
    yield p
    p.close()


def test_small_numbers_keep_three_significant_digits(page):
    shown = page.evaluate("[0.0012345, 0.0456, -0.0207, 0.5, 0.1234, 2.5e-5, 0].map(Glass.fmt)")
    assert shown == ["0.00123", "0.0456", "-0.0207", "0.5", "0.123", "2.5e-5", "0"]


def test_a_negative_square_keeps_its_parentheses(page):
    label = page.locator("#lanes .rms").first
    label.click(force=True)
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('RMS of')")
    text = page.locator("#explain-body .calc-text").text_content()
    assert "²" in text and not re.search(r"(^|[^(\d.])-[\d.]+²", text), text
    assert re.search(r"\(-[\d.]+\)²", text), text  # the stream has negative entries: shown (−x)²


def test_a_max_step_says_what_it_left_out(page):
    page.locator("#next .num").first.click()  # a probability: max over the kept logits, then the softmax
    page.wait_for_selector("#explain-body .calc-step")
    steps = page.locator("#explain-body .calc-step").all_text_contents()
    top = next(s for s in steps if "max" in s)
    assert "summed" not in top and re.search(r"… \d+ more entries not listed, the largest of them", top), top
    soft = steps[-1]
    assert "terms exp(x − m) of the denominator, together" in soft, soft


def test_a_stage_that_cut_nothing_says_so(page):
    page.wait_for_selector('#sample .stage-card[data-stage="logits"]')
    raw = page.locator('#sample .stage-card[data-stage="logits"] .note').first.text_content()
    assert raw == "all 300 ids kept (none cut)"
    notes = " ".join(page.locator("#sample .note").all_text_contents())
    assert "the others' probability" not in notes and "more kept, together probability" in notes


def test_gqa_row_labels_stand_beside_their_grid(browser, tmp_path):  # noqa: F811
    parts = source.worked_parts("gqa")
    path = source.write_page(tmp_path / "gqa.html", parts.pop("model"), parts.pop("tokenizer"), "I like cats too", **parts)
    p = browser.new_page(viewport={"width": 1440, "height": 1000}, bypass_csp=True)
    p.goto(path.as_uri())
    p.wait_for_selector("body[data-ready]")
    gaps = p.evaluate("""() => Array.from(document.querySelectorAll('.heatmap')).map((g) => {
        const label = g.querySelector('.qhdr').getBoundingClientRect(), cell = g.querySelector('.cell').getBoundingClientRect();
        return cell.left - label.right; })""")
    assert len(gaps) == 4 and all(0 <= gap <= 8 for gap in gaps), gaps  # four query heads, two KV heads
    p.close()


def test_the_worked_pages_generate_works_with_its_own_defaults(browser):  # noqa: F811
    # The form offered 20 new tokens to a model that reads 16: pressing Generate was an error.
    from glassformer.viewer.server import make_server

    server = make_server(source.worked_explorer(), port=0)
    server.start_in_thread()
    p = browser.new_page(viewport={"width": 1366, "height": 900}, bypass_csp=True)  # the test's own probes
    p.set_default_timeout(10000)
    try:
        p.goto(server.url + "/")
        p.wait_for_selector("body[data-ready]")
        assert p.locator("#gen-max").input_value() == "12" and p.locator("#gen-max").get_attribute("max") == "12"
        p.locator("#generate").click()
        p.wait_for_selector("#view-generated:not([hidden]) .gen-tok")
        assert p.locator("#message").is_hidden()
        assert 1 <= p.locator("#view-generated .gen-text .gen-tok").count() <= 12
    finally:
        p.close()
        server.stop()
