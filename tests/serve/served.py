"""One OpenAI-compatible server for the tests of tests/serve: a real uvicorn on 127.0.0.1 (port 0)
with a tiny model, its engine in a process of its own (serve/worker.py, what `glassformer serve`
runs) or on a thread, tickets recorded; and the picklable loaders the engine's process runs
(a model seen by a hook: a gate holding its forwards, or a failure on a given token)."""

from __future__ import annotations

import functools
import os
import time

import openai

from glassformer.generation.batching import Engine
from glassformer.serve.backend import Backend
from glassformer.serve.http import Limits, Server, make_app
from glassformer.serve.openai import add_routes, openai_error
from glassformer.serve.supervisor import Supervisor
from glassformer.serve.worker import ProcessEngine
from glassformer.text.chat_template import CHATML_TEMPLATE
from glassformer.text.tokenizer import Tokenizer

from ..support import synthetic_text, tiny_model

KEY = "sk-test-0123"
NAME = "tiny-chat"
LIMITS = Limits(max_body=1 << 16, header_timeout=2.0, body_timeout=2.0)


def tokenizer() -> Tokenizer:
    tok = Tokenizer.train([synthetic_text(300, 1)], vocab_size=300)
    tok.add_chat_tokens()
    tok.chat_template = CHATML_TEMPLATE
    return tok


def hooked_tiny_model(vocab_size: int, hook=None):
    """tiny_model (the same weights in every process: seeded), with `hook(module, args)` before each forward."""
    model = tiny_model(vocab_size=vocab_size)
    if hook is not None:
        model.register_forward_pre_hook(hook)
    return model


def gate_hook(forwards, gate, module, args) -> None:
    """Count forwards (a shared multiprocessing Value); from the third on, wait for `gate` (an Event)."""
    with forwards.get_lock():
        forwards.value += 1
        n = forwards.value
    if n > 2:
        gate.wait(30)


def slow_hook(seconds: float, module, args) -> None:
    """Each forward takes `seconds` longer (a request of many tokens is still running when the test acts)."""
    time.sleep(seconds)


def thread_exit_hook(exit_id: int, module, args) -> None:
    """A prompt of only `exit_id` (two or more) ends the engine's thread (SystemExit out of its step,
    which the loop does not catch, as it catches a failing step's exceptions)."""
    ids = args[0]
    if ids.shape[-1] >= 2 and bool((ids == exit_id).all()):
        raise SystemExit("the engine's thread ends here (the test's)")


def failing_hook(raise_id: int, exit_id: int, module, args) -> None:
    """A prompt of only `raise_id` (two or more) makes its forward raise (a failing step); one of only
    `exit_id` ends the process at once. (A decode step feeds one token a row: never these.)"""
    ids = args[0]
    if ids.shape[-1] >= 2 and bool((ids == exit_id).all()):
        os._exit(3)
    if ids.shape[-1] >= 2 and bool((ids == raise_id).all()):
        raise RuntimeError("a failing step (the test's)")


class Served:
    """One server: its URL, model (this process's copy), tokenizer, engine (tickets recorded) and clients.
    `hook` (picklable) sees every forward of the engine's model, in whichever process it runs. With
    `stall_timeout`, a Supervisor watches the engine as in `glassformer serve` (its fatal lines kept
    in `fatal`)."""

    def __init__(self, max_batch: int, max_queue: int = 64, engine: str = "process", hook=None,
                 stall_timeout: float | None = None):
        self.tok = tok = tokenizer()
        self.model = hooked_tiny_model(tok.vocab_size)
        self.eos = list(tok.eos_ids)
        sizes = dict(max_batch=max_batch, max_queue=max_queue)
        self.backend = Backend(NAME)
        app = add_routes(make_app(host="127.0.0.1", port=0, api_key=KEY, limits=LIMITS, error_body=openai_error),
                         self.backend)
        self.server = Server(app, "127.0.0.1", 0, LIMITS)
        self.url = self.server.start_in_thread()
        if engine == "process":  # its pipe read on the server's loop, as `glassformer serve` does
            load = functools.partial(hooked_tiny_model, tok.vocab_size, hook)
            self.engine = ProcessEngine(load, **sizes).start(loop=self.server.loop).wait_ready(120)
        else:
            self.engine = Engine(hooked_tiny_model(tok.vocab_size, hook), **sizes).start()
        self.tickets, self.log = [], []
        submit = self.engine.submit
        self.engine.submit = lambda r: self._record(submit(r))
        self.backend.ready(self.engine, self.model, tok)
        self.fatal: list[str] = []
        self.supervisor = None if stall_timeout is None else \
            Supervisor(self.backend, stall_timeout=stall_timeout, on_fatal=self.fatal.append).start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)
        self.aclient = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def _record(self, ticket):
        """Keep each ticket, and log (engine step, ticket index, finish or token) as events are pushed."""
        index, push = len(self.tickets), ticket._push
        self.tickets.append(ticket)
        ticket._push = lambda ev: (self.log.append((self.engine.steps, index, ev.finish or ev.token)), push(ev))[1]
        return ticket

    def stop(self):
        if self.supervisor is not None:
            self.supervisor.stop()
        self.server.stop()
        self.backend.engine.stop()  # (the engine a supervisor started, if it restarted one)
