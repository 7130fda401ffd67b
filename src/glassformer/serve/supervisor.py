"""Engine supervision: a watchdog thread beside the engine a `Backend` serves (docs/serve.md#supervision).

Dead: the engine's process exited, or the thread engine's loop thread ended, without being asked to.
The requests it held end at once (a 503 error object: retry; a stream gets an error event, then
[DONE]). The first time (`restarts`), a warning names the exit code or signal and a new engine is
started in its place (/health: 503 "restarting" while it loads). The next time the backend goes
"down" and `on_fatal(message)` is called: `glassformer serve` then exits non-zero with that line, so
that whatever runs the service (systemd's Restart=on-failure, a container's restart policy) starts it
afresh rather than keep a server that cannot serve.

Stalled: requests are held and no engine step has finished for `stall_timeout` seconds (a stopped
process, a step that hangs): /health answers 503 {"status": "stalled", ...} and new completions are
refused with 503 rather than queued behind it (a client or a load balancer can go elsewhere at once);
the requests held keep waiting and go on if the engine does. An idle engine is never stalled.

The watchdog reads the engine's counts (its steps, the requests it holds) every `poll` seconds, a
quarter of the stall timeout at most: a step that finished since the last look, or nothing held,
is progress.
"""

from __future__ import annotations

import logging
import threading
import time

from ..errors import UserError
from ..generation.batching import Event
from .worker import LOST, ProcessEngine, exit_reason

__all__ = ["Supervisor", "STALL_TIMEOUT", "RESTARTS"]

log = logging.getLogger(__name__)

STALL_TIMEOUT = 30.0  # seconds without a finished step, while requests are held, that make an engine stalled
RESTARTS = 1  # dead engines replaced over a server's life; the next death ends the server
POLL = 0.5  # seconds between the watchdog's looks at most (less for a short stall timeout)
LOAD_POLL = 0.25  # seconds between looks at a stop request while a restarted engine loads


class Supervisor:
    """Watches `backend.engine` (a ProcessEngine, or a generation.batching.Engine on a thread) from a
    thread of its own between `start()` and `stop()`: restarts it when it dies, `restarts` times,
    then calls `on_fatal(message)` (default: log it); `stall()` says whether it is stalled."""

    def __init__(self, backend, *, stall_timeout: float = STALL_TIMEOUT, restarts: int = RESTARTS, on_fatal=None):
        if not stall_timeout > 0:
            raise UserError(f"the stall timeout must be > 0 seconds, got {stall_timeout:g}")
        self.backend, self.stall_timeout, self.restarts = backend, float(stall_timeout), int(restarts)
        self.on_fatal = on_fatal
        self.poll = min(POLL, self.stall_timeout / 4)
        self.deaths = 0
        self.clock = time.monotonic  # (a test's own clock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps: int | None = None  # the engine's steps at the last look
        self._moved = self.clock()  # when the last look saw progress (a new step, or nothing held)
        self._stalled = False  # logged as stalled, not yet as stepping again

    def start(self) -> "Supervisor":
        self.backend.supervisor = self
        self._thread = threading.Thread(target=self._watch, name="glassformer-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Watch no more (before the engine is stopped, so that its asked-for exit is no death)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def stall(self) -> dict | None:
        """While stalled: {"stalled_s": seconds since the last step, "requests": held, "stall_timeout_s"}."""
        steps, held = progress(self.backend.engine)
        idle = self.clock() - self._moved
        if not held or steps != self._steps or idle < self.stall_timeout:
            return None
        return {"stalled_s": round(idle, 1), "requests": held, "stall_timeout_s": self.stall_timeout}

    # ---- the watchdog's thread ---------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            engine = self.backend.engine
            how = self._exit_of(engine)
            if how is None:
                self._look(engine)
            elif not self._dead(engine, how):
                return

    def _exit_of(self, engine) -> str | None:
        """How the engine died ("'s process was killed by signal 9 (SIGKILL)"), waiting `poll` s at most;
        None while it runs, or when it was asked to stop."""
        if isinstance(engine, ProcessEngine):
            code = engine.wait_exit(self.poll)
            if code is None and not engine.alive:  # stopped, or buried: wait_exit answered at once
                self._stop.wait(self.poll)
            return None if code is None else "'s process " + exit_reason(code)
        thread = engine._thread  # (batching.Engine's loop thread: it ends only by stop() or a BaseException)
        if thread is None:
            self._stop.wait(self.poll)
            return None
        thread.join(self.poll)
        return None if thread.is_alive() or engine._stopping else "'s thread ended"

    def _look(self, engine) -> None:
        """Note progress (a new step, or nothing held); log a stall's start and its end."""
        steps, held = progress(engine)
        if steps != self._steps or not held:
            self._steps, self._moved = steps, self.clock()
            if self._stalled:
                self._stalled = False
                log.warning("the engine is stepping again")
        elif not self._stalled and self.stall() is not None:
            self._stalled = True
            log.warning("the engine has finished no step for %.0f s with %d requests in hand: stalled "
                        "(/health answers 503 until it steps again)", self.stall_timeout, held)

    def _dead(self, engine, how: str) -> bool:
        """End a dead engine's requests and put a new one in its place; False once the server must end."""
        self.deaths += 1
        bury(engine)
        if self.deaths > self.restarts:
            return self._fatal(f"the engine{how} again after its restart: the server exits so that what runs "
                               f"it can start it afresh")
        log.warning("the engine%s: restarting it (once; if it dies again the server exits)", how)
        if self.backend.status == "ok":
            self.backend.status = "restarting"
        try:
            new = self._revived(engine)
        except (UserError, TimeoutError) as e:
            return self._fatal(f"the engine{how} and could not be restarted: {e}")
        if new is None:  # stopped meanwhile
            return False
        self._steps, self._moved = None, self.clock()
        self.backend.serve_with(new)
        log.warning("the engine is serving again")
        return True

    def _revived(self, engine):
        """A new process engine, loaded (None if stopped meanwhile); the thread engine on a new thread."""
        if not isinstance(engine, ProcessEngine):
            engine._thread = None  # (the dead one: start() starts another)
            return engine.start()
        new = engine.successor()
        while True:
            try:
                return new.wait_ready(LOAD_POLL)
            except TimeoutError:
                if self._stop.is_set():
                    new.stop()
                    return None
            except BaseException:
                new.stop()
                raise

    def _fatal(self, message: str) -> bool:
        if self.backend.status != "stopping":
            self.backend.status = "down"
        if self.on_fatal is None:
            log.error("%s", message)
        else:
            self.on_fatal(message)
        return False


def progress(engine) -> tuple[int, int]:
    """(steps finished, requests held: queued or running) of either kind of engine."""
    if isinstance(engine, ProcessEngine):
        return engine.steps, engine.held
    return engine.steps, len(engine.queue) + sum(r is not None for r in engine.rows)


def bury(engine) -> None:
    """End every request a dead engine held (finish LOST: the client is told to retry)."""
    if isinstance(engine, ProcessEngine):
        engine.bury()
        return
    with engine._lock:  # (batching.Engine's own state: its thread is gone, nothing steps meanwhile)
        held = list(engine.queue) + [r.ticket for r in engine.rows if r is not None]
        engine.queue.clear()
        engine.rows, engine.n_dec = [None] * engine.max_batch, 0
        engine._cancels.clear()
    for ticket in held:
        ticket._push(Event(None, finish=LOST))
