"""The generated-text view in a real browser (Playwright, Debian's Chromium: see test_viewer_browser.py):
the page's Generate form draws generate's tokens for the seed, each as text.labels.token_label's
(a newline token ↵, a leading space ␣) with the probability a full forward gives it; Enter on a
token opens its decode step (the cache up to the position before it, that row of scores), its
sampler's stages and its alternatives; the saved page of `generate --html` draws the same."""

from __future__ import annotations

import pytest
import torch

from glassformer.text.labels import token_label
from glassformer.tracing.trace import trace
from glassformer.viewer import source

from .test_viewer_browser import HOSTILE, browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_generated import N, PROMPT, SETTINGS, full_forward, parts, reference_tokens, served  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def seeded(parts):  # noqa: F811
    """Settings whose N new tokens hold a newline token and a leading-space one (found with generate)."""
    model, tok, _ = parts
    for seed in range(60):
        s = {**SETTINGS[0], "seed": seed}
        pieces = [tok.id_to_piece(i) for i in reference_tokens(model, tok, s)]
        if any("\n" in p for p in pieces) and any(p.startswith(" ") and p.strip() for p in pieces):
            return s
    pytest.fail("no seed in 0..59 generates both a newline token and a leading-space one")


def drawn_tokens(page) -> list[tuple[int, float, str]]:
    page.wait_for_selector("#view-generated .gen-text .gen-tok")
    return page.locator("#view-generated .gen-text .gen-tok").evaluate_all(
        "bs => bs.map(b => [Number(b.dataset.id), Number(b.dataset.prob), b.textContent])")


def check_tokens(model, tok, got, want, probs=None):
    """The drawn tokens are generate's, labelled by token_label, with a full forward's probabilities
    (probs: that forward's softmax (T, V), computed beforehand)."""
    assert [i for i, _, _ in got] == want
    n = len(tok.encode(PROMPT))
    if probs is None:
        probs = torch.softmax(full_forward(model, tok.encode(PROMPT) + want).double(), -1)  # (T, V)
    for j, (i, p, text) in enumerate(got):
        assert p == pytest.approx(float(probs[n + j - 1, i]), abs=1e-6)
        assert text == token_label(tok.id_to_piece(i))
    texts = [t for *_, t in got]
    assert any("\u21b5" in t for t in texts) and any(t.startswith("\u2423") and len(t) > 1 for t in texts)
    return next(j for j, t in enumerate(texts) if "\u21b5" in t)


def open_step(page, j: int, n: int) -> int:
    """Enter on the j-th new token: its step opens; returns its query position."""
    page.locator(f'#view-generated .gen-tok[data-index="{j}"]').press("Enter")  # focused, then the key
    page.wait_for_selector(f'#gen-detail[data-index="{j}"]')
    detail = page.locator("#gen-detail")
    assert int(detail.get_attribute("data-position")) == n + j
    q = int(detail.get_attribute("data-query"))
    assert q == n + j - 1
    assert page.locator("#gen-detail .gen-cache tr").count() == q + 2  # a header, then positions 0..q
    assert page.locator("#gen-detail .gen-cache tr.hl td").first.text_content() == str(q)
    return q


def test_generate_from_the_page(browser, served, parts, seeded):  # noqa: F811
    model, tok, _ = parts
    # Every reference first: the server runs this same model whenever the page asks (setting its
    # mode and attention kernel while it traces), so the test does not run it while the page is live.
    want = reference_tokens(model, tok, seeded)
    ids = tok.encode(PROMPT) + want
    logits = full_forward(model, ids)
    probs_all = torch.softmax(logits.double(), -1)  # (T, V)
    traced = trace(model, ids).probes["blocks.0.attn.scores"].data
    page = open_page(browser, served.url)
    assert page.locator("#view-generated").is_hidden()
    page.fill("#sentence", PROMPT)
    page.fill("#gen-max", str(N))
    page.fill("#gen-seed", str(seeded["seed"]))
    page.click("#generate")
    got = drawn_tokens(page)
    j = check_tokens(model, tok, got, want, probs_all)
    n = len(tok.encode(PROMPT))
    q = open_step(page, j, n)

    # Its one new row of scores is the trace's row q for the chosen head.
    page.select_option('#gen-detail .gen-decode select[aria-label="head"]', "1")
    page.wait_for_function("document.querySelector('#gen-detail .gen-decode select[aria-label=\"head\"]').value === '1'")
    scores = traced[q, 1, :q + 1]
    shown = page.locator("#gen-detail .gen-row tr[data-key] td:nth-child(2) .num").evaluate_all(
        "bs => bs.map(b => Number(b.title.split(' = ').pop()))")
    assert shown == pytest.approx(scores.tolist(), abs=1e-5)

    # The sampler's last stage and the alternatives: probabilities with their calculations.
    bars = page.locator('#gen-detail .stage-card[data-stage="probs"] .sample-bar').evaluate_all(
        "rs => rs.map(r => [Number(r.dataset.id), Number(r.dataset.prob), r.classList.contains('chosen')])")
    assert [i for i, _, chosen in bars if chosen] == [want[j]]  # among the ten, or drawn below them
    probs = probs_all[q]  # temperature 1, no filters: the raw ones
    assert [p for _, p, _ in bars] == pytest.approx([float(probs[i]) for i, _, _ in bars], abs=1e-6)
    page.locator("#gen-detail .gen-alt .num").first.click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('p(')")
    assert "the traced value ✓" in page.locator("#explain-body").text_content()

    k = j + 1 if j + 1 < len(want) else j - 1
    page.locator(f'#view-generated .gen-tok[data-index="{j}"]').press("ArrowRight" if k > j else "ArrowLeft")
    page.wait_for_selector(f'#gen-detail[data-index="{k}"]')  # the arrows walk the tokens

    # A prompt that is itself HTML is drawn as text, token by token, and runs nothing.
    page.fill("#sentence", HOSTILE)
    page.fill("#gen-max", "3")
    page.click("#generate")
    page.wait_for_function("document.querySelector('#view-generated .gen-prompt') && "
                           "document.querySelector('#view-generated .gen-text').textContent.includes('onerror')")
    assert page.locator("#view-generated img").count() == 0 and page.evaluate("window.__alerted") == 0
    assert not page.events["errors"] and not page.events["dialogs"]


def test_saved_page_draws_the_same(browser, parts, seeded, tmp_path):  # noqa: F811
    model, tok, _ = parts
    path, part = source.write_generated_page(tmp_path / "gen.html", model, tok, PROMPT, N, seeded, model_name="tiny")
    page = open_page(browser, path.as_uri(), bypass_csp=False)
    want = reference_tokens(model, tok, seeded)
    j = check_tokens(model, tok, drawn_tokens(page), want)
    assert page.locator("#generate-form").count() == 0  # a saved page cannot generate
    open_step(page, j, len(tok.encode(PROMPT)))
    assert page.locator('#gen-detail .stage-card[data-stage="probs"] .sample-bar.chosen').count() == 1
    page.locator('#view-generated .gen-tok[data-index="0"]').click()  # a click opens a step too
    page.wait_for_selector('#gen-detail[data-index="0"]')
    assert page.locator("#gen-detail .gen-row tr[data-key]").count() == len(tok.encode(PROMPT))  # the prompt's row
    assert not page.events["errors"] and not [r for r in page.events["requests"] if not r.startswith("file:")]
