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
