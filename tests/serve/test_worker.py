"""The engine in a process of its own (serve/worker.py): what only it can get wrong. Checks answered
at submit time in the parent with the engine's own errors; the child's torch threads; the child's
reader asleep through a stream, and the server's loop reading the child's pipe itself; a failing
step answering 500 while the server goes on; the child dying mid-request answering 503 at once,
then (unsupervised) 503 and /health 503; the child gone when its parent is killed (kill -9) and when `glassformer
serve` stops; a checkpoint the child cannot load stopping serve with the reason; --engine process
refused beside --explorer. (The OpenAI routes over it, seeded tokens and a disconnect's cancel down
the pipe: tests/serve/test_openai.py.)"""

from __future__ import annotations

import functools
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from glassformer import load
from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.generation import generate
from glassformer.generation.batching import ContextLengthExceeded, Request
from glassformer.serve import worker

from ..support import REPO, serve_in_a_process, tiny_model
from .served import KEY, NAME, Served, failing_hook, tokenizer


def gone(pid: int) -> bool:
    """The process has exited (no such process, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_gone(pids, seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def children(pid: int) -> list[int]:
    return [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]


@pytest.fixture(scope="module")
def fragile():
    """A server whose engine process fails a step on a prompt of only RAISE, and dies on one of only EXIT."""
    V = tokenizer().vocab_size
    s = Served(max_batch=4, max_queue=3, hook=functools.partial(failing_hook, V - 1, V - 2))
    s.RAISE, s.EXIT = [V - 1] * 3, [V - 2] * 3
    yield s
    s.stop()


def test_submit_time_checks_are_answered_in_the_parent(fragile):
    engine = fragile.engine
    assert engine.child_threads == torch.get_num_threads()  # the child runs what the thread engine ran
    S = fragile.model.config.max_seq_len
    steps = engine.steps
    with pytest.raises(ContextLengthExceeded):
        engine.submit(Request([1] * (S - 4), 5))
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.submit(Request([fragile.model.config.vocab_size], 2))
    empty = engine.submit(Request([1, 2], 0))  # nothing to compute: answered here, the child never sees it
    assert [e.finish for e in empty.events(timeout=5)] == ["length"] and engine.steps == steps


class _Pipe:
    """The child's end of its pipe to the parent: each message kept, read back from its bytes as
    `Connection.recv` reads them, with the (test's) clock at its send."""

    def __init__(self, clock):
        self.clock, self.sent = clock, []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append((self.clock[0], pickle.loads(data)))


@pytest.mark.parametrize("interval", [0.0, 0.02])
def test_the_childs_messages_come_at_most_every_stream_interval(interval):
    """The child sends a step's events at once when they hold a request's first token or its end, and
    otherwise waits until `stream_interval` has passed since its last message, so one message carries
    several steps' tokens (each message wakes the server: docs/benchmarks-log.md#serve); interval 0 is a
    message every step. Stepped here by hand, a step taking 5 ms of the test's clock; a second request
    joins at the sixth step."""
    model = tiny_model(vocab_size=300)
    first, second = ([5, 6, 7, 8], 24), ([9, 10], 8)
    want = {k: list(generate(model, ids, max_new_tokens=n, greedy=True)) for k, (ids, n) in ((1, first), (2, second))}
    clock = [100.0]
    pipe = _Pipe(clock)
    engine = worker.ChildEngine(model, None, pipe, max_batch=2, stream_interval=interval)
    engine.clock = lambda: clock[0]
    engine._accept(1, Request(*first, temperature=0))
    steps, stepped_at = 0, []
    while engine.step():
        stepped_at.append(clock[0])
        steps += 1
        clock[0] += 0.005
        if steps == 6:
            joined = clock[0]
            engine._accept(2, Request(*second, temperature=0))
    sent = [(t, m[4]) for t, m in pipe.sent if m[4]]  # (time, [(number, token, finish), ...]) with events
    for k in (1, 2):
        mine = [(t, worker.unpacked(item)) for t, items in sent for item in items if item[0] == k]
        assert [e.token for _, e in mine if e.token is not None] == want[k]  # all, in order
        assert mine[-1][1].finish == "length"
        assert mine[0][0] == (100.0 if k == 1 else joined)  # the first token sent after the step that made it
        assert mine[-1][0] in stepped_at  # and the end too
    if interval == 0:
        assert len(sent) == steps  # a message a step
    else:
        urgent = {t for t, items in sent if any(it[2] is not None for it in items)} | {100.0, joined}
        waited = [b - a for (a, _), (b, _) in zip(sent, sent[1:]) if b not in urgent]
        assert waited and all(gap >= interval - 1e-9 for gap in waited), waited
        assert len(sent) < steps / 2  # about one message for every 4 steps here


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's switch counts of one thread")
def test_the_childs_reader_sleeps_through_a_stream(fragile):
    """Each step's events go up a pipe of their own: the child's reader (its main thread, blocked on the
    parent's pipe) is not woken by them. On one two-way socket it woke at every step, when the parent
    drained that step's message (docs/benchmarks-log.md#serve)."""
    engine = fragile.engine
    pid = engine.process.pid

    def wakes() -> int:
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
        return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", status, re.M)[1])

    list(engine.submit(Request([1, 2, 3], 2, temperature=0)).events(timeout=30))  # warm
    before = wakes()
    got = list(engine.submit(Request([1, 2, 3], 48, temperature=0)).events(timeout=30))
    assert sum(e.token is not None for e in got) == 48 and got[-1].finish == "length"
    assert wakes() - before <= 8  # the submit's message, and a few more at most


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's switch counts of threads")
def test_the_servers_loop_reads_the_childs_pipe_itself(fragile):
    """The child's messages are read on the HTTP server's asyncio loop (`add_reader`), not by a thread
    that then wakes the loop: one thread woken a step's message, not two (docs/benchmarks-log.md#serve)."""
    engine = fragile.engine
    threads = [fragile.server._thread] + ([engine._reader] if engine._reader is not None else [])

    def wakes(tid: int) -> int:
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)$", status, re.M)[1])

    ids = fragile.tok.encode("The king")
    want = list(generate(fragile.model, ids, max_new_tokens=48, greedy=True, stop=fragile.eos))
    list(fragile.client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, stream=True))  # warm
    before = sum(wakes(t.native_id) for t in threads)
    chunks = list(fragile.client.completions.create(model=NAME, prompt=ids, max_tokens=48, temperature=0, stream=True))
    woken = sum(wakes(t.native_id) for t in threads) - before
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fragile.tok.decode([t for t in want if t not in fragile.eos])
    # At most once a message (fewer when messages queue up); the request, the stream's end and uvicorn's
    # 0.1 s tick add a few. A reader thread handing each message to the loop doubles it.
    assert woken <= len(want) + 12, woken
    assert engine._reader is None and engine._loop is fragile.server.loop


def test_a_failing_step_answers_500_and_the_server_goes_on(fragile):
    r = httpx.post(fragile.url + "/v1/completions", json={"model": NAME, "prompt": fragile.RAISE, "max_tokens": 3},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    ids = fragile.tok.encode("The king")
    want = list(generate(fragile.model, ids, max_new_tokens=6, greedy=True, stop=fragile.eos))
    out = fragile.client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == fragile.tok.decode([t for t in want if t not in fragile.eos])


def test_the_child_dying_ends_its_requests_then_503(fragile):
    """A request streaming when the child dies, and the one that kills it, both end at once with a 503
    saying so (none hangs); with no supervisor to restart it (tests/serve/test_supervision.py), later
    requests get 503 and /health says 503 "down"."""
    pid = fragile.engine.process.pid
    long = fragile.client.completions.create(model=NAME, prompt="The king", max_tokens=100, temperature=0, stream=True)
    next(iter(long))  # streaming
    t = time.perf_counter()
    r = httpx.post(fragile.url + "/v1/completions", json={"model": NAME, "prompt": fragile.EXIT, "max_tokens": 3},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["message"].startswith("the engine died while running this request")
    with pytest.raises(openai.APIError, match="the engine died while running this request"):
        for _ in long:
            pass
    assert time.perf_counter() - t < 20 and wait_gone([pid])
    health = httpx.get(fragile.url + "/health")
    assert (health.status_code, health.json()) == (503, {"status": "down"})
    with pytest.raises(openai.APIStatusError) as e:
        fragile.client.completions.create(model=NAME, prompt="x", max_tokens=2)
    assert e.value.status_code == 503


PARENT = """
import functools, sys, threading
sys.path[:0] = {paths!r}
from glassformer.serve.worker import ProcessEngine
from tests.support import tiny_model
engine = ProcessEngine(functools.partial(tiny_model, vocab_size=64), max_batch=1).start().wait_ready(120)
print(engine.process.pid, flush=True)
threading.Event().wait()
"""


def test_the_child_exits_when_its_parent_is_killed():
    code = PARENT.format(paths=[str(REPO), str(REPO / "src")])
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone([child], 10), "the engine's process outlived its parent"
    finally:
        parent.kill()


def test_serve_runs_the_engine_process_and_it_exits_when_the_server_stops(tmp_path):
    """`glassformer serve` (the process engine by default): greedy tokens of in-process generate over
    the checkpoint; on Ctrl-C the server exits cleanly and its engine process is gone."""
    proc, url = serve_in_a_process(tmp_path / "ckpt")
    try:
        engines = children(proc.pid)
        assert engines and not any(gone(p) for p in engines)
        model, tok = load(tmp_path / "ckpt")
        ids = tok.encode("The king")
        want = [t for t in generate(model, ids, max_new_tokens=5, greedy=True, stop=list(tok.eos_ids))
                if t not in tok.eos_ids]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="ckpt", prompt=ids, max_tokens=5, temperature=0).choices[0].text \
            == tok.decode(want)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out == "" and "Traceback" not in err, err
    assert wait_gone(engines, 5)


def test_the_process_engine_is_refused_beside_the_explorer(capsys, tmp_path):
    assert main(["serve", "--checkpoint", str(tmp_path), "--engine", "process", "--explorer"]) == 2
    assert "--explorer runs the engine on a thread" in capsys.readouterr().err


def test_a_checkpoint_the_child_cannot_load_stops_serve_with_the_reason(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("GLASSFORMER_API_KEY", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # serve sets its own
    try:
        assert main(["serve", "--checkpoint", str(tmp_path / "none"), "--port", "0"]) == 2
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint") and "does not exist" in err and "Traceback" not in err


def test_the_engine_leaves_the_http_side_a_core(tmp_path, monkeypatch, capsys):
    """On the CPU the engine's process gets one thread less than torch's count (at least 1), unless
    --threads or OMP_NUM_THREADS says how many (docs/serve.md#threads)."""
    from glassformer.serve import worker

    seen = []

    def start(self, loop=None):
        seen.append(self.threads)
        raise UserError("stopped here by the test")

    monkeypatch.setattr(worker.ProcessEngine, "start", start)
    monkeypatch.delenv("GLASSFORMER_API_KEY", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # serve sets its own
    threads = torch.get_num_threads()
    try:
        for flags, env in (([], None), (["--threads", "3"], None), ([], "2")):
            torch.set_num_threads(2)
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            assert main(["serve", "--checkpoint", str(tmp_path), "--port", "0", *flags]) == 2
        capsys.readouterr()
        assert main(["serve", "--checkpoint", str(tmp_path), "--port", "0", "--threads", "-1"]) == 2
    finally:
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
    assert seen == [1, 3, 2]  # --threads -1 refused before the engine starts
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_events_cross_the_pipe_as_they_were():
    """A step's events packed for the pipe (plain ones as tuples) come out equal, through pickle too."""
    import pickle

    from glassformer.generation.batching import Event
    from glassformer.generation.logprobs import TokenLogprob
    from glassformer.serve.worker import packed, unpacked

    events = [Event(5), Event(None, finish="length"), Event(7, TokenLogprob(7, -0.5, [(7, -0.5), (2, -1.5)]), "stop"),
              Event(3, prompt=[TokenLogprob(1, -2.0)]), Event(None, finish="cancelled")]
    wire = pickle.loads(pickle.dumps([packed(n, e) for n, e in enumerate(events)]))
    assert [len(w) for w in wire] == [3, 3, 2, 2, 3]  # only events with log-probabilities travel whole
    assert [w[0] for w in wire] == list(range(5)) and [unpacked(w) for w in wire] == events
