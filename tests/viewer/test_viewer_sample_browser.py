"""The sampling panel in a real browser (Playwright, Debian's Chromium: see test_viewer_browser.py):
moving its controls from the keyboard redraws bars equal to the sampler's probabilities from a full
forward, and the chosen token is generate's."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.generation import apply_repetition_penalty, generate, logits_to_probs
from glassformer.generation.sampling_stages import STAGES
from glassformer.viewer import source

from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_sample import TEXT, parts, served  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser


def reference(model, ids, position, s) -> torch.Tensor:
    """The sampler's probabilities (V,) for the token after `position`, from a full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][:, position]  # (1, V)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[0, ids[:position + 1]] = True
    logits = apply_repetition_penalty(logits, seen, s["repetition_penalty"])
    return logits_to_probs(logits, s["temperature"], s["top_k"], s["top_p"], s["min_p"])[0]


def drawn(page, want: str) -> dict:
    """Wait for the panel's answer to settings satisfying the JS test `want` (on `s`), then read
    it: the settings, the chosen id, each stage's bars as {id: probability}."""
    page.wait_for_function("(() => { const b = document.getElementById('sample');"
                           " if (!b.dataset.settings || b.classList.contains('stale')) return false;"
                           f" const s = JSON.parse(b.dataset.settings); return {want}; }})()")
    box = page.locator("#sample")
    stages = {}
    for card in box.locator(".stage-card").all():
        bars = card.locator(".sample-bar").evaluate_all("rs => rs.map(r => [Number(r.dataset.id), Number(r.dataset.prob)])")
        stages[card.get_attribute("data-stage")] = bars
    return {"settings": json.loads(box.get_attribute("data-settings")), "chosen": int(box.get_attribute("data-chosen")),
            "position": int(box.get_attribute("data-position")), "stages": stages}


def check(model, ids, got):
    s, t = got["settings"], got["position"]
    probs = reference(model, ids, t, s)
    bars = got["stages"]["probs"]
    assert len(bars) == min(10, int((probs > 0).sum()))
    assert [i for i, _ in bars] == probs.topk(len(bars)).indices.tolist()
    for i, p in bars:
        assert p == pytest.approx(float(probs[i]), abs=1e-6)
    assert got["chosen"] == next(generate(model, ids[:t + 1], max_new_tokens=1, **s))


def test_moving_temperature_and_top_p(browser, served, parts):  # noqa: F811
    model, tok, _ = parts
    ids = tok.encode(TEXT)
    page = open_page(browser, served.url)
    first = drawn(page, "true")
    assert list(first["stages"]) == ["logits", "repetition_penalty", "temperature", "top_k", "top_p", "min_p", "probs"]
    check(model, ids, first)

    page.locator('#tokens .tok[data-token="3"]').click()
    page.fill("#sample-seed", "5")
    page.focus("#sample-temperature")
    for _ in range(6):
        page.keyboard.press("ArrowLeft")  # 1 -> 0.7, from the keyboard
    got = drawn(page, "Math.abs(s.temperature - 0.7) < 1e-9 && s.seed === 5")
    assert got["position"] == 3 and got["settings"]["top_p"] is None
    check(model, ids, got)

    page.focus("#sample-top-p")
    for _ in range(5):
        page.keyboard.press("ArrowLeft")  # 1 -> 0.75
    page.fill("#sample-top-k", "20")
    page.focus("#sample-penalty")
    page.keyboard.press("ArrowRight")  # 1 -> 1.05
    got = drawn(page, "Math.abs(s.top_p - 0.75) < 1e-9 && s.top_k === 20 && s.repetition_penalty > 1")
    check(model, ids, got)
    assert len(got["stages"]["top_k"]) == 10 and got["stages"]["top_p"] == got["stages"]["min_p"]
    assert page.locator("#sample .sample-bar.chosen").count() == (got["chosen"] in dict(got["stages"]["probs"]))
    assert len(got["stages"]["probs"]) < 10  # the cuts matter here: fewer than 10 ids are left
    # Each probability opens its calculation, stage by stage; recomputed, it is the sampler's.
    page.locator('#sample .stage-card[data-stage="probs"] .sample-bar').first.click()
    page.wait_for_function("document.querySelector('#explain-body .calc-title').textContent.startsWith('p(“')")
    assert "÷ temperature 0.7" in page.locator("#explain-body .calc-text").text_content()
    assert "✓" in page.locator("#explain-body").text_content()
    click_every_stage(page)
    assert page.events["errors"] == []
    page.close()


def click_every_stage(page) -> None:
    """A bar of every stage opens that stage's calculation, recomputed equal to the bar's value (✓)."""
    titles = []
    for name in STAGES:
        bar = page.locator(f'#sample .stage-card[data-stage="{name}"] .sample-bar').first
        bar.click()
        title = page.locator("#explain-body .calc-title").text_content()
        assert bar.locator(".piece").text_content().lstrip("• ") in title
        assert "✓" in page.locator("#explain-body").text_content(), (name, title)
        titles.append(title)
    assert len(set(titles)) >= 4  # each stage its own calculation (a disabled one repeats its input's)


SAVED_TEXT = "The king and queen walk"


@pytest.fixture(scope="module")
def saved(parts, tmp_path_factory):  # noqa: F811
    model, tok, _ = parts
    return source.write_page(tmp_path_factory.mktemp("saved") / "page.html", model, tok, SAVED_TEXT, model_name="tiny")


def test_saved_page_steps_over_its_grid(browser, saved, parts):  # noqa: F811
    """A saved page's sliders step over the grid it holds and redraw the server's answers: the bars are
    the sampler's probabilities and the draw generate's, with no server behind the page."""
    model, tok, _ = parts
    ids = tok.encode(SAVED_TEXT)
    page = open_page(browser, saved.as_uri())
    check(model, ids, drawn(page, "s.temperature === 1 && s.top_p === null"))
    assert page.locator("#sample-top-k").is_disabled() and page.locator("#sample-seed").is_disabled()
    page.focus("#sample-temperature")
    page.keyboard.press("ArrowLeft")  # the grid's next temperature down: 0.8
    got = drawn(page, "s.temperature === 0.8 && s.top_p === null")
    assert page.locator("#sample-temperature-out").text_content() == "0.8"
    check(model, ids, got)
    page.focus("#sample-top-p")
    for _ in range(3):
        page.keyboard.press("ArrowLeft")  # 1 (off) -> 0.95 -> 0.9 -> 0.8
    got = drawn(page, "s.temperature === 0.8 && s.top_p === 0.8")
    check(model, ids, got)
    click_every_stage(page)
    # Another token the grid holds (the middle one), and one it does not.
    mid = len(ids) // 2
    page.locator(f'#tokens .tok[data-token="{mid}"]').click()
    check(model, ids, drawn(page, f"s.top_p === 0.8 && Number(b.dataset.position) === {mid}"))
    page.focus("#sample-temperature")
    for _ in range(3):
        page.keyboard.press("ArrowLeft")  # down to 0: greedy
    got = drawn(page, f"s.temperature === 0 && Number(b.dataset.position) === {mid}")
    want = next(generate(model, ids[:mid + 1], max_new_tokens=1, temperature=0))
    assert [i for i, _ in got["stages"]["probs"]] == [got["chosen"]] == [want]
    page.locator('#tokens .tok[data-token="1"]').click()
    assert "holds the sampling view of tokens" in page.locator("#sample").text_content()
    assert page.events["errors"] == []
    page.close()
