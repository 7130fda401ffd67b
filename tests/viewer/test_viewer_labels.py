"""Every token label the explorer page draws comes from the server as text.labels.token_label's:
a newline token reads ↵ and a leading space ␣ (issue: a newline was an empty box, a leading
space not there at all), while the raw tokens stay in the data for what needs them."""

from __future__ import annotations

import json
import re

import pytest

from glassformer.text.tokenizer import Tokenizer
from glassformer.viewer import render, source

from ..support import synthetic_text, tiny_model

TEXT = "the king\nand the queen"
SETTINGS = dict(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, seed=0)


def drawn(s: str) -> str:
    """The reference for plain ASCII text: a space drawn ␣, a newline ↵."""
    return s.replace(" ", "\u2423").replace("\n", "\u21b5")


def plain(s: str) -> bool:
    """Printable ASCII, spaces and newlines: the text `drawn` is the reference for."""
    return re.fullmatch(r"[ -~\n]+", s) is not None


@pytest.fixture(scope="module")
def parts():
    tok = Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)
    model = tiny_model(vocab_size=tok.vocab_size)
    return tok, source.explorer(model, tok, TEXT, model_name="tiny")


def test_token_chips_and_next_tokens_are_labelled(parts):
    tok, explorer = parts
    payload = explorer.payload(TEXT)
    pieces = [tok.id_to_piece(i) for i in tok.encode(TEXT)]
    assert "\n" in pieces and any(p.startswith(" ") for p in pieces)  # the text has both kinds
    assert payload["trace"]["tokens"] == pieces  # the raw tokens stay
    assert payload["labels"] == [drawn(p) for p in pieces]
    assert "\u21b5" in payload["labels"] and any(lab.startswith("\u2423") for lab in payload["labels"])
    shown = [c for row in payload["next"] for c in row]
    assert shown and all(c["label"] == drawn(c["piece"]) for c in shown if plain(c["piece"]))
    assert not [c for row in payload["next"] for c in row if not c["label"] or re.search(r"\s", c["label"])]
    # The page served and the page saved carry the same labels in their data.
    page = render.render_html(payload, inline=True)
    data = json.loads(re.search(r'<script type="application/json" id="glass-data">(.*?)</script>', page, re.S).group(1))
    assert data["labels"] == payload["labels"] and data["next"] == payload["next"]


def test_sampling_pieces_are_labelled(parts):
    _, explorer = parts
    out = explorer.sample(TEXT, 2, SETTINGS)
    assert out["labels"].keys() == out["pieces"].keys()
    assert all(out["labels"][i] == drawn(p) for i, p in out["pieces"].items() if plain(p))
    assert not [lab for lab in out["labels"].values() if not lab or re.search(r"\s", lab)]
    for i, calc in out["calc"].items():
        assert calc["title"].startswith(f"p(“{out['labels'][i]}”) = ")


def test_saved_page_labels(parts, tmp_path):
    tok, _ = parts
    model = tiny_model(vocab_size=tok.vocab_size)
    path = source.write_page(tmp_path / "page.html", model, tok, TEXT, model_name="tiny")
    page = path.read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="glass-data">(.*?)</script>', page, re.S).group(1))
    assert data["labels"] == [drawn(tok.id_to_piece(i)) for i in tok.encode(TEXT)]
