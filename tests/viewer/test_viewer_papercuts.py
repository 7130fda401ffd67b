"""Small things of the explorer a learner met first (issue 47's papercuts), each checked here
without a browser: Generate with its own defaults on the worked model, the tokenizer view of a
word vocabulary, ..."""

from __future__ import annotations

import json

import pytest

from glassformer.viewer import source
from glassformer.viewer.server import make_server
from glassformer.worked import model as worked

from .test_viewer_server import post_json


@pytest.fixture(scope="module")
def worked_served():
    server = make_server(source.worked_explorer(), port=0)
    server.start_in_thread()
    yield server
    server.stop()


def test_generate_without_max_tokens_fits_the_worked_models_context(worked_served):
    # The toy model reads 16 tokens; 'I like cats too' is 4, so 20 new ones cannot fit: the default
    # comes down to the room left instead of failing.
    status, _, body = post_json(worked_served, "/api/generate", {"text": worked.SENTENCE, "temperature": 0.0})
    assert status == 200, body
    out = json.loads(body)
    context = out["trace"]["config"]["max_seq_len"]
    assert context == 16
    g = out["generated"]
    assert 1 <= len(g["tokens"]) <= context - 4 and len(out["trace"]["tokens"]) <= context
    assert source.default_tokens(4, 16) == 12 and source.default_tokens(4, 4096) == 20


def test_a_softmax_names_every_vocabulary_entry_as_the_page_draws_it(one_thread):
    # The trace knows the pieces of its own text only; an id it predicts but never read was "#199"
    # in the calculation while the page's title called it by its piece.
    from glassformer.text.labels import token_label
    from glassformer.text.tokenizer import Tokenizer

    from ..support import reinit, synthetic_text, tiny_model

    tok = Tokenizer.train([synthetic_text(200, 1) + "\n"], vocab_size=300)
    model = reinit(tiny_model(vocab_size=tok.vocab_size), std=0.5)
    ex = source.explorer(model, tok, "the king", model_name="tiny")
    page = ex.payload("the king")
    t = len(page["trace"]["tokens"]) - 1
    ids = page["trace"]["probes"]["logits"]["index"]["vocab"][t]
    unread = next(i for i in ids if i not in page["trace"]["ids"])
    calc = ex.calculation("the king", "probs", [t, unread])
    labels = [o["label"] for st in calc["steps"] for o in st.get("over") or []]
    assert labels and not any("#" in lab for lab in labels), labels
    assert any(token_label(tok.id_to_piece(unread)) in lab for lab in labels)
    assert "#" not in calc["label"] and "#" not in calc["text"]
