"""Continuous batching: many requests share one KV cache and one batched forward per decode step.

An `Engine` owns a cache of `max_batch` rows, sized to the model's context and allocated once. A
request (`Request`) waits in a queue until a row is free, is prefilled in chunks of `prefill_chunk`
tokens between the running rows' decode steps, then decodes with them: every decode step is one
forward of the model's own modules over every decoding row, each at its own position. A request
leaves the batch when it finishes or its ticket is cancelled; the last row moves into its place, so
the decoding rows stay 0..n-1 and a forward runs over a view of the first n rows (KVCache.view).

Each row samples with its own torch.Generator and its own parameters, one row at a time with the
draws `sampling.sample` makes, so a seeded request gives the tokens in-process `generate` gives,
alone or batched. docs/generation.md#continuous-batching.

One step, in phases: release (cancelled rows out), prefill (admit queued requests into free rows,
feed prompt chunks), decode (one forward), emit (sample, log-probabilities, events), release
(finished rows out).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Sequence

import torch

from ..speed import install as install_speed
from ..errors import UserError
from ..kv_cache import KVCache
from ..probes import active as probes_active
from .compiled import compile_step, step_key
from .logprobs import TokenLogprob, logprobs_of, prompt_logprobs
from .sampling import NonFiniteLogits, apply_repetition_penalty, check_sampling, draw, greedy_ids
from .session import _ends_with_stop, _stops

__all__ = ["QueueFull", "ContextLengthExceeded", "EngineStopped", "Request", "Event", "Ticket", "Engine",
           "BUCKETS", "bucket", "check_request"]

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)  # the batch sizes a compiled decode step is run at (rows padded up)
# A batched decode step reads the cache up to the furthest row's position, rounded up: eagerly to a
# multiple of EAGER_LENGTH_STEP, a new view (KVCache.view, a few hundred microseconds) once each 16
# positions, where a multiple of 64 read 32 slots too many on average (bench/batching.py --length-step 64,
# docs/benchmarks-log.md#continuous-batching-in-process); compiled to a power of two from LENGTH_STEP
# (each length a compile of its own).
EAGER_LENGTH_STEP = 16
LENGTH_STEP = 64


class QueueFull(UserError):
    """The queue of waiting requests is full (a server answers 429)."""


class ContextLengthExceeded(UserError):
    """A prompt plus max_tokens is longer than the model's context (a server answers 400)."""


class EngineStopped(UserError):
    """The engine is stopping or stopped and takes no more requests (a server answers 503)."""


@dataclass
class Request:
    """One completion to run: prompt ids and how to sample (each request its own parameters)."""

    ids: list[int]
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None  # the row's torch.Generator is seeded with it; None: a fresh random seed
    stop_ids: Sequence = ()  # token ids and/or id sequences ending the request (yielded, finish "stop")
    logprobs: int | None = None  # None: none; k >= 0: each new token's TokenLogprob with its top k
    prompt_logprobs: int | None = None  # score the prompt (echo), top k each; max_tokens 0 then only scores it
    steer: float | None = None  # this request's multiple of the model's steering vectors (research.steering); None: 1


@dataclass
class Event:
    """What a ticket yields: a new token, or the end (finish set on the last event)."""

    token: int | None
    logprob: TokenLogprob | None = None
    finish: str | None = None  # None while going; "stop" | "length" | "cancelled" | "error" on the last event
    prompt: list[TokenLogprob] | None = None  # once, on the first event, when prompt_logprobs was asked


def bucket(n: int, max_batch: int) -> int:
    """The batch size a compiled step runs n rows at: the next of BUCKETS (past 16, the next
    multiple of 16), at most max_batch.

    >>> [bucket(n, 8) for n in (1, 2, 3, 5, 8)]
    [1, 2, 4, 8, 8]
    """
    b = next((b for b in BUCKETS if b >= n), -(-n // BUCKETS[-1]) * BUCKETS[-1])
    return min(b, max_batch)


def round_up(n: int, step: int, limit: int) -> int:
    """n rounded up to a multiple of step, at most limit.

    >>> round_up(65, 64, 1000), round_up(65, 64, 100)
    (128, 100)
    """
    return min(-(-n // step) * step, limit)


def slots_to_read(need: int, context: int, compiled: bool, cuda: bool) -> int:
    """How many cache slots a decode step reads, at least `need`: eagerly, rounded up to EAGER_LENGTH_STEP;
    a compiled step the next power of two from LENGTH_STEP (each length is a step of its own, the cache's
    length a constant of its trace), and on a GPU the whole cache (one CUDA graph a batch size).

    >>> slots_to_read(70, 2048, False, False), slots_to_read(70, 2048, True, False), slots_to_read(1500, 2048, True, False)
    (80, 128, 2048)
    """
    if not compiled:
        return round_up(need, EAGER_LENGTH_STEP, context)
    if cuda:
        return context
    return min(max(LENGTH_STEP, 1 << (need - 1).bit_length()), context)


def check_request(r: Request, vocab_size: int, context: int) -> list[tuple[int, ...]]:
    """A request's checks against a model's vocabulary and context, as UserErrors saying what to change
    (ContextLengthExceeded when too long); its stop sequences. What `Engine.submit` checks, also where
    the engine runs in another process (serve.worker checks there before sending a request)."""
    V = vocab_size
    if not r.ids:
        raise UserError("the prompt is empty: give at least one token")
    bad = [t for t in r.ids if not (isinstance(t, int) and 0 <= t < V)]
    if bad:
        raise UserError(f"token id {bad[0]!r} is outside the vocabulary 0..{V - 1}")
    if not isinstance(r.max_tokens, int) or r.max_tokens < 0:
        raise UserError(f"max_tokens must be an integer >= 0, got {r.max_tokens!r}")
    check_sampling(r.temperature, r.top_k, r.top_p, r.min_p, r.repetition_penalty)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(r, name)
        if k is not None and (not isinstance(k, int) or k < 0):
            raise UserError(f"{name} must be an integer >= 0 (or unset), got {k!r}")
    if r.seed is not None and not isinstance(r.seed, int):
        raise UserError(f"seed must be an integer, got {r.seed!r}")
    if len(r.ids) + r.max_tokens > context:
        raise ContextLengthExceeded(
            f"the prompt ({len(r.ids)} tokens) plus max_tokens ({r.max_tokens}) is more than the model's "
            f"context of {context} tokens: shorten the prompt or ask for fewer tokens")
    stops = _stops(list(r.stop_ids))
    if any(not s or not all(isinstance(t, int) and 0 <= t < V for t in s) for s in stops):
        raise UserError(f"stop ids must be token ids (or sequences of them) in 0..{V - 1}")
    return stops


class Ticket:
    """One submitted request: its events as they come, blocking (`events`) or for asyncio (`aevents`).

    Leaving either iterator before its last event cancels the request (its row is freed)."""

    def __init__(self, request: Request, engine: "Engine", stops: list[tuple[int, ...]] = ()):
        self.request = request
        self.prompt_tokens = len(request.ids)
        self.completion_tokens = 0
        self.finish: str | None = None
        self._engine, self._stops = engine, list(stops)
        self._events: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancelled = False

    def _push(self, event: Event) -> None:
        """Called by the engine: hand one event to whoever waits."""
        with self._cond:
            if self.finish is not None:
                return  # finished already (a cancel racing the last token)
            if event.token is not None:
                self.completion_tokens += 1
            self.finish = event.finish
            self._events.append(event)
            self._cond.notify_all()
            waiters = list(self._waiters)
        if waiters:
            self._engine._wake(waiters)

    @property
    def pending(self) -> bool:
        """Whether an event has come that no iterator has taken yet."""
        return bool(self._events)

    def _pop(self) -> Event | None:
        with self._cond:
            return self._events.popleft() if self._events else None

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events, blocking for each. `timeout` seconds without one raise TimeoutError, which (like
        leaving the loop early) ends the iteration and cancels the request."""
        done = False
        try:
            while not done:
                with self._cond:
                    if not self._cond.wait_for(lambda: self._events, timeout):
                        raise TimeoutError(f"no event within {timeout} s")
                    event = self._events.popleft()
                done = event.finish is not None
                yield event
        finally:
            if not done:
                self.cancel()

    async def aevents(self) -> AsyncIterator[Event]:
        """The same events for asyncio code: waits without blocking the loop."""
        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, ready))
        done = False
        try:
            while not done:
                with self._cond:
                    event = self._events.popleft() if self._events else None
                    if event is None:
                        ready.clear()  # under the lock: an event pushed after this sets it again
                if event is None:
                    await ready.wait()
                    continue
                done = event.finish is not None
                yield event
        finally:
            with self._cond:
                self._waiters.remove((loop, ready))
            if not done:
                self.cancel()

    def cancel(self) -> None:
        """The client went away: the request ends with finish "cancelled", its row freed before the next step."""
        if self.finish is None:
            self.cancelled = True
            self._engine._cancel(self)


def greedy_tokens(logits: torch.Tensor, rows: list) -> list[int | None]:
    """Each greedy row's next token from one argmax over the step's logits (n, V), None for the
    others: what `sample` gives such a row alone (its argmax, the first of equal maxima; -1 where the
    logits have no finite maximum, which `_emit` answers with an error), without an
    argmax and a read of its result (a tensor to a Python int) for each row."""
    greedy = [r.request.temperature == 0 and r.seen is None and not r.ticket.cancelled for r in rows]
    if sum(greedy) < 2:
        return [None] * len(rows)
    return [t if g else None for t, g in zip(greedy_ids(logits).tolist(), greedy)]


def wake_loops(wakes: dict) -> None:
    """Set each loop's asyncio.Events, one call_soon_threadsafe per loop."""
    for loop, events in wakes.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # that loop has closed: nobody waits there any more
            pass


def _set_all(events: list) -> None:
    for ready in events:
        ready.set()


@dataclass
class _Row:
    """A request in a cache row: its text so far, how much of it is in the cache, how it samples."""

    ticket: Ticket
    text: list[int]  # prompt, then every token made
    fed: int  # tokens of text whose keys and values are cached (their slots are 0..fed-1)
    generator: torch.Generator
    stops: list[tuple[int, ...]]
    seen: torch.Tensor | None  # (1, V) bool, the tokens in text, where a repetition penalty asks for it
    made: int = 0
    scores: list[TokenLogprob] | None = None  # the prompt's log-probabilities so far (prompt_logprobs)

    @property
    def request(self) -> Request:
        return self.ticket.request

    @property
    def longest_stop(self) -> int:
        return max(map(len, self.stops), default=0)

    @property
    def prompt_done(self) -> bool:
        return self.fed >= len(self.request.ids)


class Engine:
    """Continuous batching over one model and one KV cache of `max_batch` rows (module docstring)."""

    def __init__(self, model, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256,
                 compile: bool = False):
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if int(v) != v or v < 1:
                raise UserError(f"{name} must be an integer >= 1, got {v}")
        self.model, self.max_batch, self.max_queue, self.prefill_chunk = model, max_batch, max_queue, prefill_chunk
        self.device = next(model.parameters()).device
        self.context = model.config.max_seq_len
        self.cache = KVCache.for_model(model, max_batch)  # (max_batch, K, S, H) per layer, allocated once
        self._views: dict[tuple[int, int, int], KVCache] = {}  # (lo, hi, length) -> a view of the cache
        self.rows: list[_Row | None] = [None] * max_batch  # decoding rows 0..n_dec-1, then at most one prefilling
        self.n_dec = 0
        self.queue: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Condition()
        self._cancels: set[Ticket] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = self.decode_steps = self.prefill_tokens = self.decode_tokens = self.moves = 0
        self.prefill_forwards = 0
        self._wakes: dict | None = None  # while a step runs: loop -> the asyncio.Events its events set
        self._stepper: int | None = None  # the thread running that step
        self.compile = bool(compile)
        self._compiled: dict[tuple[int, int], object] = {}  # (rows, slots read) -> its compiled decode step
        self._step_key, self.shapes = None, set()
        # Decode steps at the batch sizes of BUCKETS, padded with rows that touch no real row's keys:
        # what a compiled step needs (few shapes); settable on an eager engine (tests).
        self.pad_rows = bool(compile)
        install_speed(model)  # as a Session does: re-classed modules, the same objects and hooks (glassformer.speed)
        # A steered model (research.steering.steer) scales its vectors row by row by this buffer, which
        # each forward fills in place with its rows' requests' `steer` (a compiled step reads it as an input).
        self._steer_rows = None
        steering = getattr(model, "steering", None)
        if steering is not None:
            self._steer_rows = steering.row_scales = torch.ones(max_batch, device=self.device)

    # ---- the public side ---------------------------------------------------------------
    @property
    def stats(self) -> dict:
        with self._lock:
            prefilling = sum(r is not None for r in self.rows[self.n_dec:])
            return {"active": self.n_dec + prefilling, "decoding": self.n_dec, "queued": len(self.queue),
                    "steps": self.steps, "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
                    "prefill_tokens": self.prefill_tokens, "prefill_forwards": self.prefill_forwards,
                    "moves": self.moves, "max_batch": self.max_batch, "max_queue": self.max_queue,
                    "kv_bytes_per_row": self.cache.row_bytes(), "compiled_batch_sizes": sorted(self.shapes),
                    "compiled_steps": len(self._compiled)}

    def submit(self, request: Request) -> Ticket:
        """Check the request (UserError, ContextLengthExceeded, QueueFull, EngineStopped) and queue it."""
        stops = self._check(request)
        ticket = Ticket(request, self, stops)
        if request.max_tokens == 0 and request.prompt_logprobs is None:
            ticket._push(Event(None, finish="length"))  # nothing to compute
            return ticket
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is stopping: try again later")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are waiting already (the queue's limit): try again later")
            self.queue.append(ticket)
            self._lock.notify_all()
        return ticket

    def start(self) -> "Engine":
        """Run the steps on a background thread (daemon) until stop()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="glassformer-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Take nothing new; end every waiting and running request with finish "cancelled"."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            tickets = list(self.queue) + [r.ticket for r in self.rows if r is not None]
            self.queue.clear()
            self.rows, self.n_dec = [None] * self.max_batch, 0
        for t in tickets:
            t._push(Event(None, finish="cancelled"))

    def step(self) -> bool:
        """One step (release, prefill, decode, emit, release): what the started engine's thread runs
        in a loop, or a caller's own thread for an engine not started (tests, benchmarks). Returns
        whether there was anything to do."""
        with self._lock:
            self._release_cancelled()
            busy = bool(self.queue) or any(r is not None for r in self.rows)
        if not busy:
            return False
        self._wakes, self._stepper = {}, threading.get_ident()
        try:
            with torch.inference_mode():
                self._prefill()
                self._decode()
        finally:
            wakes, self._wakes = self._wakes, None
            wake_loops(wakes)
        self.steps += 1
        return True

    def _wake(self, waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
        """Wake asyncio waiters: gathered while this thread steps (one wake-up per loop per step, not
        one per row: each is a write to the loop's pipe and a hand-over of the interpreter lock),
        else at once (a cancel, a stop, an empty request)."""
        wakes = self._wakes
        if wakes is not None and threading.get_ident() == self._stepper:
            for loop, ready in waiters:
                wakes.setdefault(loop, []).append(ready)
        else:
            wake_loops({loop: [ready] for loop, ready in waiters})

    # ---- checks ------------------------------------------------------------------------
    def _check(self, r: Request) -> list[tuple[int, ...]]:
        """The request's checks, as UserErrors saying what to change; its stop sequences."""
        if r.steer is not None and self._steer_rows is None:
            raise UserError("steer: this model is not steered (start the server with --steer VEC), so there is "
                            "no vector to scale")
        return check_request(r, self.model.config.vocab_size, self.context)

    def _steer(self, rows: list) -> None:
        """Each row's steering multiple into the buffer the steering hooks read (a free row: 1)."""
        if self._steer_rows is not None:
            scales = [1.0 if r is None or r.request.steer is None else float(r.request.steer) for r in rows]
            self._steer_rows[:len(scales)].copy_(torch.tensor(scales))

    # ---- the loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopping or self.queue or self._cancels
                                    or any(r is not None for r in self.rows))
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug or out of memory: end every request rather than hang its client
                log.exception("engine step failed; ending every request")
                self._fail_all()

    def _fail_all(self) -> None:
        with self._lock:
            tickets = list(self.queue) + [r.ticket for r in self.rows if r is not None]
            self.queue.clear()
            self.rows, self.n_dec = [None] * self.max_batch, 0
        for t in tickets:
            t._push(Event(None, finish="error"))

    def _cancel(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket in self.queue:
                self.queue.remove(ticket)
                ticket._push(Event(None, finish="cancelled"))
            else:
                self._cancels.add(ticket)
            self._lock.notify_all()

    # ---- release -----------------------------------------------------------------------
    def _release_cancelled(self) -> None:
        """Free the rows of cancelled tickets (under the lock)."""
        if not self._cancels:
            return
        for i in reversed(range(self.max_batch)):
            r = self.rows[i]
            if r is not None and r.ticket in self._cancels:
                r.ticket._push(Event(None, finish="cancelled"))
                self._release(i)
        self._cancels.clear()

    def _release(self, i: int) -> None:
        """Free row i: the last decoding row moves into its place, and the prefilling row (if any)
        into the last decoding row's, so the decoding rows stay 0..n_dec-1."""
        if i >= self.n_dec:  # the prefilling row
            self.rows[i] = None
            return
        last = self.n_dec - 1
        if i != last:
            self._move(last, i)
        self.rows[last] = None
        self.n_dec -= 1
        if last + 1 < self.max_batch and self.rows[last + 1] is not None:
            self._move(last + 1, last)

    def _move(self, src: int, dst: int) -> None:
        """Move row src's request and cached slots to row dst; src becomes free."""
        r = self.rows[src]
        self.cache.copy_row(src, dst, r.fed)
        self.moves += 1
        self.rows[dst], self.rows[src] = r, None

    # ---- prefill -----------------------------------------------------------------------
    def _admit(self, ticket: Ticket) -> _Row:
        """A row for a queued ticket: its generator seeded, its penalty's seen tokens marked."""
        r = ticket.request
        g = torch.Generator(self.device)
        g.manual_seed(int(r.seed)) if r.seed is not None else g.seed()
        seen = None
        if r.repetition_penalty != 1.0:
            seen = torch.zeros(1, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
            seen[0, torch.tensor(r.ids, device=self.device)] = True
        scores = [] if r.prompt_logprobs is not None else None
        return _Row(ticket, list(r.ids), 0, g, ticket._stops, seen, scores=scores)

    def _take(self, budget: int, whole: bool) -> list[Ticket]:
        """Queued tickets to admit now, oldest first, into the free rows: those whose prompts fit the
        budget whole and need no scoring (whole=True; one forward prefills them together), else the
        oldest alone."""
        free = self.max_batch - self.n_dec
        with self._lock:
            if not whole:
                return [self.queue.popleft()] if self.queue and free > 0 else []
            taken, T = [], 0
            while self.queue and len(taken) < free:
                r = self.queue[0].request
                if r.prompt_logprobs is not None or max(T, len(r.ids)) * (len(taken) + 1) > budget:
                    break  # (the budget bounds the padded batch's tokens)
                T = max(T, len(r.ids))
                taken.append(self.queue.popleft())
            return taken

    def _prefill(self) -> None:
        """Feed prompts, prefill_chunk tokens a step in all: first the prompt part-way in (row n_dec),
        then the queued prompts that fit whole, in one forward, then the next one, chunked. A prompt
        fed whole gets its first token and joins the decoding rows."""
        budget = self.prefill_chunk
        while budget > 0:
            i = self.n_dec
            if i < self.max_batch and self.rows[i] is not None:  # part-way in: its next chunk
                budget -= self._feed(i, budget)
                continue
            group = self._take(budget, whole=True)
            if group:
                budget -= self._prefill_group(group)
                continue
            alone = self._take(budget, whole=False)
            if not alone:
                return
            self.rows[i] = self._admit(alone[0])

    def _feed(self, i: int, budget: int) -> int:
        """Row i's next chunk of at most `budget` tokens; the row decodes once its prompt is in.
        Returns the tokens fed."""
        r = self.rows[i]
        n = min(len(r.request.ids) - r.fed, budget)
        logits = self._prefill_forward(i, r, n)  # (n, V) or (1, V)
        if r.prompt_done:
            self.n_dec += 1
            self._emit(i, logits[-1:])  # the first new token, from the prompt's last position
        return n

    def _prefill_group(self, tickets: list[Ticket]) -> int:
        """Whole prompts of several new requests in one right-padded forward at rows n_dec...; each gets
        its first token. Padding writes junk past a row's prompt, in slots its own decode steps write
        before any query reads them (docs/generation.md#the-cache-batches-and-sessions). Returns the
        tokens fed, padding included."""
        lo, m = self.n_dec, len(tickets)
        rows = [self._admit(t) for t in tickets]
        self.rows[lo:lo + m] = rows  # in their rows before the forward: a failing one ends them too (_fail_all)
        n = [len(r.text) for r in rows]
        T = max(n)
        ids = torch.tensor([r.text + [0] * (T - len(r.text)) for r in rows], device=self.device)  # (m, T)
        last = torch.tensor(n, device=self.device) - 1  # (m,)
        self._steer(rows)
        logits, _ = self.model(ids, cache=self._view(lo, lo + m, self.context), pos=0, logits_at=last)  # (m, 1, V)
        for r, k in zip(rows, n):
            r.fed = k
        self.n_dec += m
        self.prefill_tokens += sum(n)
        self.prefill_forwards += 1
        for j in reversed(range(m)):  # from the last row: a release moves only rows already emitted
            self._emit(lo + j, logits[j])
        return m * T

    def _prefill_forward(self, i: int, r: _Row, n: int) -> torch.Tensor:
        """Row i's next n prompt tokens in one forward: logits (n, V) where the prompt is scored,
        else (1, V) of the last of them."""
        a = r.fed
        ids = torch.tensor([r.request.ids[a:a + n]], device=self.device)  # (1, n)
        view = self._view(i, i + 1, self.context)  # an int position: the cache reads slots 0..a+n-1 only
        at = None if r.scores is not None else torch.tensor([n - 1], device=self.device)
        self._steer([r])
        logits, _ = self.model(ids, cache=view, pos=a, logits_at=at)  # (1, n or 1, V)
        r.fed += n
        self.prefill_tokens += n
        self.prefill_forwards += 1
        if r.scores is not None:
            r.scores += prompt_logprobs(logits[0], r.request.ids[a:a + n + 1], r.request.prompt_logprobs)
        return logits[0]

    # ---- decode ------------------------------------------------------------------------
    def _decode(self) -> None:
        """One forward over every decoding row, each feeding its last token at its own position."""
        n = self.n_dec
        if n == 0:
            return
        rows = self.rows[:n]
        compiled = self.compile and not self.model.training and not probes_active()
        B = bucket(n, self.max_batch) if self.pad_rows else n
        toks = [r.text[-1] for r in rows] + [0] * (B - n)
        # Padding rows sit on free rows, or on the prefilling one at its next prompt slot, which its
        # next chunk writes before anything reads it: no real row's keys are touched.
        pos = [r.fed for r in rows] + [self._pad_position(j) for j in range(n, B)]
        idx = torch.tensor(toks, device=self.device)[:, None]  # (B, 1)
        self._steer(rows + [None] * (B - n))  # (padding rows: any scale, their tokens are dropped)
        cuda = self.device.type == "cuda"
        if B == 1 and not (compiled and cuda):  # one row at an int position, as a one-row Session steps it:
            # the cache reads the filled slots only (compiled: a dynamic length)
            fwd = self._compiled_step(1, self.context) if compiled else self.model
            logits, _ = fwd(idx, cache=self._view(0, 1, self.context), pos=pos[0])  # (1, 1, V)
        else:  # every row at its own position, reading the slots up to the furthest one's
            L = slots_to_read(max(pos) + 1, self.context, compiled, cuda)
            fwd = self._compiled_step(B, L) if compiled else self.model
            logits, _ = fwd(idx, cache=self._view(0, B, L), pos=torch.tensor(pos, device=self.device))  # (B, 1, V)
        if compiled:
            self.shapes.add(B)
        self.decode_steps += 1
        self.decode_tokens += n
        for r in rows:
            r.fed += 1
        argmax = greedy_tokens(logits[:n, -1], rows)
        for i in reversed(range(n)):  # from the last row: a release moves only rows already emitted
            self._emit(i, logits[i, -1:], argmax[i])

    def _view(self, lo: int, hi: int, length: int) -> KVCache:
        """The cache's rows lo..hi-1 and slots 0..length-1, built once (a view costs module set-ups)."""
        key = (lo, hi, length)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 4096:
                self._views.clear()
            view = self._views[key] = self.cache.view(lo, hi, length)
            if self.compile and self.device.type == "cuda":
                for lay in view.layers:  # fixed addresses: CUDA graphs may keep them
                    torch._dynamo.mark_static_address(lay.k)
                    torch._dynamo.mark_static_address(lay.v)
        return view

    def _pad_position(self, j: int) -> int:
        r = self.rows[j]
        return 0 if r is None else r.fed

    def _compiled_step(self, B: int, L: int):
        """The compiled decode step for B rows reading L slots: a private copy for each (compile_step),
        since a step keeps no guard on the cache, whose shape (B, K, L, H) its trace takes as fixed;
        all traced anew when the model's hooks, kernels, dtype or threads changed (step_key)."""
        key = step_key(self.model)
        if self._step_key not in (None, key):
            self._compiled.clear()
        self._step_key = key
        if (B, L) not in self._compiled:
            self._compiled[B, L] = compile_step(self.device)
        return functools.partial(self._compiled[B, L], self.model)

    # ---- emit --------------------------------------------------------------------------
    def _emit(self, i: int, logits: torch.Tensor, argmax: int | None = None) -> None:
        """Row i's next token from its logits (1, V), sampled as `sample` samples one row (a greedy row's
        `argmax` given: greedy_tokens); its event pushed; the row released when the request finished
        (or was cancelled meanwhile)."""
        r = self.rows[i]
        req, ticket = r.request, r.ticket
        prompt, r.scores = r.scores, None
        if ticket.cancelled or req.max_tokens == 0:  # cancelled, or the prompt scored and nothing to make
            ticket._push(Event(None, finish="cancelled" if ticket.cancelled else "length", prompt=prompt))
            return self._finish(i)
        t = argmax if argmax is not None else self._sampled(r, logits)
        if t < 0:  # the model's logits are NaN or infinite: this request fails (a server's 500), the others go on
            log.error("request ended with an error: %s", NonFiniteLogits())
            ticket._push(Event(None, finish="error", prompt=prompt))
            return self._finish(i)
        lp = None
        if req.logprobs is not None:
            lp = logprobs_of(logits, torch.tensor([t], device=logits.device), req.logprobs)[0]
        r.text.append(t)
        r.made += 1
        if r.seen is not None:
            r.seen[0, t] = True
        tail = r.text[len(r.text) - min(r.made, r.longest_stop):]  # the newest tokens, none of the prompt's
        finish = "stop" if r.stops and _ends_with_stop(tail, r.stops) else None
        if finish is None and r.made >= req.max_tokens:
            finish = "length"
        ticket._push(Event(t, lp, finish, prompt))
        if finish is not None:
            self._finish(i)

    @staticmethod
    def _sampled(r: _Row, logits: torch.Tensor) -> int:
        """Row r's next token from its logits (1, V), drawn as `sample` draws one row (-1: not finite)."""
        req = r.request
        scored = logits if r.seen is None else apply_repetition_penalty(logits, r.seen, req.repetition_penalty)
        return int(draw(scored, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                        generator=r.generator))

    def _finish(self, i: int) -> None:
        with self._lock:
            self._cancels.discard(self.rows[i].ticket)
            self._release(i)
