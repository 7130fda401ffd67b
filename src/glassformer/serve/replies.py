"""An engine ticket's events as pieces of text to send: stop strings held back and cut (through
generation.streaming.TextStream, byte-exact UTF-8 as the command line streams), end-of-turn tokens
counted but never shown, and the row freed the moment the reply is over or its reader goes away.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..errors import UserError
from ..generation import batching
from ..generation.streaming import TextStream
from .schemas import sampling_of
from .backend import check_context
from .results import KnownIds
from .schemas import ApiError, bad
from .worker import LOST


# The ends of a request that the engine chose, not the model: the status and message the client gets.
ENGINE_ENDS = {"error": (500, "the model failed on this step"), "cancelled": (503, "the server is stopping"),
               LOST: (503, "the engine died while running this request (the server restarts it): retry shortly")}


@dataclass
class Piece:
    """Text that became sendable, the TokenLogprobs of the tokens read since the last piece, and
    on the last piece the finish reason ('stop' or 'length')."""

    text: str
    logprobs: list = field(default_factory=list)
    finish: str | None = None


class Reply:
    """Reads one ticket. `pieces()` yields Pieces; afterwards `tokens` is how many tokens the model
    made (an end-of-turn token included), `prompt` the prompt's TokenLogprobs when they were asked."""

    def __init__(self, ticket, tokenizer, stops=(), eos=()):
        self.ticket, self.eos = ticket, set(eos)
        self.stream = TextStream(KnownIds(tokenizer) if hasattr(tokenizer, "id_to_bytes") else tokenizer, stops)
        self.tokens, self.finish, self.prompt = 0, None, None
        self.ids: list[int] = []

    @property
    def prompt_tokens(self) -> int:
        return int(self.ticket.prompt_tokens)

    def _take(self, ev) -> str:
        """One event: its token's text ('' while held back); sets finish when the reply is over."""
        if ev.prompt is not None:
            self.prompt = ev.prompt
        text = ""
        if ev.token is not None:
            self.tokens += 1
            if ev.token in self.eos:
                self.finish = "stop"  # the end-of-turn token: counted in usage, never shown
                return ""
            self.ids.append(ev.token)
            text = self.stream.push(ev.token)
            if self.stream.done:  # a stop string came: cut there, free the row now
                self.finish = "stop"
                self.ticket.cancel()
                return text
        if ev.finish in ENGINE_ENDS and self.finish is None:  # not by us: the engine failed, died or stops
            self.finish = ev.finish
            raise ApiError(*ENGINE_ENDS[ev.finish], type="server_error")
        if ev.finish is not None and self.finish is None:
            self.finish = ev.finish  # 'stop' (an end-of-turn id) or 'length'
        return text

    async def pieces(self) -> AsyncIterator[Piece]:
        pending, text = [], ""
        events = self.ticket.aevents()
        try:
            async for ev in events:
                text = self._take(ev)
                if ev.logprob is not None and ev.token not in self.eos:
                    pending.append(ev.logprob)
                if self.finish is not None:
                    break
                if text:
                    yield Piece(text, pending)
                    pending, text = [], ""
            if self.finish is None:  # the events ended without a reason: the engine was stopped
                self.finish = "length"
            yield Piece(text + self.stream.flush(), pending, self.finish)
        finally:
            if self.finish is None:  # the reader went away (a client disconnected): free the row
                self.ticket.cancel()
            await events.aclose()

    def close(self) -> None:
        """Free the row if the reply is not over (its reader never came, or left)."""
        if self.finish is None:
            self.ticket.cancel()

    async def collect(self) -> tuple[str, list]:
        """The whole reply's text and TokenLogprobs (finish, tokens, prompt set as after pieces())."""
        texts, entries = [], []
        async for piece in self.pieces():
            texts.append(piece.text)
            entries.extend(piece.logprobs)
        return "".join(texts), entries


# ----------------------------------------------------------------------------- submitting


def engine_request(backend, ids: list[int], max_tokens: int, req, logprobs=None, prompt_logprobs=None):
    check_context(backend, ids, max_tokens)
    return batching.Request(ids, max_tokens, stop_ids=backend.eos, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, **sampling_of(req))


@contextmanager
def engine_errors():
    """The engine's refusals as the client's errors."""
    try:
        yield
    except batching.QueueFull:
        raise ApiError(429, "the server's queue is full; retry shortly", type="rate_limit_error") from None
    except batching.EngineStopped as e:
        raise ApiError(503, str(e), type="server_error") from None
    except batching.ContextLengthExceeded as e:
        raise bad(str(e), "max_tokens", "context_length_exceeded") from None
    except UserError as e:
        raise bad(str(e)) from None


def submit(backend, requests: list, stops: list[str]) -> list[Reply]:
    """Submit every request or none (a refusal cancels those already queued)."""
    tickets = []
    try:
        with engine_errors():
            for r in requests:
                tickets.append(backend.engine.submit(r))
    except BaseException:
        for t in tickets:
            t.cancel()
        raise
    return [Reply(t, backend.tokenizer, stops, backend.eos) for t in tickets]


async def merged(replies: list[Reply]):
    """(index, Piece) of every reply as they come; closing this cancels the replies still running."""
    if len(replies) == 1:
        async for piece in replies[0].pieces():
            yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, reply: Reply):
        try:
            async for piece in reply.pieces():
                queue.put_nowait((i, piece))
            queue.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 -- handed to the reader, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(replies)]
    try:
        left = len(tasks)
        while left:
            i, piece = await queue.get()
            if isinstance(piece, Exception):
                raise piece
            if piece is None:
                left -= 1
            else:
                yield i, piece
    finally:
        for t in tasks:
            t.cancel()
