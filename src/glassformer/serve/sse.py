"""Server-sent events in OpenAI's streaming format: one `data: {json}` event per chunk, a blank
line after each, and `data: [DONE]` last (https://html.spec.whatwg.org/multipage/server-sent-events.html).
An error after the stream has begun (the status line is already sent) goes as one event holding
OpenAI's error object, then [DONE], which is what the openai client raises from.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

DONE = b"data: [DONE]\n\n"
HEADERS = {"X-Accel-Buffering": "no"}  # no proxy may hold the chunks back (serve.http adds no-store)
MEDIA_TYPE = "text/event-stream"


def event(obj: dict) -> bytes:
    """One chunk as an event; the JSON holds no newline, so one `data:` line carries it.

    >>> event({"a": 1})
    b'data: {"a":1}\\n\\n'
    """
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


async def events(chunks: AsyncIterator[dict], on_error, more=None) -> AsyncIterator[bytes]:
    """The chunks as events, then [DONE]; an exception becomes the error event `on_error(exc)` gives.

    `more()` says whether the next chunk is ready without waiting (its tokens have come): while it
    is, events are gathered and written together, so the tokens that came in one message of the
    engine go out in one write, not one each (docs/serve.md#streaming)."""
    held: list[bytes] = []
    try:
        async for chunk in chunks:
            held.append(event(chunk))
            if more is None or not more():
                yield b"".join(held)
                held = []
    except Exception as e:  # noqa: BLE001 -- the client gets an error object, never a traceback
        held.append(event(on_error(e)))
    held.append(DONE)
    yield b"".join(held)
