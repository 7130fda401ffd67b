"""The OpenAI-compatible API (serve/openai.py) on a real uvicorn on 127.0.0.1, port 0, started once
for the module with a tiny model whose engine runs in a process of its own (what `glassformer
serve` runs; tests/serve/served.py), with the official `openai` client: greedy and seeded tokens equal
in-process `generate`, logprobs equal a full forward's log-softmax, usage counts, echo scoring, stop
strings, 32 concurrent streams beside 20 half-sent requests, a disconnect freeing its row, and every
bad input answered with its status and an OpenAI error object."""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import socket
import threading

import httpx
import openai
import pytest
import torch

from glassformer.generation import generate
from glassformer.serve import sse
from glassformer.text.tokenizer import Tokenizer

from ..support import synthetic_text
from .served import KEY, NAME, Served, gate_hook

PROMPTS = ["The king", "A knight waits", "the old man sings of", "Where", "the sea and the stars", "Castle"]


@pytest.fixture(scope="module")
def served():
    s = Served(max_batch=8)  # the engine in its own process, as `glassformer serve` runs it
    yield s
    s.stop()


def post(s: Served, path: str, body, key: str | None = KEY, raw: bool = False, timeout: float = 30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if raw else json.dumps(body)
    return httpx.post(s.url + path, content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=timeout)


def expected(s: Served, ids: list[int], n: int, **sampling) -> tuple[list[int], str]:
    """In-process generate's tokens (an end-of-turn id dropped) and the finish reason."""
    made = list(generate(s.model, ids, max_new_tokens=n, stop=s.eos, **sampling))
    if made and made[-1] in s.eos:
        return made[:-1], "stop"
    return made, "length"


@torch.no_grad()
def full_logprobs(s: Served, ids: list[int]) -> torch.Tensor:
    """log_softmax of one forward over the whole text, no cache: (T, V)."""
    logits, _ = s.model(torch.tensor([ids]))
    return torch.log_softmax(logits[0].float(), -1)


def check_top(s: Served, row: torch.Tensor, top: dict | list, k: int) -> None:
    """The top-k alternatives sent equal the reference row's k best, id for id, to 1e-5."""
    values, ids = row.topk(k)
    pieces = [s.tok.id_to_piece(i) for i in ids.tolist()]
    got = list(top.items()) if isinstance(top, dict) else [(t.token, t.logprob) for t in top]
    assert [p for p, _ in got] == pieces
    assert torch.allclose(torch.tensor([lp for _, lp in got]), values, atol=1e-5)


# ----------------------------------------------------------------------------- completions


def test_models_health_and_the_model_id(served):
    assert [m.id for m in served.client.models.list().data] == [NAME]
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}  # open without the key


def test_completion_greedy_tokens_logprobs_and_usage(served):
    ids = served.tok.encode(PROMPTS[0])
    want, finish = expected(served, ids, 12, greedy=True)
    out = served.client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3)
    choice = out.choices[0]
    assert choice.text == served.tok.decode(want) and choice.finish_reason == finish
    assert choice.logprobs.tokens == [served.tok.id_to_piece(t) for t in want]
    lp = full_logprobs(served, ids + want)
    ref = lp[len(ids) - 1:len(ids) - 1 + len(want)]  # the rows that predict each new token
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), ref[torch.arange(len(want)), want], atol=1e-5)
    for row, top in zip(ref, choice.logprobs.top_logprobs):
        check_top(served, row, top, 3)
    assert choice.logprobs.text_offset[0] == 0
    made = len(want) + (finish == "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), made, len(ids) + made)


def test_completion_stream_gives_the_same_text_and_a_usage_chunk(served):
    ids = served.tok.encode(PROMPTS[1])
    want, finish = expected(served, ids, 10, greedy=True)
    chunks = list(served.client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == served.tok.decode(want)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finish
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == len(want) + (finish == "stop")


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    ids = served.tok.encode("the king and queen walk to the castle")
    out = served.client.completions.create(model=NAME, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    lp, ref = out.choices[0].logprobs, full_logprobs(served, ids)
    assert out.choices[0].text == served.tok.decode(ids)
    assert lp.tokens == [served.tok.id_to_piece(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), ref[torch.arange(len(ids) - 1), ids[1:]], atol=1e-5)
    for row, top in zip(ref, lp.top_logprobs[1:]):
        check_top(served, row, top, 2)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)


def test_seeded_sampling_and_several_prompts(served):
    rows = [served.tok.encode(p) for p in PROMPTS[:3]]
    out = served.client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=8, temperature=0.9, seed=7,
                                           extra_body={"top_k": 40})
    for ids, choice in zip(rows, sorted(out.choices, key=lambda c: c.index)):
        want, _ = expected(served, ids, 8, temperature=0.9, top_k=40, seed=7)
        assert choice.text == served.tok.decode(want)


def test_stop_strings_cut_the_text_and_free_the_row(served):
    ids = served.tok.encode(PROMPTS[2])
    want, _ = expected(served, ids, 30, greedy=True)
    text = served.tok.decode(want)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    for stream in (False, True):
        out = served.client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                               stop=["zzzz", stop], stream=stream)
        choices = list(out) if stream else [out]
        got = "".join(c.choices[0].text for c in choices)
        assert got == text[:text.index(stop)] and choices[-1].choices[0].finish_reason == "stop"
    wait_for(lambda: served.tickets[-1].finish is not None)  # cancelled, or done before the cancel came


class FakeTicket:
    """A ticket that yields given events and notes how many were read and whether it was cancelled."""

    def __init__(self, events, prompt_tokens=1):
        self.queue, self.read, self.cancels, self.prompt_tokens = list(events), 0, 0, prompt_tokens

    async def aevents(self):
        for ev in self.queue:
            self.read += 1
            yield ev

    def cancel(self):
        self.cancels += 1


def test_a_stop_string_cancels_the_ticket_at_once():
    """The reply reads no event past the one that completes the stop string, and cancels its ticket."""
    from glassformer.generation.batching import Event
    from glassformer.serve.replies import Reply

    tok = Tokenizer.train([synthetic_text(50, 1)], vocab_size=280)
    ids = tok.encode("the king and the queen")
    ticket = FakeTicket([Event(t) for t in ids] + [Event(ids[0], finish="length")])
    reply = Reply(ticket, tok, stops=["king"])
    text, _ = asyncio.run(reply.collect())
    upto = next(i for i in range(1, len(ids) + 1) if "king" in tok.decode(ids[:i]))
    assert text == "the " and reply.finish == "stop"
    assert ticket.read == upto and ticket.cancels == 1 and reply.tokens == upto


# ----------------------------------------------------------------------------- chat


def test_chat_greedy_with_logprobs_streamed_and_not(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the king?"}]
    ids = served.tok.apply_chat_template(messages, add_generation_prompt=True)
    want, finish = expected(served, ids, 12, greedy=True)
    ref = full_logprobs(served, ids + want)[len(ids) - 1:]
    out = served.client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=12,
                                                temperature=0, logprobs=True, top_logprobs=4)
    assert out.choices[0].message.content == served.tok.decode(want) and out.choices[0].finish_reason == finish
    content = out.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [served.tok.id_to_bytes(t) for t in want]
    assert torch.allclose(torch.tensor([c.logprob for c in content]), ref[torch.arange(len(want)), want], atol=1e-5)
    for row, c in zip(ref, content):
        check_top(served, row, c.top_logprobs, 4)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want) + (finish == "stop")
    chunks = list(served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                        logprobs=True, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == served.tok.decode(want)
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [bytes(e.bytes) for e in streamed] == [served.tok.id_to_bytes(t) for t in want]
    assert chunks[-1].choices[0].finish_reason == finish


def test_tokenize_and_detokenize(served):
    ids = served.tok.encode("the king sings")
    assert post(served, "/tokenize", {"prompt": "the king sings"}).json() == \
        {"count": len(ids), "max_model_len": served.model.config.max_seq_len, "tokens": ids}
    messages = [{"role": "user", "content": "hi"}]
    got = post(served, "/tokenize", {"messages": messages, "add_generation_prompt": True}).json()
    assert got["tokens"] == served.tok.apply_chat_template(messages, add_generation_prompt=True)
    assert post(served, "/detokenize", {"tokens": ids}).json() == {"prompt": "the king sings"}


# ----------------------------------------------------------------------------- load


def test_32_streams_beside_20_half_sent_requests(served):
    """Each stream gets the tokens it gets alone; none is reset; the stalled sockets are closed."""
    host, port = served.url.removeprefix("http://").split(":")
    stalled = []
    for i in range(20):
        sock = socket.create_connection((host, int(port)))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n".encode()
        sock.sendall(head if i % 2 else head + b"Content-Length: 500\r\nContent-Type: application/json\r\n\r\n{\"mo")
        stalled.append(sock)
    jobs = [(PROMPTS[i % len(PROMPTS)], None if i % 2 else 100 + i) for i in range(32)]
    wants = [served.tok.decode(expected(served, served.tok.encode(p), 8, **(
        {"greedy": True} if seed is None else {"temperature": 1.0, "seed": seed}))[0]) for p, seed in jobs]

    async def one(prompt, seed):
        stream = await served.aclient.completions.create(model=NAME, prompt=prompt, max_tokens=8, stream=True,
                                                         temperature=0 if seed is None else 1.0, seed=seed)
        return "".join([c.choices[0].text async for c in stream])

    async def every():
        return await asyncio.gather(*(one(p, s) for p, s in jobs))

    assert asyncio.run(every()) == wants
    for sock in stalled:
        sock.settimeout(15)
        try:
            assert sock.recv(1024) == b""  # closed by the server at the deadline, nothing answered
        except ConnectionResetError:
            pass
        sock.close()


def wait_for(condition, seconds: float = 20.0) -> None:
    """Poll until condition() holds (an ordering, not a timing: the limit is only a hang guard)."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")


def _gives_up(s: Served) -> str:
    try:
        post(s, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2}, timeout=1.0)
    except httpx.ReadTimeout:
        return "gave up"
    return "answered"


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_a_disconnect_frees_the_row_for_the_next_request(engine):
    """max_batch 1, the engine held by a gate from its third forward on (A has made two tokens): B
    and C queue behind A, a fourth request gets 429, C's client (not streaming) gives up and C
    leaves the queue, A's client leaves mid-stream; once the gate opens, B starts within the
    step that freed A's row. The same with the engine in its own process (cancels down its pipe)."""
    ctx = multiprocessing.get_context("spawn")
    gate, count = ctx.Event(), ctx.Value("i", 0)
    s = Served(max_batch=1, max_queue=2, engine=engine, hook=functools.partial(gate_hook, count, gate))
    try:
        body = {"model": NAME, "prompt": "The king", "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30):
            wait_for(lambda: count.value > 2)  # A is mid-stream, the engine held inside a step
            result = {}
            b = threading.Thread(target=lambda: result.update(
                out=s.client.completions.create(model=NAME, prompt="Where", max_tokens=3, temperature=0)))
            b.start()
            wait_for(lambda: len(s.tickets) == 2)
            c = threading.Thread(target=lambda: result.update(c=_gives_up(s)))
            c.start()
            wait_for(lambda: len(s.tickets) == 3)
            fourth = post(s, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2})
            assert fourth.status_code == 429 and fourth.json()["error"]["type"] == "rate_limit_error"
            c.join(30)
            assert result["c"] == "gave up"
            wait_for(lambda: s.tickets[2].finish == "cancelled")  # C left the queue
        wait_for(lambda: s.tickets[0].cancelled)  # A's client is gone: its ticket cancelled
        gate.set()
        b.join(30)
        assert result["out"].choices[0].finish_reason == "length"
        a_cancel = next(step for step, i, what in s.log if i == 0 and what == "cancelled")
        b_first = next(step for step, i, what in s.log if i == 1)
        assert s.tickets[0].completion_tokens < 100 and b_first - a_cancel <= 1
    finally:
        gate.set()
        s.stop()


# ----------------------------------------------------------------------------- bad input


BAD = [  # (path, body, status, param, code)
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "n": 2}, 400, "n", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1},
     400, "presence_penalty", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "surprise": 1}, 400, "surprise", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 6}, 400, "logprobs", None),
    ("/v1/completions", {"model": NAME, "prompt": [5000]}, 400, "prompt", None),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": NAME, "prompt": "x", "stop": ["a"] * 17}, 400, "stop", None),
    ("/v1/completions", {"model": NAME, "prompt": [1] * 100, "max_tokens": 29}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 1},
     400, "max_tokens", "context_length_exceeded"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_input_gets_its_status_and_an_openai_error(served, path, body, status, param, code):
    r = post(served, path, body)
    err = r.json()["error"]
    assert r.status_code == status and set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code) and err["message"]


def test_logs_never_hold_prompt_text(served, caplog):
    secret = "Ophelia-7f3a"
    with caplog.at_level("DEBUG"):
        served.client.completions.create(model=NAME, prompt=secret, max_tokens=2)
        for body in ({"model": NAME, "prompt": secret, "temperature": secret},
                     {"model": NAME, "messages": [{"role": secret, "content": secret}]}, {"model": secret}):
            assert post(served, "/v1/chat/completions", body).status_code in (400, 404)
    assert caplog.records and secret not in caplog.text


def test_transport_errors_are_openai_errors_too(served):
    for r, status in ((post(served, "/v1/completions", b"{not json", raw=True), 400),
                      (post(served, "/v1/completions", {"model": NAME, "prompt": "x"}, key=None), 401),
                      (post(served, "/v1/completions", {"model": NAME, "prompt": "x"}, key="wrong"), 401),
                      (post(served, "/v1/completions", {"model": NAME, "prompt": "x" * 70000}), 413),
                      (post(served, "/v1/nothing", {}), 404)):
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_ids_past_the_tokenizers_vocabulary_have_no_text():
    """A model's vocabulary padded past its tokenizer's: such an id streams nothing and has no bytes."""
    from glassformer.generation.streaming import TextStream
    from glassformer.serve.results import CompletionLogprobs, KnownIds, piece, token_bytes

    tok = Tokenizer.train([synthetic_text(50, 1)], vocab_size=280)
    ids, past = tok.encode("the king"), tok.vocab_size + 3
    stream = TextStream(KnownIds(tok))
    assert "".join(stream.push(t) for t in [ids[0], past, *ids[1:]]) + stream.flush() == "the king"
    assert (piece(tok, past), token_bytes(tok, past)) == ("", b"")
    lp = CompletionLogprobs(tok)
    lp.add(past, -1.0, [(past, -1.0)])
    assert lp.take()["tokens"] == [""]


def test_events_ready_together_go_out_in_one_write():
    """sse.events joins the events whose chunks are ready without waiting (`more()`): a message's burst
    of tokens is one write; the bytes are the same as one event a write."""
    chunks = [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]
    ready = iter([True, False, True, True])  # asked after each chunk: is the next one ready already?

    async def source():
        for c in chunks:
            yield c

    async def written(more):
        return [part async for part in sse.events(source(), lambda e: {}, more)]

    joined, single = asyncio.run(written(lambda: next(ready))), asyncio.run(written(None))
    assert b"".join(joined) == b"".join(single) == b"".join(sse.event(c) for c in chunks) + sse.DONE
    assert joined == [sse.event(chunks[0]) + sse.event(chunks[1]), sse.event(chunks[2]) + sse.event(chunks[3]) + sse.DONE]
    assert len(single) == 5
