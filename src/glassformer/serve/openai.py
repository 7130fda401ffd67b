"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
GET /health, POST /tokenize and POST /detokenize (vLLM's shapes), added to an app from serve.http.

A request is parsed strictly (schemas), turned into token ids (backend: the chat template for
messages), checked against the context, and submitted to the continuous-batching engine; its
events become text through replies.Reply and go back whole or as server-sent events (sse). Every
error is OpenAI's error object; no prompt text is ever logged. docs/serve.md.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from . import backend as prompts
from . import results, schemas, sse
from .backend import DEFAULT_COMPLETION_TOKENS, Backend, openai_error
from .http import json_response
from .json_only import is_json, not_json
from .replies import Reply, engine_request, merged, submit
from .schemas import ApiError, bad

__all__ = ["Backend", "add_routes", "openai_error"]


def add_routes(app: FastAPI, backend: Backend) -> FastAPI:
    """The routes, their error handler and the lifespan hook (status 'stopping') on `app`."""
    app.include_router(_router(backend))
    app.add_exception_handler(ApiError, _api_error)
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        backend.status = "stopping"

    app.router.lifespan_context = lifespan
    return app


async def _api_error(request: Request, exc: ApiError) -> Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return json_response(exc.status, exc.body(), headers)


def _router(backend: Backend) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health():  # open without a key: what a load balancer or a service manager polls
        return json_response(*backend.health())

    @r.get("/v1/models")
    async def models():
        backend.check(None)
        return json_response(200, {"object": "list", "data": [_model_card(backend)]})

    @r.get("/v1/models/{name:path}")
    async def model(name: str):
        backend.check(name)
        return json_response(200, _model_card(backend))

    @r.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(request, backend)

    @r.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(request, backend)

    @r.post("/tokenize")
    async def tokenize(request: Request):
        req = schemas.parse(schemas.TokenizeRequest, await _json_body(request))
        backend.check(req.model)
        ids = await run_in_threadpool(prompts.tokenize, backend, req)
        return json_response(200, {"count": len(ids), "max_model_len": backend.max_model_len, "tokens": ids})

    @r.post("/detokenize")
    async def detokenize(request: Request):
        req = schemas.parse(schemas.DetokenizeRequest, await _json_body(request))
        backend.check(req.model)
        prompts.check_ids(backend, req.tokens, "tokens")
        return json_response(200, {"prompt": backend.tokenizer.decode(req.tokens)})

    return r


def _model_card(backend: Backend) -> dict:
    return {"id": backend.model_id, "object": "model", "created": backend.created, "owned_by": "glassformer",
            "max_model_len": backend.max_model_len}


async def _parsed(request: Request, kind, backend: Backend):
    """The body as `kind`, with the server ready, the model known and the default-only fields at their defaults."""
    if backend.status != "ok":
        backend.check(None)
    req = schemas.parse(kind, await _json_body(request))
    backend.check(req.model)
    schemas.check_defaults(req)
    if req.steer is not None and not getattr(backend, "steered", False):  # (set by `serve --steer`)
        raise schemas.bad("steer: this server steers with no vector (start it with --steer VEC), so there is none "
                          "to scale", "steer")
    backend.check_engine()  # not queued behind a stalled engine: docs/serve.md#supervision
    return req


async def _json_body(request: Request) -> bytes:
    """The body of a POST that says it is JSON (415 otherwise: serve/json_only.py says why)."""
    content_type = request.headers.get("content-type")
    if not is_json(content_type):
        raise ApiError(415, not_json(content_type))
    return await request.body()


# ----------------------------------------------------------------------------- /v1/completions


async def _completions(request: Request, backend: Backend):
    req = await _parsed(request, schemas.CompletionRequest, backend)
    stops = schemas.stops_of(req)
    rows = await _encoded(prompts.completion_prompts, backend, req.prompt)
    n = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
    k = req.logprobs
    scored = k if req.echo and k is not None else None
    replies = submit(backend, [engine_request(backend, ids, n, req, k, scored) for ids in rows], stops)
    shape = _CompletionShape(backend, req, rows)
    if req.stream:
        return _Stream(shape.chunks(replies), replies)
    done = await _unless_gone(request, asyncio.gather(*(r.collect() for r in replies)))
    if done is None:
        return Response(status_code=204)  # nobody is there to read it
    choices = [shape.choice(i, reply, text, entries) for i, (reply, (text, entries)) in enumerate(zip(replies, done))]
    return json_response(200, {**results.envelope(shape.rid, "text_completion", backend.model_id),
                               "choices": choices, "usage": shape.usage(replies)})


INLINE_CHARS = 4096  # a prompt with at most this much text is encoded on the event loop


def _text_size(prompt) -> int:
    """Characters of text in a completions prompt (ids count none)."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


async def _encoded(encode, backend: Backend, prompt):
    """encode(backend, prompt) on the event loop when the prompt is ids or a short text, else on a worker
    thread so a long text never stalls the streams. The hand-over to a thread and back costs more
    server CPU than encoding a short prompt: docs/benchmarks-log.md#serve."""
    if _text_size(prompt) <= INLINE_CHARS:
        return encode(backend, prompt)
    return await run_in_threadpool(encode, backend, prompt)


class _CompletionShape:
    """How a completions request's replies are written: text (the prompt first with echo) and logprobs."""

    def __init__(self, backend: Backend, req, rows: list[list[int]]):
        self.backend, self.req, self.rows = backend, req, rows
        self.tok, self.k = backend.tokenizer, req.logprobs
        self.rid = results.new_id("cmpl")

    def head(self, i: int, reply: Reply) -> tuple[str, results.CompletionLogprobs | None]:
        """The echoed prompt's text and a logprobs builder started with the prompt's scores."""
        echo = self.tok.decode(self.rows[i]) if self.req.echo else ""
        if self.k is None:
            return echo, None
        lp = results.CompletionLogprobs(self.tok)
        if self.req.echo:
            lp.add_prompt(self.rows[i], reply.prompt or [])
        return echo, lp

    def choice(self, i: int, reply: Reply, text: str, entries: list) -> dict:
        echo, lp = self.head(i, reply)
        for e in entries:
            lp.add(e.id, e.logprob, e.top)
        return {"index": i, "text": echo + text, "logprobs": None if lp is None else lp.take(),
                "finish_reason": reply.finish}

    def usage(self, replies: list[Reply]) -> dict:
        return results.usage(sum(len(r) for r in self.rows), sum(r.tokens for r in replies))

    async def chunks(self, replies: list[Reply]):
        head = results.envelope(self.rid, "text_completion", self.backend.model_id)
        extra = {"usage": None} if _include_usage(self.req) else {}
        started: dict[int, results.CompletionLogprobs | None] = {}
        async for i, piece in merged(replies):
            text = piece.text
            if i not in started:
                echo, started[i] = self.head(i, replies[i])
                text = echo + text
            lp = started[i]
            for e in piece.logprobs:
                lp.add(e.id, e.logprob, e.top)
            logprobs = None if lp is None else lp.take()
            if text or piece.finish or (logprobs and logprobs["tokens"]):
                yield {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                            "finish_reason": piece.finish}], **extra}
        if extra:
            yield {**head, "choices": [], "usage": self.usage(replies)}


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ----------------------------------------------------------------------------- /v1/chat/completions


def _chat_limits(req, prompt_len: int, S: int) -> tuple[int, int | None]:
    """(max new tokens, top logprobs k or None) of a chat request."""
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad("max_tokens and max_completion_tokens differ: give one of them", "max_completion_tokens")
    n = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    return (max(S - prompt_len, 1) if n is None else n), k


async def _chat(request: Request, backend: Backend):
    req = await _parsed(request, schemas.ChatRequest, backend)
    stops = schemas.stops_of(req)
    ids = await run_in_threadpool(prompts.chat_ids, backend, req.messages)
    n, k = _chat_limits(req, len(ids), backend.max_model_len)
    (reply,) = submit(backend, [engine_request(backend, ids, n, req, k)], stops)
    rid, tok = results.new_id("chatcmpl"), backend.tokenizer
    if req.stream:
        return _Stream(_chat_chunks(backend, rid, reply, k, _include_usage(req)), [reply])
    done = await _unless_gone(request, reply.collect())
    if done is None:
        return Response(status_code=204)
    text, entries = done
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None if k is None else {"content": results.chat_logprobs(tok, entries)},
              "finish_reason": reply.finish}
    return json_response(200, {**results.envelope(rid, "chat.completion", backend.model_id), "choices": [choice],
                               "usage": results.usage(reply.prompt_tokens, reply.tokens)})


async def _chat_chunks(backend: Backend, rid: str, reply: Reply, k: int | None, include_usage: bool):
    head = results.envelope(rid, "chat.completion.chunk", backend.model_id)
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, logprobs=None, finish=None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                **extra}

    yield chunk({"role": "assistant", "content": ""})
    async for piece in reply.pieces():
        if piece.text or (k is not None and piece.logprobs):
            lp = None if k is None else {"content": results.chat_logprobs(backend.tokenizer, piece.logprobs)}
            yield chunk({"content": piece.text}, lp)
        if piece.finish is not None:
            yield chunk({}, None, piece.finish)
    if include_usage:
        yield {**head, "choices": [], "usage": results.usage(reply.prompt_tokens, reply.tokens)}


# ----------------------------------------------------------------------------- answering


async def _unless_gone(request: Request, work):
    """Await `work` unless the client disconnects first (then cancel it, which frees its rows: None)."""
    job = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not job.done():
            job.cancel()
            job.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen: asyncio logs none
    return job.result() if job.done() and not job.cancelled() else None


class _Stream(StreamingResponse):
    """Server-sent events that cancel their replies' tickets however the answer ends, also when
    the client left before the first chunk (then the chunks' generator never ran its own cleanup)."""

    def __init__(self, chunks, replies: list[Reply]):
        more = lambda: any(r.ticket.pending for r in replies)  # noqa: E731
        super().__init__(sse.events(chunks, _stream_error, more), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        self.replies = replies

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for reply in self.replies:
                reply.close()


def _stream_error(e: Exception) -> dict:
    if isinstance(e, ApiError):
        return e.body()
    return openai_error(500, f"internal error: {type(e).__name__}")
