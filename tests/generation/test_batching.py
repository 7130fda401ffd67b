"""The continuous-batching engine against in-process `generate`: requests alone and batched, arriving
at different steps, chunked prefill, cancel, the queue's and the context's limits, threads and asyncio."""

import asyncio
import random

import pytest
import torch

from glassformer import generate
from glassformer.errors import UserError
from glassformer.generation.batching import ContextLengthExceeded, Engine, EngineStopped, QueueFull, Request

from ..support import tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest on a busy machine


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]


def _tokens(ticket) -> list[int]:
    return [e.token for e in ticket.events(timeout=30) if e.token is not None]


def _run_arrivals(engine, requests, arrivals) -> list:
    """Submit request j at step arrivals[j] (an engine driven by hand); step until idle."""
    tickets, step = [None] * len(requests), 0
    while step <= max(arrivals) or engine.step():
        for j, a in enumerate(arrivals):
            if a == step:
                tickets[j] = engine.submit(requests[j])
        if step <= max(arrivals):
            engine.step()
        step += 1
    return tickets


def test_greedy_equals_generate_alone_and_batched_arriving_at_different_steps(model):
    prompts = _prompts((3, 17, 1, 9, 30, 5, 12))
    lengths = (15, 4, 20, 9, 12, 1, 7)  # different max_tokens: rows leave mid-batch, others move into their rows
    alone = [list(generate(model, p, max_new_tokens=n, greedy=True)) for p, n in zip(prompts, lengths)]
    assert len({tuple(a) for a in alone}) == len(alone)
    engine = Engine(model, max_batch=3, prefill_chunk=8)
    first = engine.submit(Request(prompts[0], lengths[0], temperature=0))  # alone in the engine
    while engine.step():
        pass
    assert _tokens(first) == alone[0]
    requests = [Request(p, n, temperature=0) for p, n in zip(prompts, lengths)]
    tickets = _run_arrivals(engine, requests, [0, 0, 2, 3, 3, 7, 9])
    assert [_tokens(t) for t in tickets] == alone
    assert all(t.finish == "length" for t in tickets)
    assert engine.stats["moves"] > 0 and engine.stats["active"] == 0  # rows were moved, then all freed


def test_seeded_sampling_equals_generate_alone_and_batched(model):
    prompts = _prompts((4, 11, 2, 8), seed=1)
    params = [dict(top_k=40), dict(top_p=0.9, temperature=1.3), dict(min_p=0.05, temperature=0.7),
              dict(repetition_penalty=1.3, top_k=100)]
    alone = [list(generate(model, p, max_new_tokens=12, seed=10 + j, **kw))
             for j, (p, kw) in enumerate(zip(prompts, params))]
    requests = [Request(p, 12, seed=10 + j, **kw) for j, (p, kw) in enumerate(zip(prompts, params))]
    engine = Engine(model, max_batch=4)
    batched = [_tokens(t) for t in _run_arrivals(engine, requests, [0, 1, 1, 5])]
    assert engine.stats["prefill_forwards"] == 3  # the two arriving at step 1 were prefilled together
    one = Engine(model, max_batch=1)
    queued = [_tokens(t) for t in _run_arrivals(one, requests, [0, 0, 0, 0])]  # one row: each alone in turn
    assert batched == alone and queued == alone


def test_unseeded_requests_differ(model):
    engine = Engine(model, max_batch=2)
    a, b = (engine.submit(Request(_prompts((5,))[0], 20)) for _ in range(2))
    while engine.step():
        pass
    assert _tokens(a) != _tokens(b)


def test_chunked_prefill_gives_the_unchunked_tokens(model):
    prompts = _prompts((40, 3, 25), seed=2)
    alone = [list(generate(model, p, max_new_tokens=10, greedy=True)) for p in prompts]
    for chunk in (256, 7):
        engine = Engine(model, max_batch=2, prefill_chunk=chunk)
        tickets = _run_arrivals(engine, [Request(p, 10, temperature=0) for p in prompts], [0, 1, 1])
        assert [_tokens(t) for t in tickets] == alone
    assert engine.stats["prefill_tokens"] == sum(map(len, prompts))


def test_a_long_prefill_does_not_stall_a_running_stream(model):
    """While a 100-token prompt is fed 8 tokens a step, the running row still gets a token every step."""
    engine = Engine(model, max_batch=2, prefill_chunk=8)
    running = engine.submit(Request(_prompts((3,))[0], 30, temperature=0))
    engine.step()
    long = engine.submit(Request(_prompts((100,), seed=3)[0], 2, temperature=0))
    got = []
    for _ in range(13):  # 100 tokens at 8 a step: 13 steps
        engine.step()
        got.append(running._pop())
    assert all(e is not None and e.token is not None for e in got)
    assert long._pop() is not None  # its first token came with the last chunk


def test_stop_ids_end_a_request(model):
    prompt = _prompts((6,), seed=4)[0]
    ref = list(generate(model, prompt, max_new_tokens=20, greedy=True))
    engine = Engine(model, max_batch=2)
    t = engine.submit(Request(prompt, 20, temperature=0, stop_ids=[ref[5]]))
    seq = engine.submit(Request(prompt, 20, temperature=0, stop_ids=[tuple(ref[2:4])]))
    while engine.step():
        pass
    assert _tokens(t) == ref[:ref.index(ref[5]) + 1] and t.finish == "stop"
    assert _tokens(seq) == ref[:4] and seq.finish == "stop"


def test_cancel_frees_the_row_and_the_queued_request_starts_at_the_next_step(model):
    engine = Engine(model, max_batch=1)
    first = engine.submit(Request(_prompts((5,))[0], 50, temperature=0))
    waiting = engine.submit(Request(_prompts((4,), seed=5)[0], 3, temperature=0))
    engine.step()  # first's prompt and one decode step: two tokens
    assert engine.stats["queued"] == 1 and first.completion_tokens == 2
    first.cancel()
    assert engine.stats["active"] == 1  # freed at the next step's start
    engine.step()
    assert waiting._pop().token is not None  # prefilled (and decoded) in that very step
    assert [e.finish for e in first.events(timeout=1)] == [None, None, "cancelled"] and first.completion_tokens == 2
    while engine.step():
        pass
    assert waiting.finish == "length"
    queued = engine.submit(Request([1, 2], 5))
    queued.cancel()  # cancelled while queued: gone from the queue at once
    assert engine.stats["queued"] == 0 and queued._pop().finish == "cancelled"


def test_leaving_the_iterator_cancels(model):
    engine = Engine(model, max_batch=1).start()
    try:
        t = engine.submit(Request([1, 2, 3], 100))
        for _ in t.events(timeout=30):
            break
        assert t.cancelled
        assert _tokens(engine.submit(Request([4, 5], 3))) and engine.stats["active"] == 0
    finally:
        engine.stop()


def test_the_queue_limit(model):
    engine = Engine(model, max_batch=1, max_queue=2)
    engine.submit(Request([1], 5))
    engine.submit(Request([2], 5))
    with pytest.raises(QueueFull, match="waiting"):
        engine.submit(Request([3], 5))
    assert issubclass(QueueFull, UserError)
    engine.step()  # one admitted: room again
    engine.submit(Request([3], 5))


def test_bad_requests(model):
    engine = Engine(model)
    S = model.config.max_seq_len
    with pytest.raises(ContextLengthExceeded, match="context of 128"):
        engine.submit(Request([1] * 100, S - 99))
    engine.submit(Request([1] * 100, S - 100))  # exactly the context: fine
    for req, match in [(Request([], 3), "empty"), (Request([512], 3), "vocabulary"), (Request([1], -1), "max_tokens"),
                       (Request([1], 3, temperature=-1), "temperature"), (Request([1], 3, top_p=0), "top-p"),
                       (Request([1], 3, logprobs=-2), "logprobs"), (Request([1], 3, stop_ids=[600]), "stop")]:
        with pytest.raises(UserError, match=match):
            engine.submit(req)
    assert engine.submit(Request([1], 0)).finish == "length"  # nothing to make: done at once


def test_threads_asyncio_and_stop(model):
    prompts = _prompts((5, 9, 2), seed=6)
    alone = [list(generate(model, p, max_new_tokens=8, seed=j)) for j, p in enumerate(prompts)]
    engine = Engine(model, max_batch=2).start()

    async def stream(j):
        t = engine.submit(Request(prompts[j], 8, seed=j))
        return [e.token async for e in t.aevents() if e.token is not None]

    async def together():
        return await asyncio.gather(*(stream(j) for j in range(3)))

    try:
        assert asyncio.run(together()) == alone
        hanging = engine.submit(Request([1, 2], 120))
    finally:
        engine.stop()
    assert list(hanging.events(timeout=5))[-1].finish == "cancelled"
    with pytest.raises(EngineStopped):
        engine.submit(Request([1], 2))


def test_many_random_arrivals(model):
    """Random lengths, arrivals and sampling: every request equals its own generate."""
    rng = random.Random(7)
    n = 12
    prompts = _prompts([rng.randint(1, 30) for _ in range(n)], seed=7)
    kws = [dict(max_new_tokens=rng.randint(1, 12), seed=j, temperature=rng.choice([0, 0.8, 1.0])) for j in range(n)]
    alone = [list(generate(model, p, **kw)) for p, kw in zip(prompts, kws)]
    requests = [Request(p, kw["max_new_tokens"], temperature=kw["temperature"], seed=kw["seed"])
                for p, kw in zip(prompts, kws)]
    engine = Engine(model, max_batch=4, prefill_chunk=9)
    tickets = _run_arrivals(engine, requests, sorted(rng.randint(0, 15) for _ in range(n)))
    assert [_tokens(t) for t in tickets] == alone


def test_padding_rows_touch_no_real_row(model):
    """Decode steps padded up to the batch buckets (what compile=True does), here eagerly: padding rows
    sit on free rows and on the row being prefilled, whose tokens stay the unpadded ones."""
    prompts = _prompts((4, 9, 2, 30, 6), seed=8)
    lengths = (9, 3, 12, 6, 8)
    alone = [list(generate(model, p, max_new_tokens=n, greedy=True)) for p, n in zip(prompts, lengths)]
    engine = Engine(model, max_batch=8, prefill_chunk=5)
    engine.pad_rows = True
    tickets = _run_arrivals(engine, [Request(p, n, temperature=0) for p, n in zip(prompts, lengths)], [0, 1, 1, 2, 4])
    assert [_tokens(t) for t in tickets] == alone


@pytest.mark.slow
def test_compiled_steps_equal_generate(model):
    """compile=True: three rows padded to the bucket of 4 (they start and end together), the slots read
    growing past 64 (the cache's shape is a constant of a trace: a second compiled step, not a wrong one)."""
    prompts = _prompts((60, 9, 2), seed=9)
    alone = [list(generate(model, p, max_new_tokens=8, greedy=True)) for p in prompts]
    engine = Engine(model, max_batch=4, compile=True)
    tickets = [engine.submit(Request(p, 8, temperature=0)) for p in prompts]
    while engine.step():
        pass
    assert [_tokens(t) for t in tickets] == alone
    assert engine.stats["compiled_batch_sizes"] == [4] and engine.stats["compiled_steps"] == 2


def test_a_failing_step_ends_every_request_and_the_engine_goes_on(model):
    def boom(module, args):
        raise RuntimeError("a failing forward")

    engine = Engine(model, max_batch=1).start()
    try:
        handle = model.lm_head.register_forward_pre_hook(boom)
        try:
            running, queued = engine.submit(Request([1, 2], 5)), engine.submit(Request([3], 5))
            assert [e.finish for e in running.events(timeout=30)] == ["error"]
            assert [e.finish for e in queued.events(timeout=30)] == ["error"]
        finally:
            handle.remove()
        assert _tokens(engine.submit(Request([1, 2], 3, temperature=0))) == list(
            generate(model, [1, 2], max_new_tokens=3, greedy=True))
    finally:
        engine.stop()


def test_random_arrivals_and_cancels(model):
    """Cancels of queued, prefilling (chunked) and decoding requests between steps: the others still
    equal generate, each cancelled one ends "cancelled" after a prefix of its own tokens."""
    rng = random.Random(11)
    n = 14
    prompts = _prompts([rng.randint(1, 40) for _ in range(n)], seed=11)
    lengths = [rng.randint(2, 14) for _ in range(n)]
    alone = [list(generate(model, p, max_new_tokens=k, greedy=True)) for p, k in zip(prompts, lengths)]
    engine = Engine(model, max_batch=3, prefill_chunk=8, max_queue=n)
    arrivals = sorted(rng.randint(0, 12) for _ in range(n))
    cancel_at = {j: arrivals[j] + rng.randint(0, 6) for j in rng.sample(range(n), 5)}
    tickets, step = [None] * n, 0
    while step <= 20 or engine.step():
        for j in range(n):
            if arrivals[j] == step:
                tickets[j] = engine.submit(Request(prompts[j], lengths[j], temperature=0))
            if cancel_at.get(j) == step:
                tickets[j].cancel()
        if step <= 20:
            engine.step()
        step += 1
    assert engine.stats["moves"] > 0
    for j, t in enumerate(tickets):
        events = list(t.events(timeout=5))
        got = [e.token for e in events if e.token is not None]
        if j in cancel_at and events[-1].finish == "cancelled":
            assert got == alone[j][:len(got)]
        else:
            assert got == alone[j] and events[-1].finish == "length"
    assert sum(t.finish == "cancelled" for t in tickets) >= 3


def test_cancel_during_a_chunked_prefill(model):
    prompt = _prompts((3,))[0]
    engine = Engine(model, max_batch=2, prefill_chunk=8)
    running = engine.submit(Request(prompt, 12, temperature=0))
    engine.step()
    long = engine.submit(Request(_prompts((60,), seed=3)[0], 5, temperature=0))
    engine.step()
    engine.step()  # two chunks of its prompt in
    assert engine.stats["active"] == 2 and engine.stats["decoding"] == 1
    long.cancel()
    nxt = engine.submit(Request(prompt, 4, temperature=0))  # takes the freed row at the next step
    engine.step()
    assert engine.stats["active"] == 2 and engine.stats["decoding"] == 2
    while engine.step():
        pass
    assert [e.finish for e in long.events(timeout=1)] == ["cancelled"]
    ref = list(generate(model, prompt, max_new_tokens=12, greedy=True))
    assert _tokens(running) == ref and _tokens(nxt) == ref[:4]


def test_cache_views_share_the_storage(model):
    from glassformer.kv_cache import KVCache

    cache = KVCache.for_model(model, 4, 32)
    view = cache.view(1, 3, 16)
    assert view.layers[0].k.shape == (2, model.config.n_kv_heads, 16, model.config.head_dim)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache=view, pos=torch.tensor([0, 4]))
    k = cache.layers[1].k
    assert k[1, :, :3].abs().sum() > 0 and k[2, :, 4:7].abs().sum() > 0  # written through the view
    assert k[0].abs().sum() == 0 and k[3].abs().sum() == 0 and k[2, :, :4].abs().sum() == 0
    cache.copy_row(2, 0, 7)
    assert torch.equal(k[0, :, :7], k[2, :, :7]) and k[0, :, 7:].abs().sum() == 0
    assert cache.row_bytes() == 2 * model.config.n_layers * k[0].numel() * k.element_size()
    with pytest.raises(ValueError, match="view"):
        cache.view(3, 5)
