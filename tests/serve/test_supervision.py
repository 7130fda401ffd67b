"""Engine supervision (serve/supervisor.py, docs/serve.md#supervision): a killed engine process is
restarted once with a warning (the requests it held answered 503, a stream's with an error event),
and a second death makes `glassformer serve` exit 1 with one line; the thread engine likewise; a
stopped engine (SIGSTOP) holding a request makes /health 503 "stalled" within the stall timeout
and new completions 503, and SIGCONT makes it healthy again with the request completed; an idle
engine is never stalled. Each waits by polling under a generous deadline, never a fixed sleep."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from glassformer import load
from glassformer.cli import main
from glassformer.generation import generate
from glassformer.generation.batching import Engine, Request
from glassformer.serve.backend import Backend
from glassformer.serve.supervisor import Supervisor

from ..support import serve_in_a_process, tiny_model
from .served import KEY, NAME, Served, slow_hook, thread_exit_hook, tokenizer

DEADLINE = 120.0  # seconds any one wait may take on a slow, busy machine (a restart loads torch anew)
AUTH = {"Authorization": f"Bearer {KEY}"}


def until(what, deadline: float = DEADLINE, every: float = 0.05):
    """Poll `what()` until it returns something true (returned), failing after `deadline` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {deadline:g} s: {getattr(what, '__name__', what)}")


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=30)
    return r.status_code, r.json()


def greedy_text(s: Served, ids: list[int], n: int) -> str:
    return s.tok.decode([t for t in generate(s.model, ids, max_new_tokens=n, greedy=True, stop=s.eos)
                         if t not in s.eos])


@pytest.fixture(scope="module")
def supervised():
    """A server whose engine process takes 20 ms more a forward (a 120-token request runs for seconds),
    watched with a stall timeout of 1 s."""
    s = Served(max_batch=2, hook=functools.partial(slow_hook, 0.02), stall_timeout=1.0)
    yield s
    os.kill(s.backend.engine.process.pid, signal.SIGCONT)  # (never left stopped, whatever failed)
    s.stop()


def test_a_stopped_engine_holding_a_request_is_stalled_until_it_goes_on(supervised):
    s = supervised
    pid = s.backend.engine.process.pid
    ids = s.tok.encode("The king")
    n = 120
    stream = s.client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=0, stream=True)
    chunks = iter(stream)
    texts = [next(chunks).choices[0].text]  # streaming
    os.kill(pid, signal.SIGSTOP)
    try:
        code, body = until(lambda: (h := health(s.url))[0] == 503 and h)
        assert body["status"] == "stalled" and body["requests"] == 1 and body["stall_timeout_s"] == 1.0
        assert body["stalled_s"] >= 1.0
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2},
                       headers=AUTH, timeout=30)  # not queued behind it: refused at once
        assert r.status_code == 503 and "stalled" in r.json()["error"]["message"] and r.headers["Retry-After"]
    finally:
        os.kill(pid, signal.SIGCONT)
    until(lambda: health(s.url) == (200, {"status": "ok"}))
    rest = list(chunks)
    texts += [c.choices[0].text for c in rest]
    assert rest[-1].choices[0].finish_reason == "length"
    assert "".join(texts) == greedy_text(s, ids, n)  # the held request went on where it stopped


def test_a_killed_engine_process_is_restarted_once_with_a_warning(supervised, caplog):
    s = supervised
    old = s.backend.engine
    ids = s.tok.encode("The king")
    stream = s.client.completions.create(model=NAME, prompt=ids, max_tokens=120, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    with caplog.at_level(logging.WARNING, logger="glassformer.serve.supervisor"):
        os.kill(old.process.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="the engine died while running this request"):
            for _ in chunks:  # the stream's error event, then its end
                pass
        until(lambda: s.backend.engine is not old and health(s.url) == (200, {"status": "ok"}))
    assert old.process.exitcode == -signal.SIGKILL and s.backend.engine.process.is_alive()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the engine's process was killed by signal 9 (SIGKILL): restarting it (once; if it dies again the " \
           "server exits)" in warned
    out = s.client.completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == greedy_text(s, ids, 6)  # served again, by the new engine
    assert s.fatal == [] and s.supervisor.deaths == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_restarted_then_a_second_death_is_fatal():
    V = tokenizer().vocab_size
    s = Served(max_batch=2, engine="thread", hook=functools.partial(thread_exit_hook, V - 2), stall_timeout=30.0)
    try:
        ids = s.tok.encode("The king")
        for death in (1, 2):
            r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": [V - 2] * 3, "max_tokens": 3},
                           headers=AUTH, timeout=30)
            assert r.status_code == 503 and "the engine died" in r.json()["error"]["message"]
            if death == 1:
                until(lambda: health(s.url) == (200, {"status": "ok"}) and s.engine._thread.is_alive())
                out = s.client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
                assert out.choices[0].text == greedy_text(s, ids, 4)
        until(lambda: s.fatal)
        assert s.fatal == ["the engine's thread ended again after its restart: the server exits so that what runs it "
                           "can start it afresh"]
        assert health(s.url) == (503, {"status": "down"})
    finally:
        s.stop()


def test_an_idle_engine_is_never_stalled():
    """The rule, on a clock of the test's own: a minute without a step is nothing while no request is
    held; with one held it is stalled once `stall_timeout` has passed; a step ends it."""
    model = tiny_model(vocab_size=64)
    engine = Engine(model, max_batch=1)  # never started: it steps only when the test says
    backend = Backend("m").ready(engine, model, None)
    now = [1000.0]
    supervisor = Supervisor(backend, stall_timeout=5.0)  # not started: the test looks when it likes
    supervisor.clock = lambda: now[0]
    backend.supervisor = supervisor  # (what start() does)
    supervisor._look(engine)
    now[0] += 60
    supervisor._look(engine)
    assert backend.health() == (200, {"status": "ok"})
    engine.submit(Request([1, 2, 3], 2))
    now[0] += 4.9
    supervisor._look(engine)
    assert backend.health() == (200, {"status": "ok"})
    now[0] += 0.2
    assert backend.health() == (503, {"status": "stalled", "stalled_s": 5.1, "requests": 1, "stall_timeout_s": 5.0})
    engine.step()
    assert backend.health() == (200, {"status": "ok"})  # a step since the last look: not stalled


def test_a_bad_stall_timeout_is_refused_before_anything_listens(capsys, tmp_path):
    for value in ("0", "-1", "nan"):
        assert main(["serve", "--checkpoint", str(tmp_path), "--stall-timeout", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --stall-timeout must be > 0 seconds") and "Traceback" not in err


def engine_of(server: int) -> int | None:
    """The pid of `glassformer serve`'s engine process (multiprocessing's resource tracker is a child too)."""
    for task in Path(f"/proc/{server}/task").glob("*/children"):
        for pid in task.read_text().split():
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except FileNotFoundError:
                pass
    return None


@pytest.mark.slow  # two loads of the engine's process (each imports torch anew): 20-30 s on a busy 2-core machine
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the engine's process through /proc")
def test_serve_exits_1_when_its_engine_dies_twice(tmp_path):
    """`glassformer serve` as a service manager sees it: the engine killed once is restarted (a request
    answered again), killed again the server exits with status 1 and one line, no traceback."""
    proc, url = serve_in_a_process(tmp_path / "ckpt")
    try:
        first = until(lambda: engine_of(proc.pid))
        os.kill(first, signal.SIGKILL)
        second = until(lambda: (pid := engine_of(proc.pid)) != first and pid)
        until(lambda: health(url) == (200, {"status": "ok"}))
        model, tok = load(tmp_path / "ckpt")
        ids = tok.encode("The king")
        want = tok.decode([t for t in generate(model, ids, max_new_tokens=4, greedy=True, stop=list(tok.eos_ids))
                           if t not in tok.eos_ids])
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="ckpt", prompt=ids, max_tokens=4, temperature=0).choices[0].text == want
        os.kill(second, signal.SIGKILL)
        out, err = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and out == "", (proc.returncode, err)
    lines = err.strip().splitlines()
    assert "the engine's process was killed by signal 9 (SIGKILL): restarting it (once; if it dies again the " \
           "server exits)" in lines
    assert lines[-1] == "error: the engine's process was killed by signal 9 (SIGKILL) again after its restart: the " \
                        "server exits so that what runs it can start it afresh"
    assert "Traceback" not in err
