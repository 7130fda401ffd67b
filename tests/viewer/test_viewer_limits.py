"""The explorer's limits on work (docs/viewer.md#limits), on a real server: at most `max_queued`
requests wait for or hold the model (503 with Retry-After past it), a request whose client leaves is
never started or stops at its next token, and every POST body must say it is JSON (415).

The model's forwards are counted by a hook, so what the tests assert is work done, not time taken;
the waits below only bound how long a broken server may keep a test waiting."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from glassformer.text.tokenizer import Tokenizer
from glassformer.viewer import source
from glassformer.viewer.generated import MAX_TOKENS, new_tokens
from glassformer.viewer.server import MAX_QUEUED, explorer_router, make_server

from ..support import synthetic_text, tiny_model
from .test_viewer_server import post_json, read_all, request

PROMPT = "The king and the queen"
GENERATE = {"text": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}  # the longest the explorer makes


@pytest.fixture(scope="module")
def model_and_tokenizer(one_thread):
    tok = Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)
    return tiny_model(vocab_size=tok.vocab_size), tok


class Forwards:
    """Counts the model's forwards (its embedding runs once in each); the forward numbered `hold_at`
    waits, inside the model, until `release` is set (`held` says it got there)."""

    def __init__(self, hold_at: int | None = None):
        self.n, self.hold_at = 0, hold_at
        self.held, self.release = threading.Event(), threading.Event()

    def __call__(self, module, args, output):
        self.n += 1
        if self.n == self.hold_at:
            self.held.set()
            self.release.wait(120)


@contextmanager
def serving(model_and_tokenizer, forwards: Forwards, **explorer_args):
    """A server for a fresh explorer of the model (its own cache and queue), the forwards counted."""
    model, tok = model_and_tokenizer
    explorer = source.explorer(model, tok, PROMPT, model_name="tiny")
    for k, v in explorer_args.items():
        setattr(explorer, k, v)
    hook = model.embed.register_forward_hook(forwards)
    server = make_server(explorer, port=0)
    server.start_in_thread()
    try:
        yield server, explorer
    finally:
        forwards.release.set()
        server.stop()
        hook.remove()


def wait_until(condition, what: str, seconds: float = 120) -> None:
    """Poll `condition` until it holds (the bound is only there so a broken server fails the test)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"still waiting for {what}"
        time.sleep(0.01)


def sent(server, path: str, obj: dict) -> socket.socket:
    """A whole POST sent on a connection of its own whose answer is not read (yet); the server closes
    the connection after answering it."""
    body = json.dumps(obj).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    sock = socket.create_connection((server.host, server.port), timeout=120)
    sock.sendall(head + body)
    return sock


def test_requests_whose_clients_left_never_start(model_and_tokenizer):
    """The issue's reproduction: generate requests whose clients left while they waited for the model
    all ran to the end before the next trace (100 of them: 48 s). Now none of them starts."""
    forwards = Forwards()
    with serving(model_and_tokenizer, forwards) as (server, explorer):
        with explorer.lock:  # the model busy (another request's long generation): they queue behind it
            clients = [sent(server, "/api/generate", GENERATE) for _ in range(6)]
            wait_until(lambda: explorer.work.queued == 6, "the 6 requests to queue")
            for c in clients:
                c.close()
            wait_until(lambda: explorer.work.abandoned == 6, "the server to see the 6 clients leave")
        wait_until(lambda: explorer.work.queued == 0, "the abandoned requests to leave the queue")
        assert forwards.n == 0  # not one forward of the 6 x 64 tokens and their traces
        status, _, body = post_json(server, "/api/trace", {"text": "The king"})
        assert status == 200 and json.loads(body)["trace"]["ids"]
        assert forwards.n > 0


def test_a_running_generation_stops_at_its_next_token(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = tok.encode(PROMPT)
    whole = new_tokens(model, ids, MAX_TOKENS, {"temperature": 0}, [tok.eot_id])
    assert len(whole) > 10  # left alone, the generation runs well past the forward it is held at
    forwards = Forwards(hold_at=3)  # the prefill, one decode step, and the next one held
    with serving(model_and_tokenizer, forwards) as (server, explorer):
        client = sent(server, "/api/generate", GENERATE)
        assert forwards.held.wait(120), "the generation never reached its third forward"
        client.close()
        wait_until(lambda: explorer.work.abandoned == 1, "the server to see the client leave")
        forwards.release.set()
        wait_until(lambda: explorer.work.queued == 0, "the abandoned generation to stop")
        assert forwards.n == 3  # the step in flight finished; no other (uncancelled: 64 + the trace's)
        status, _, body = post_json(server, "/api/trace", {"text": "The king"})
        assert status == 200 and json.loads(body)["trace"]["ids"]


def test_past_the_cap_a_request_is_told_to_retry(model_and_tokenizer):
    assert 8 <= MAX_QUEUED <= 64  # the default: a page keeps at most a few requests in flight
    forwards = Forwards()
    with serving(model_and_tokenizer, forwards, max_queued=3) as (server, explorer):
        with explorer.lock:
            clients = [sent(server, "/api/trace", {"text": t}) for t in ("The king", "The queen", "The king and")]
            wait_until(lambda: explorer.work.queued == 3, "the 3 requests to queue")
            status, headers, body = post_json(server, "/api/generate", GENERATE)
            assert status == 503 and headers["Retry-After"] == "1"
            assert "retry" in json.loads(body)["error"]
            status, headers, _ = request(server, "GET", "/")  # the page's own trace is work too
            assert status == 503 and headers["Retry-After"] == "1"
            assert forwards.n == 0
        for c in clients:  # the queued ones are answered in turn
            assert read_all(c).startswith(b"HTTP/1.1 200 ")
        status, _, _ = post_json(server, "/api/trace", {"text": "The queen"})
        assert status == 200


def test_max_queued_is_checked():
    from glassformer.errors import UserError
    from glassformer.viewer.server import Explorer

    with pytest.raises(UserError, match="max_queued"):
        Explorer(encode=lambda t: ([0], [t]), trace=lambda ids, toks: {}, default_text="x", max_queued=0)


NOT_JSON = [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", "application/jsonp", "text/json"]


def test_post_bodies_must_say_they_are_json(model_and_tokenizer):
    """A text/plain or form POST needs no CORS preflight, so any page the user visits could queue work
    on the explorer with one: every POST route answers 415 unless the body says application/json."""
    forwards = Forwards()
    with serving(model_and_tokenizer, forwards) as (server, explorer):
        routes = explorer_router(explorer).routes  # the table of the routes the server has
        posts = sorted(r.path for r in routes if "POST" in getattr(r, "methods", ()))
        assert {"/api/trace", "/api/explain", "/api/sample", "/api/generate", "/api/update"} <= set(posts)
        body = json.dumps({"text": "The king"}).encode()
        for path in posts:
            for ctype in NOT_JSON:
                status, _, got = request(server, "POST", path, body, {} if ctype is None else {"Content-Type": ctype})
                assert status == 415, (path, ctype)
                assert "Content-Type: application/json" in json.loads(got)["error"]
        assert forwards.n == 0  # nothing of them was computed
        for ctype in ("application/json; charset=utf-8", "Application/JSON"):
            status, _, _ = request(server, "POST", "/api/trace", body, {"Content-Type": ctype})
            assert status == 200
