"""The engine in a process of its own (`ProcessEngine`), so the model's forward and the HTTP
process never wait on each other's interpreter lock.

Why: with the engine on a thread of the server's process, its decode step took 1.85 ms against 1.24
ms in-process on the demo shape (docs/benchmarks-log.md#serve): the lock handed back and forth between
the forward's many small operations and the thread taking each token. Here a child process (the
"spawn" start method: safe with torch and CUDA) loads the checkpoint itself through the loader it is
given (a picklable callable, e.g. the one `glassformer serve` loads with), builds the same
`generation.batching.Engine` and runs its loop. Requests and cancels go down a pipe; the steps'
events come back up another, a message at most every few milliseconds while streaming
(`ChildEngine`: a request's first and last events at once), which is handed to the tickets
(`batching.Ticket`, the same blocking and asyncio iterators), waking each event loop once per
message. Who reads that pipe: a reader thread here, or, given `start(loop=...)`, that asyncio loop
itself (`loop.add_reader`), as `glassformer serve` does: its HTTP side then takes the engine's
events on the loop that streams them, with no thread to wake and no hand-over between threads per
message (docs/benchmarks-log.md#serve).

What can be answered at submit time is answered here, synchronously, with the engine's own errors:
the request's checks (`check_request`, against the model's config the child sends once loaded),
QueueFull (the child's queue as of its last message plus the requests sent since), EngineStopped.
The child exits with the parent: at the pipe's end of file, and (while it loads) once its parent
process is gone; it ignores Ctrl-C, which the parent handles by stopping it. If it exits unasked,
the requests it held end with finish LOST; what then happens (a restart, the server's exit) is
serve.supervisor's (`wait_exit`, `held`, `bury`, `successor`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time

import torch

from ..errors import UserError
from ..generation.batching import (Engine, EngineStopped, Event, QueueFull, Request, Ticket, check_request,
                                   wake_loops)

__all__ = ["ProcessEngine"]

log = logging.getLogger(__name__)

STATS_EVERY = 0.25  # seconds between the child's full stats (its counts ride on every message)
STREAM_INTERVAL = 0.02  # seconds: the child's messages come at most this often while it streams (ChildEngine)
MAX_STREAM_INTERVAL = 1.0  # seconds: the longest a stream interval may be
STOP_WAIT = 30.0  # seconds the child gets to end its requests and exit before it is terminated
LOST = "lost"  # the finish of a request whose engine died under it (a server answers 503: retry)


def exit_reason(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that ended it).

    >>> exit_reason(-9), exit_reason(3), exit_reason(None)
    ('was killed by signal 9 (SIGKILL)', 'exited with code 3', 'exited')
    """
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ProcessEngine:
    """`Engine`'s interface (submit, stats, start, stop) over an Engine in a child process.

    `load()` runs in the child and returns the model, or (model, tokenizer); `threads` is the
    child's torch thread count (default: this process's); `stream_interval` the least time in
    seconds between two of the child's messages while it streams (ChildEngine; 0: one a step).
    `config` and `tokenizer` are the child's once `wait_ready()` returns; `on_exit(reason)` is called
    if the child exits unasked (the reason a line such as "the engine's process was killed by signal 9
    (SIGKILL)")."""

    def __init__(self, load, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256,
                 compile: bool = False, threads: int | None = None, stream_interval: float = STREAM_INTERVAL):
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if int(v) != v or v < 1:
                raise UserError(f"{name} must be an integer >= 1, got {v}")
        if not 0 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise UserError(f"stream_interval must be between 0 and {MAX_STREAM_INTERVAL:g} s, got {stream_interval}")
        self.load, self.max_batch, self.max_queue = load, max_batch, max_queue
        self.sizes = dict(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk, compile=compile,
                          stream_interval=stream_interval)
        self.threads = torch.get_num_threads() if threads is None else int(threads)
        self.config = self.tokenizer = self.process = self.on_exit = None
        self.steps = 0  # the child's engine steps, as of its last message
        self.child_threads: int | None = None  # the child's torch threads, once loaded
        self._down = self._up = self._reader = None  # the pipes to the child and from it; the reader thread
        self._loop = None  # or the asyncio loop that reads the child's pipe instead of a thread
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}  # request number -> its ticket, until its last event
        self._last = self._seen = self._queued = 0  # numbers sent, numbers the child has taken, its queue
        self._stats: dict = {}
        self._ready = threading.Event()
        self._failure: str | None = None  # why the child could not load, or that it exited
        self._stopping = False
        self._wakes: dict | None = None  # while a message is handed out: loop -> its asyncio.Events
        self._routing: int | None = None  # the thread handing a message out (its id), meanwhile

    # ---- the public side ---------------------------------------------------------------
    def start(self, loop=None) -> "ProcessEngine":
        """Spawn the child (it loads meanwhile: `wait_ready`). Its messages are read by a thread of this
        process, or, given a running asyncio `loop` (of any thread), by that loop (`add_reader`)."""
        if self.process is not None:
            return self
        ctx = multiprocessing.get_context("spawn")
        # Two one-way pipes, not one two-way socket: a socket wakes a reader blocked on it whenever its
        # peer drains what it wrote, so the child's reader woke at every step's message.
        inbox, self._down = ctx.Pipe(duplex=False)  # requests and cancels: parent -> child
        self._up, outbox = ctx.Pipe(duplex=False)  # the steps' events: child -> parent
        self.process = ctx.Process(target=child_main, args=((inbox, outbox), self.load, self.sizes, self.threads,
                                                            os.getpid()), name="glassformer-engine", daemon=True)
        self.process.start()
        inbox.close()  # only the child holds its ends: the parent's exit is the child's end of file
        outbox.close()
        if loop is None:
            self._reader = threading.Thread(target=self._read, name="glassformer-engine-reader", daemon=True)
            self._reader.start()
        else:
            self._loop = loop
            loop.call_soon_threadsafe(loop.add_reader, self._up.fileno(), self._readable)
        return self

    def wait_ready(self, timeout: float | None = None) -> "ProcessEngine":
        """Block until the child has loaded the model; UserError saying why if it could not."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the engine's process did not load within {timeout} s")
        if self.config is None:
            raise UserError(self._failure or "the engine's process exited before loading the model")
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self._failure is None and not self._stopping

    @property
    def stats(self) -> dict:
        """The child engine's stats (as of at most STATS_EVERY ago), its steps and queue as of its last message."""
        with self._lock:
            return {**self._stats, "steps": self.steps, "queued": self._waiting(), "process": self.process.pid}

    def submit(self, request: Request) -> Ticket:
        """Check the request (UserError, ContextLengthExceeded, QueueFull, EngineStopped) and send it."""
        self.wait_ready()
        stops = check_request(request, self.config.vocab_size, self.config.max_seq_len)
        ticket = Ticket(request, self, stops)
        if request.max_tokens == 0 and request.prompt_logprobs is None:
            ticket._push(Event(None, finish="length"))  # nothing to compute
            return ticket
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is stopping: try again later")
            if self._failure is not None:
                raise EngineStopped(f"{self._failure}: retry shortly")
            if self._waiting() >= self.max_queue:
                raise QueueFull(f"{self._waiting()} requests are waiting already (the queue's limit): try again later")
            self._last += 1
            ticket.number = self._last
            self._tickets[ticket.number] = ticket
            self._send(("submit", ticket.number, request))  # under the lock: sent in number order
        return ticket

    def stop(self) -> None:
        """Take nothing new; the child ends every request with finish "cancelled" and exits."""
        with self._lock:
            self._stopping = True
        if self.process is None:
            return
        self._send(("stop",))
        if self._reader is None:  # the loop read the pipe; a thread drains it from here, the loop may be gone
            self._unwatch()
            self._reader = threading.Thread(target=self._read, name="glassformer-engine-reader", daemon=True)
            self._reader.start()
        if self._reap(STOP_WAIT) is None:
            log.warning("the engine's process did not stop within %.0f s: terminating it", STOP_WAIT)
            self.process.terminate()
            self._reap(5)
        self._reader.join(5)
        self._end_all("cancelled")
        self._down.close()
        self._up.close()

    # ---- what a supervisor calls (serve.supervisor) -------------------------------------
    @property
    def held(self) -> int:
        """Requests sent to the child and not yet ended: queued there, running, or on their way."""
        return len(self._tickets)

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to `timeout` s for the child to exit unasked: its exit code (negative: the signal that
        ended it); None while it runs, and after stop() (an exit asked for) at once."""
        if self.process is None or self._stopping:
            return None
        if not multiprocessing.connection.wait([self.process.sentinel], timeout):
            return None
        code = self._reap()
        return None if self._stopping else code

    def bury(self) -> None:
        """After the child exited unasked: end every request it held (finish LOST, as its end of file
        does; whichever comes first), take nothing new and close its pipes."""
        self._unwatch()  # the loop reads the dead pipe no more (a read under way finishes first)
        with self._lock:
            self._stopping = True
        if self._reader is not None:
            self._reader.join(5)
        self._end_all(LOST)
        self._reap()
        self._down.close()
        self._up.close()

    def successor(self) -> "ProcessEngine":
        """A new engine like this one (its loader, sizes and threads, its pipe read where this one's
        was), started: its child loads meanwhile (`wait_ready`)."""
        return ProcessEngine(self.load, threads=self.threads, **self.sizes).start(loop=self._loop)

    # ---- what tickets call -------------------------------------------------------------
    def _cancel(self, ticket: Ticket) -> None:
        if not self._send(("cancel", ticket.number)):
            ticket._push(Event(None, finish="cancelled"))

    def _wake(self, waiters) -> None:
        """Gathered while the reader hands out one message's events (one wake-up per loop a message), else at once."""
        wakes = self._wakes
        if wakes is not None and threading.get_ident() == self._routing:
            for loop, ready in waiters:
                wakes.setdefault(loop, []).append(ready)
        else:
            wake_loops({loop: [ready] for loop, ready in waiters})

    # ---- the pipe ----------------------------------------------------------------------
    def _waiting(self) -> int:
        """Requests not yet in a row (under the lock): the child's queue, and those it has not read yet."""
        return self._queued + self._last - self._seen

    def _send(self, message) -> bool:
        try:
            with self._send_lock:
                send(self._down, message)
            return True
        except (OSError, ValueError):  # the child is gone (the reader ends its tickets)
            return False

    def _read(self) -> None:
        """The reader thread: the child's messages until its end of file."""
        try:
            while True:
                self._handle(self._up.recv())
        except (EOFError, OSError):
            pass
        self._gone()

    def _readable(self) -> None:
        """The loop's reader: one message a call (the loop calls again while more is waiting)."""
        try:
            message = self._up.recv()
        except (EOFError, OSError):
            self._unwatch()
            self._gone()
            return
        self._handle(message)

    def _unwatch(self) -> None:
        """Take the child's pipe off the loop's readers, and return once it is off (from any thread;
        nothing to do once the loop has closed)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._up.closed:
            return
        fd = self._up.fileno()
        if _running_loop() is loop or not loop.is_running():
            loop.remove_reader(fd)
            return
        off = threading.Event()
        try:
            loop.call_soon_threadsafe(lambda: (loop.remove_reader(fd), off.set()))
        except RuntimeError:  # closed meanwhile
            return
        off.wait(5)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "ready":
            _, self.config, self.tokenizer, self._stats, self.child_threads = message
            self._ready.set()
        elif kind == "failed":
            self._failure = message[1]
            self._ready.set()
        else:  # "events": the child's counts after a step (or a cancel), the events since its last one (`packed`)
            _, steps, seen, queued, events, stats = message
            with self._lock:
                self.steps, self._seen, self._queued = steps, seen, queued
                if stats is not None:
                    self._stats = stats
                tickets = [(self._tickets.get(item[0]), unpacked(item)) for item in events]
                for item, (_, ev) in zip(events, tickets):
                    if ev.finish is not None:
                        self._tickets.pop(item[0], None)
            self._route(tickets)

    def _route(self, tickets) -> None:
        self._wakes, self._routing = {}, threading.get_ident()
        try:
            for ticket, ev in tickets:
                if ticket is not None:
                    ticket._push(ev)
        finally:
            wakes, self._wakes, self._routing = self._wakes, None, None
            here = wakes.pop(self._loop, None) if self._loop is not None and _running_loop() is self._loop else None
            if here:  # this loop's own waiters, set where they wait: no call_soon_threadsafe, no wake-up
                for ready in here:
                    ready.set()
            wake_loops(wakes)

    def _gone(self) -> None:
        """The child exited (its pipe's end of file): every open request ends (LOST unless stopping), no
        more are taken, and `on_exit` is told (else the exit is logged here)."""
        code = self._reap()  # (its end of file: it has exited, or is about to)
        with self._lock:
            unasked = not self._stopping and self._failure is None
            if self._failure is None:
                self._failure = f"the engine's process {exit_reason(code)}"
        self._ready.set()
        if unasked and self.on_exit is None:
            log.error("%s: ending every request", self._failure)
        self._end_all("cancelled" if self._stopping else LOST)
        if unasked and self.on_exit is not None:
            self.on_exit(self._failure)

    def _reap(self, timeout: float = 5.0) -> int | None:
        """The child's exit code once it has exited (within `timeout`). One thread at a time: two joining
        at once race for the exit status, and the loser reads none."""
        with self._reap_lock:
            self.process.join(timeout)
            return self.process.exitcode

    def _end_all(self, finish: str) -> None:
        with self._lock:
            left, self._tickets = list(self._tickets.values()), {}
        for t in left:
            t._push(Event(None, finish=finish))


def _running_loop():
    """The asyncio loop running in this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def send(conn, message) -> None:
    """`conn.send(message)` with the plain pickler: multiprocessing's own (ForkingPickler) copies its
    table of reducers, torch's many among them, for every message, a cost on the engine's side of
    each message between two steps (docs/benchmarks-log.md#serve). `recv()` reads either. What the two
    processes exchange (requests, events, counts) holds no tensor to share."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def packed(number: int, event: Event) -> tuple:
    """An event as it crosses the pipe: (number, token, finish) when it carries no log-probabilities
    (a step's usual events), else (number, event): a dataclass pickles its class and field names
    each time, a tuple only its values."""
    if event.logprob is None and event.prompt is None:
        return number, event.token, event.finish
    return number, event


def unpacked(item: tuple) -> Event:
    """The Event of a `packed` item."""
    return item[1] if len(item) == 2 else Event(item[1], None, item[2])


# ----------------------------------------------------------------------------- the child


def child_main(pipes, load, sizes: dict, threads: int, parent: int) -> None:
    """The child process: load, say so (the model's config and tokenizer), then run the engine until
    told to stop or the parent is gone. `pipes`: (the parent's messages, ours to it)."""
    inbox, conn = pipes
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    threading.Thread(target=_watch_parent, args=(parent,), name="glassformer-parent-watch", daemon=True).start()
    torch.set_num_threads(threads)
    try:
        loaded = load()
    except BaseException as e:  # noqa: BLE001 -- sent to the parent, which raises it as a UserError
        if not isinstance(e, UserError):
            log.exception("loading the model failed")
        conn.send(("failed", str(e) if isinstance(e, UserError) else f"loading failed: {type(e).__name__}: {e}"))
        return
    model, tok = loaded if isinstance(loaded, tuple) else (loaded, None)
    engine = ChildEngine(model, inbox, conn, **sizes)
    conn.send(("ready", model.config, tok, engine.stats, torch.get_num_threads()))
    engine.start()
    engine.serve()


def _watch_parent(parent: int) -> None:
    """Exit once the parent is gone (reparented), also while loading, when nothing reads the pipe."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


class ChildEngine(Engine):
    """The Engine of the child: requests and cancels from the pipe (`serve`), its events sent back
    after a step at most every `stream_interval` seconds, and at once when a step made a request's
    first event or its last (time to first token and the end are never held back) or when pushed
    outside a step (a queued request's cancel, a stop, a failure).

    Why not a message every step: on the demo model (a step about 1 ms) a message a step made one
    stream's answer 13-14% slower than `generate`, a message at most every 20 ms 4%, and only the
    first and the last 2% (bench/serve_overhead.py --stream-interval 0,20,1000,
    docs/benchmarks-log.md#serve): about 0.14 ms of the engine's time a message, mostly the send, which
    wakes the server's loop on the other core. A row's tokens made meanwhile go together in the
    next message, in order."""

    def __init__(self, model, inbox, conn, *, stream_interval: float = STREAM_INTERVAL, **sizes):
        super().__init__(model, **sizes)
        self.inbox, self.conn = inbox, conn
        self.stream_interval = stream_interval
        self.clock = time.monotonic  # (a test's own clock)
        self._sent_at = 0.0  # the clock at the last message
        self._urgent = False  # an event to send after this step whatever the interval: a first or a last
        self._quiet: set[int] = set()  # request numbers with no event sent yet
        self._out: list[tuple[int, Event]] = []  # (request number, event) since the last message
        self._out_lock = threading.Lock()
        self._live: dict[int, Ticket] = {}  # request number -> its ticket, until its last event
        self._taken = 0  # the last request number submitted here
        self._sent = (0, 0)  # (steps, taken) of the last message
        self._stats_at = 0.0
        self._stepping: int | None = None  # the thread inside a step

    def serve(self) -> None:
        """Read the parent's messages until "stop" or its end of file; then stop (every request cancelled)."""
        try:
            while True:
                message = self.inbox.recv()
                if message[0] == "submit":
                    self._accept(*message[1:])
                elif message[0] == "cancel":
                    ticket = self._live.get(message[1])
                    if ticket is not None:
                        ticket.cancel()
                else:
                    break
        except (EOFError, OSError):  # the parent is gone
            pass
        finally:
            self.stop()

    def step(self) -> bool:
        self._stepping = threading.get_ident()
        try:
            return super().step()
        finally:
            self._stepping = None
            if self._urgent or self.clock() - self._sent_at >= self.stream_interval:
                self._flush()

    def _accept(self, number: int, request: Request) -> None:
        """Submit one request; its events go to the pipe. Under the engine's lock, so no step admits it
        before its events are routed (a step takes queued tickets under that lock)."""
        with self._lock:
            self._taken = number
            try:
                ticket = self.submit(request)
            except UserError as e:  # the parent checked it already: only a disagreement lands here
                log.error("a request was refused in the engine's process: %s", e)
                return self._outbound(number, Event(None, finish="error"))
            self._live[number] = ticket
            self._quiet.add(number)
            early = list(ticket._events)  # pushed inside submit (nothing to compute)
            ticket._push = functools.partial(self._outbound, number)
        for ev in early:
            self._outbound(number, ev)

    def _outbound(self, number: int, event: Event) -> None:
        """A ticket's event (its _push): kept for this step's message, or sent now if pushed outside a step."""
        if number not in self._live and event.finish != "error":
            return  # ended already (a cancel racing the last token)
        with self._out_lock:
            self._out.append((number, event))
            if event.finish is not None or number in self._quiet:
                self._urgent = True
                self._quiet.discard(number)
        if event.finish is not None:
            self._live.pop(number, None)
        if self._stepping != threading.get_ident():
            self._flush()

    def _flush(self) -> None:
        """One message: the counts, the events since the last one, the stats now and then."""
        now = self.clock()
        stats = None
        if now - self._stats_at >= STATS_EVERY:
            stats, self._stats_at = self.stats, now  # (takes the engine's lock: before _out_lock, never inside)
        with self._out_lock:
            out, self._out, self._urgent = self._out, [], False
            if not out and stats is None and self._sent == (self.steps, self._taken):
                return
            self._sent, self._sent_at = (self.steps, self._taken), now
            try:
                send(self.conn, ("events", self.steps, self._taken, len(self.queue), [packed(*o) for o in out], stats))
            except (OSError, ValueError):  # the parent is gone: serve() sees the end of file
                pass
