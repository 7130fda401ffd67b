"""The OpenAI-compatible server takes POST bodies only as `application/json` (serve/json_only.py):
a text/plain or form POST, which any web page can send without a CORS preflight, is answered 415
with OpenAI's error object, and no request reaches the engine."""

from __future__ import annotations

import httpx
import pytest

from .served import KEY, NAME, Served

BODIES = {
    "/v1/completions": {"model": NAME, "prompt": "The king", "max_tokens": 2},
    "/v1/chat/completions": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"model": NAME, "prompt": "The king"},
    "/detokenize": {"model": NAME, "tokens": [1, 2]},
}
NOT_JSON = [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/jsonp"]


@pytest.fixture(scope="module")
def served():
    s = Served(max_batch=2, engine="thread")
    yield s
    s.stop()


def test_post_bodies_must_say_they_are_json(served):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in BODIES.items():
        submitted = len(served.tickets)
        for ctype in NOT_JSON:
            headers = auth if ctype is None else {**auth, "Content-Type": ctype}
            res = httpx.post(served.url + path, content=httpx.Request("POST", "/", json=body).content,
                             headers=headers, timeout=30)
            assert res.status_code == 415, (path, ctype)
            assert "Content-Type: application/json" in res.json()["error"]["message"]
        assert len(served.tickets) == submitted  # nothing of them reached the engine
        res = httpx.post(served.url + path, json=body, headers={**auth, "Content-Type": "application/json; charset=utf-8"},
                         timeout=30)
        assert res.status_code == 200, (path, res.text)
