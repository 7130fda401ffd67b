"""A request's model work stops when its client leaves (docs/viewer.md#limits).

The server runs each request's work in a worker thread under `watching(left)`, `left` an Event it
sets when the client disconnects. The work itself calls `check()` where stopping is safe and cheap:
when it gets the model's turn (work whose client left while it waited never starts) and between
the steps of a generation (a long one stops at the next token). The Event travels in a context
variable, not through every signature between the route and the decode loop.

    >>> left = threading.Event()
    >>> with watching(left):
    ...     check()          # the client is still there: nothing happens
    ...     left.set()
    ...     try:
    ...         check()
    ...     except ClientLeft as e:
    ...         print(e)
    the client left before its answer was ready
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_LEFT: ContextVar[threading.Event | None] = ContextVar("glassformer_client_left", default=None)


class ClientLeft(Exception):
    """The client of this work disconnected: nobody will read its answer, so it stops."""

    def __init__(self):
        super().__init__("the client left before its answer was ready")


@contextmanager
def watching(left: threading.Event) -> Iterator[None]:
    """Run the block as the work of a client whose leaving sets `left`."""
    token = _LEFT.set(left)
    try:
        yield
    finally:
        _LEFT.reset(token)


def check() -> None:
    """Raise ClientLeft if the client of the work running here has left (outside `watching`: never)."""
    left = _LEFT.get()
    if left is not None and left.is_set():
        raise ClientLeft()
