"""The sampling panel in a real browser (Playwright, Debian's Chromium: see test_viewer_browser.py):
moving its controls from the keyboard redraws bars equal to the sampler's probabilities from a full
forward, and the chosen token is generate's."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.generation import apply_repetition_penalty, generate, logits_to_probs
from glassformer.viewer.server import make_server

from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_sample import TEXT, parts  # noqa: F401 (a fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def server(parts):  # noqa: F811
    s = make_server(parts[2], port=0)
    s.start_in_thread()
    yield s
    s.stop()


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


def test_moving_temperature_and_top_p(browser, server, parts):  # noqa: F811
    model, tok, _ = parts
    ids = tok.encode(TEXT)
    page = open_page(browser, server.url)
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
    assert page.events["errors"] == []
    page.close()
