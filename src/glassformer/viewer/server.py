"""`glassformer view`: the explorer's routes, served on the HTTP base of serve/http.py.

It serves GET / (the page), GET /static/NAME (its own CSS and JavaScript, a fixed list),
POST /api/trace, POST /api/explain, POST /api/sample, POST /api/generate, POST /api/patch and
POST /api/attribute (docs/research.md#in-the-explorer), with `view --run` GET /api/run
and POST /api/update (docs/viewer.md#the-servers-endpoints), nothing else.
Loopback by default, size limits (413, 411), 404 for any other path, loopback Host names only,
JSON with nosniff: docs/viewer.md#safety. `explorer_router` puts the same routes on another
app (`glassformer serve --explorer`); `make_server` is `glassformer view`'s own server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import APIRouter, FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from ..errors import UserError
from ..generation.sampling import NonFiniteLogits
from ..serve.http import Limits, Server, json_bytes, make_app, plain_error
from ..serve.json_only import is_json, not_json
from .cancel import ClientLeft, check as check_cancelled, watching
from .generated import MAX_TOKENS
from .render import STYLES, VIEW_SCRIPTS, _finite, build_payload, render_html, static_file, to_plain
from .heads import kv_name, parse_kv
from .training import NotFound

MAX_BODY = 64 * 1024  # bytes of one request body
MAX_TEXT = 2000  # characters of one sentence
LIMITS = Limits(max_body=MAX_BODY)  # the base's deadlines; the explorer's body limit
STATIC_FILES = {**{name: "text/css; charset=utf-8" for name in STYLES}, **{name: "text/javascript; charset=utf-8" for name in VIEW_SCRIPTS}}
MAX_QUEUED = 16  # requests waiting for or holding the model's turn; one more is answered 503


class TooLarge(Exception):
    """A request over a size limit (answered with 413)."""


class WorkQueue:
    """The explorer's model work, counted: `queued` requests wait for or hold the model's turn, and
    `abandoned` is how many clients left before their answer (counted when the server sees them go,
    while their work may still wait or run). Past a cap a request is refused at once (503 with
    Retry-After) instead of waiting behind work nobody may read any more. One per Explorer (the model
    is what is scarce); a lock guards the counts because one Explorer may be mounted on apps that run
    on different event loops."""

    def __init__(self):
        self.queued = 0
        self.abandoned = 0
        self._counts = threading.Lock()

    async def run(self, request: Request, cap: int, fn, *args):
        """fn(*args) in the thread pool as `request`'s work. When its client disconnects the work is
        cancelled (viewer/cancel.py): not started if it still waits, stopped at its next check if it
        runs; ClientLeft is then raised here."""
        with self._counts:
            if self.queued >= cap:
                raise _HTTPError(503, f"the explorer is busy with {cap} requests; retry in a moment",
                                 {"Retry-After": "1"})
            self.queued += 1
        left = threading.Event()
        watcher = asyncio.ensure_future(self._until_disconnect(request, left))
        try:
            return await run_in_threadpool(_work_of, left, fn, *args)
        finally:
            watcher.cancel()
            with self._counts:
                self.queued -= 1

    async def _until_disconnect(self, request: Request, left: threading.Event) -> None:
        """Set `left` when the client disconnects. The body is read by now, so the server's next message
        is the disconnect (reading on is also what lets the server see the connection close)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left.set()
        with self._counts:
            self.abandoned += 1


def _work_of(left: threading.Event, fn, *args):
    """fn(*args) as the work of a client whose leaving sets `left` (in a worker thread)."""
    with watching(left):
        check_cancelled()  # the client left while the work waited for a thread: it never starts
        return fn(*args)


@dataclass
class Explorer:
    """What the server computes with: turn text into ids, trace them, explain a number.

    encode(text) -> (ids, tokens), raising UserError for text the model cannot read.
    trace(ids, tokens) -> a Trace or its dict form. explain(trace, probe, index) -> one number's
    calculation (optional). as_dict(trace, digits) -> the dict form (optional).
    extras(ids, tokens, trace_dict, trace) -> more build_payload arguments: norm, costs, ... (optional).
    sampler(ids, settings) -> the sampling view of the token after ids (optional; source.Sampler).
    text_extras(text) -> more build_payload arguments from the sentence itself: the tokenizer view (optional).
    run: a training.RunCheckpoints (`view --run`): a request may name one of its checkpoints, answered
    by that checkpoint's own Explorer (so its own cache); checkpoint: the name of the one this traces.
    additions(ids) -> more keys of the payload (optional; the run view's logit lens).
    generator(text, ids, tokens, max_tokens, settings) -> (ids, tokens, generated part, text): the text
    continued by `generate` and the generated-text view's data (optional; source.generation).
    research(kind, request) -> the answer to POST /api/patch (kind 'patch') or /api/attribute ('attribute')
    (optional; research.reports.research_answer).
    heads(k) -> the Explorer of the model with k key/value heads, averaged (viewer/heads.py; optional: the
    page's head switch); a request names it as its checkpoint "kv_heads=K". heads_info: what the switch shows.
    """

    encode: Callable[[str], tuple[list[int], list[str]]]
    trace: Callable[[list[int], list[str]], dict]
    default_text: str
    explain: Callable[[Any, str, list[int]], Any] | None = None
    as_dict: Callable[[Any, int], dict] | None = None
    extras: Callable[[list[int], list[str], dict, Any], dict] | None = None
    payload_args: dict = field(default_factory=dict)
    sampler: Callable[[list[int], dict], dict] | None = None
    text_extras: Callable[[str], dict] | None = None
    run: Any = None
    checkpoint: str | None = None
    additions: Callable[[list[int]], dict] | None = None
    generator: Callable[[str, list[int], list[str], int, dict], tuple] | None = None
    research: Callable[[str, dict], dict] | None = None
    heads: Callable[[int], "Explorer"] | None = None
    features_page: str | None = None  # the SAE feature browser (`view --sae`), served at GET /features
    heads_info: dict | None = None
    cache_size: int = 8
    digits: int = 6  # decimals (or significant digits, as as_dict reads it) of the numbers sent
    max_queued: int = MAX_QUEUED  # requests waiting for or holding the model's turn (503 past it)
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _work: WorkQueue = field(default_factory=WorkQueue, repr=False)

    def __post_init__(self):
        if not (isinstance(self.max_queued, int) and not isinstance(self.max_queued, bool) and self.max_queued >= 1):
            raise UserError(f"max_queued must be an integer of at least 1, got {self.max_queued!r}")

    @property
    def work(self) -> WorkQueue:
        """The requests queued for this explorer's model, counted (the server's cap and cancellation)."""
        return self._work

    @contextmanager
    def _turn(self):
        """The model's turn for one request's work (the lock below). Given up at once, the work never
        started, when the request's client left while it waited (viewer/cancel.py)."""
        with self._lock:
            check_cancelled()
            yield

    def _traced(self, text: str) -> tuple[dict, dict]:
        """(trace, payload) for `text`, computed once and kept for the next few requests."""
        if len(text) > MAX_TEXT:
            raise TooLarge(f"the sentence has {len(text)} characters; the limit is {MAX_TEXT}")
        # One model, one probe recorder: computations take turns (the recorder is global).
        with self._turn():
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
            ids, tokens = self.encode(text)
            if not ids:
                raise UserError("the sentence is empty: type a few words")
            return self._keep(text, self._built(ids, tokens, text))

    def _built(self, ids: list[int], tokens: list[str], text: str) -> tuple[Any, dict]:
        """(trace, payload) of these ids, `text` their sentence (the caller holds the lock)."""
        check_cancelled()  # after a generation: its client may have left meanwhile
        tr = self.trace(ids, tokens)
        shown = self.as_dict(tr, self.digits) if self.as_dict else tr
        args = dict(self.payload_args)
        if self.extras is not None:
            args.update(self.extras(ids, tokens, shown, tr))
        if self.text_extras is not None:
            args.update(self.text_extras(text))
        # The live page asks the server for calculations, so it needs only what it draws.
        return tr, self._marked(build_payload(shown, mode="server", sentence=text, slim=True, **args), ids)

    def _keep(self, text: str, hit: tuple[Any, dict]) -> tuple[Any, dict]:
        """Keep (trace, payload) of `text` for the next few requests (the caller holds the lock)."""
        self._cache[text] = hit
        self._cache.move_to_end(text)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return hit

    def _marked(self, payload: dict, ids: list[int]) -> dict:
        """The payload with the run view's keys: the run and checkpoint it shows, the additions."""
        if self.run is not None:  # the page's Training view shows which checkpoint this is
            payload.update(run=self.run.name, checkpoint=self.checkpoint)
        elif self.checkpoint is not None:  # "kv_heads=K": the page's next requests name the same model
            payload["checkpoint"] = self.checkpoint
        if self.heads_info is not None:
            payload["heads"] = self.heads_info
        if self.additions is not None:
            payload.update(self.additions(ids))
        return payload

    @property
    def lock(self) -> threading.Lock:
        """What the model's computations take turns on: a trace sets the model's mode and attention
        kernel for its forward (probes record per thread, but those settings are the model's), so
        anything else that runs the same model in this process (serve --explorer's engine) holds it too."""
        return self._lock

    def at(self, checkpoint: str | None) -> "Explorer":
        """The Explorer of the run's checkpoint named `checkpoint` (None, or this one's name: self)."""
        if checkpoint is None or checkpoint == self.checkpoint:
            return self
        k = parse_kv(checkpoint)
        if k is not None:  # the head switch: the model with k averaged key/value heads
            if self.heads is None:
                raise UserError("this explorer has no head switch: open the model with --checkpoint or --worked")
            ex = self.heads(k)
            if ex is not self:
                ex._lock, ex.checkpoint = self._lock, kv_name(k)  # one probe recorder: one lock
            return ex
        if self.run is None:
            raise UserError("this explorer was opened without --run: there are no checkpoints to choose from")
        return self.run.explorer(checkpoint)

    def payload(self, text: str, checkpoint: str | None = None) -> dict:
        if checkpoint is not None:
            return self.at(checkpoint).payload(text)
        return self._traced(text)[1]

    def calculation(self, text: str, probe: str, index: list[int], checkpoint: str | None = None) -> Any:
        if checkpoint is not None:
            return self.at(checkpoint).calculation(text, probe, index)
        if self.explain is None:
            raise UserError("this server has no calculations to show")
        tr, _ = self._traced(text)
        with self._turn():
            return to_plain(self.explain(tr, probe, index))


    def training(self) -> dict:
        """The Training view's data (training.RunCheckpoints.payload)."""
        if self.run is None:
            raise NotFound("this explorer was opened without --run: `glassformer view --run RUN` shows a training run")
        return self.run.payload()

    def update(self, step: int, param: str, index: list[int]) -> dict:
        """One optimizer update of param[index] explained (explaining.optimizer.explain_update): the
        update that follows the run's checkpoint at `step`."""
        if self.run is None:
            raise NotFound("this explorer was opened without --run: there is no training run to explain")
        try:
            from ..explaining.optimizer import explain_update
        except ImportError:
            raise UserError("this glassformer cannot explain optimizer updates yet "
                            "(glassformer.explaining.optimizer.explain_update)") from None
        with self._turn():
            answer = explain_update(self.run.run, step, param, index).to_dict()
            return to_plain({k: v for k, v in answer.items() if k not in UPDATE_TENSORS})

    def sample(self, text: str, position: int, settings: dict, checkpoint: str | None = None) -> dict:
        """The sampling view of the token after `position` of `text` (sampling_stages' answer)."""
        if checkpoint is not None:
            return self.at(checkpoint).sample(text, position, settings)
        if self.sampler is None:
            raise UserError("this server has no sampling view")
        if len(text) > MAX_TEXT:
            raise TooLarge(f"the sentence has {len(text)} characters; the limit is {MAX_TEXT}")
        with self._turn():
            ids, _ = self.encode(text)
            if not 0 <= position < len(ids):
                raise UserError(f"position must be a token index in 0..{len(ids) - 1}, got {position}")
            return self.sampler(ids[:position + 1], settings)

    def generation(self, text: str, max_tokens: int | None, settings: dict, checkpoint: str | None = None) -> dict:
        """The page's payload for `text` continued by `generate` (up to max_tokens new tokens with
        these settings; None: GENERATE_TOKENS, or the room left in the context), its `generated` part
        the generated-text view's data."""
        if checkpoint is not None:
            return self.at(checkpoint).generation(text, max_tokens, settings)
        if self.generator is None:
            raise UserError("this server cannot generate")
        if len(text) > MAX_TEXT:
            raise TooLarge(f"the sentence has {len(text)} characters; the limit is {MAX_TEXT}")
        with self._turn():
            ids, tokens = self.encode(text)
            if not ids:
                raise UserError("the sentence is empty: type a few words")
            ids, tokens, part, full = self.generator(text, ids, tokens, max_tokens, settings)
            hit = self._built(ids, tokens, full)
            if part.get("roundtrip"):  # the other views re-read the text: the same ids, the same trace
                self._keep(full, hit)
        return {**hit[1], "generated": part}

    def researched(self, kind: str, req: dict) -> dict:
        """A patching sweep (kind 'patch') or a direct logit attribution ('attribute') of the request's
        texts: what `glassformer patch --json` / `attribute --json` print (research.reports)."""
        if self.research is None:
            raise UserError("this server has no model to patch or attribute")
        with self._turn():
            return to_plain(self.research(kind, req))


UPDATE_TENSORS = ("grad", "clipped", "new_param")  # explain_update's whole tensors (for tests): not sent


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def _send(status: int, body: bytes, ctype: str, extra: dict | None = None) -> Response:
    return Response(body, status_code=status, media_type=ctype, headers=extra)


def _json(status: int, obj: Any, headers: dict | None = None) -> Response:
    try:
        body = json_bytes(obj)
    except ValueError:  # a NaN somewhere: JSON has no spelling for it
        body = json_bytes(_finite(obj))
    # The unread rest of a refused body must not be taken for a next request: close after it.
    extra = {"Connection": "close"} if status in (411, 413) else None
    if headers:
        extra = {**(extra or {}), **headers}
    return _send(status, body, "application/json; charset=utf-8", extra)


def _error_for(e: Exception) -> Response:
    """The answer to the user's mistakes (400, 411, 413, 415), a full queue (503), a client that
    left (an empty 204 nobody reads) or a model whose logits are not finite (500, saying so). Anything
    else is a bug: raised on, for the HTTP base to answer 500 and log where it happened."""
    if isinstance(e, _HTTPError):
        return _json(e.status, {"error": e.message}, e.headers)
    if isinstance(e, ClientLeft):
        return Response(status_code=204)
    if isinstance(e, TooLarge):
        return _json(413, {"error": str(e)})
    if isinstance(e, NotFound):
        return _json(404, {"error": str(e)})
    if isinstance(e, NonFiniteLogits):  # the model's NaN, not the request's fault: said, as a 500
        return _json(500, {"error": str(e)})
    if isinstance(e, (UserError, ValueError, KeyError, IndexError)):
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _json(400, {"error": msg})
    raise e


async def _read_json(request: Request) -> dict:
    """The request's JSON object: a length is required (411) and at most MAX_BODY (413), and the body
    must say it is JSON (415: a text/plain or form POST needs no CORS preflight, so any page the
    user visits could send one; an application/json one it cannot)."""
    length = request.headers.get("content-length")
    if length is None:
        raise _HTTPError(411, "a Content-Length header is required")
    if not length.isdigit():
        raise _HTTPError(400, "bad Content-Length")
    if int(length) > MAX_BODY:  # refused before any of it is read
        raise _HTTPError(413, f"request body over {MAX_BODY} bytes")
    if not is_json(request.headers.get("content-type")):
        raise _HTTPError(415, not_json(request.headers.get("content-type")))
    try:
        obj = json.loads((await request.body()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _HTTPError(400, "the body must be JSON") from None
    if not isinstance(obj, dict):
        raise _HTTPError(400, "the body must be a JSON object")
    return obj


def _text_of(req: dict, explorer: Explorer) -> str:
    text = req.get("text", explorer.default_text)
    if not isinstance(text, str):
        raise UserError("text must be a string")
    return text


def _kv_of(req: dict) -> str | None:
    """The checkpoint name of a /api/heads request's kv_heads (None: the model as opened)."""
    k = req.get("kv_heads")
    if k is not None and not _integer(k):
        raise UserError(f"kv_heads must be a whole number of key/value heads, got {k!r}")
    return None if k is None else kv_name(k)


def _checkpoint_of(req: dict) -> str | None:
    """The run checkpoint a request names ("checkpoint", e.g. "step-000100"); None when it names none."""
    name = req.get("checkpoint")
    if name is not None and not isinstance(name, str):
        raise UserError("checkpoint must be the name of one of the run's checkpoints, e.g. step-000100")
    return name


def _update_of(req: dict) -> tuple[int, str, list[int]]:
    """(step, param, index) of a /api/update request, each of the right type."""
    step, param, index = req.get("step"), req.get("param"), req.get("index")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError("update needs a step: the step of one of the run's checkpoints")
    if not isinstance(param, str) or not isinstance(index, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in index):
        raise UserError("update needs a param (a weight's name) and an index (a list of integers)")
    return step, param, index


def _probe_of(req: dict) -> tuple[str, list[int]]:
    probe, index = req.get("probe"), req.get("index")
    if not isinstance(probe, str) or not isinstance(index, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in index):
        raise UserError("explain needs a probe name and an index (a list of integers)")
    return probe, index


SAMPLE_NUMBERS = {"temperature": 1.0, "top_p": None, "min_p": None, "repetition_penalty": 1.0}  # and defaults


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sample_of(req: dict) -> tuple[int, dict]:
    """(position, sampling settings) of a /api/sample request, each of the right type; their
    ranges are the sampler's own check (check_sampling)."""
    position = req.get("position")
    if not _integer(position):
        raise UserError("sample needs a position: the index of the token whose next token is sampled")
    return position, _settings_of(req)


def _settings_of(req: dict) -> dict:
    """The sampling settings of a request (defaults where absent), each of the right type."""
    number, integer = _number, _integer
    settings = {k: req.get(k, d) for k, d in SAMPLE_NUMBERS.items()}
    settings.update(top_k=req.get("top_k"), seed=req.get("seed", 0))
    for k, v in settings.items():
        ok = integer(v) if k in ("top_k", "seed") else number(v)
        if not (ok or (v is None and k not in ("temperature", "repetition_penalty", "seed"))):
            raise UserError(f"{k} must be {'an integer' if k in ('top_k', 'seed') else 'a number'}, got {v!r}")
    if not 0 <= settings["seed"] < 2 ** 63:
        raise UserError(f"seed must be in 0..2^63-1, got {settings['seed']}")
    return settings


GENERATE_FIELDS = ("text", "max_tokens", *SAMPLE_NUMBERS, "top_k", "seed", "checkpoint")
GENERATE_TOKENS = 20  # new tokens when a request names no max_tokens (fewer where the context has less room)


def _generate_of(req: dict) -> tuple[int | None, dict]:
    """(max_tokens, sampling settings) of a /api/generate request: known fields only, each of the
    right type, max_tokens within 1..MAX_TOKENS (the ranges of the rest: the sampler's check)."""
    unknown = sorted(set(req) - set(GENERATE_FIELDS))
    if unknown:
        raise UserError(f"generate takes {', '.join(GENERATE_FIELDS)}; unknown field {unknown[0]!r}")
    n = req.get("max_tokens")  # None: the generator fits GENERATE_TOKENS into the context's room
    if n is not None and (not _integer(n) or not 1 <= n <= MAX_TOKENS):
        raise UserError(f"max_tokens must be an integer in 1..{MAX_TOKENS}, got {n!r}")
    return n, _settings_of(req)


def explorer_router(explorer: Explorer) -> APIRouter:
    """The explorer's routes, to include in any app from serve.http.make_app.

    The model runs in the thread pool (the explorer's lock makes the computations take
    turns), so a slow trace never holds up the event loop that reads other requests. Every
    computation goes through the explorer's WorkQueue: capped, and cancelled when its client leaves.
    """
    router = APIRouter()

    @router.api_route("/", methods=["GET", "HEAD"])
    @router.api_route("/index.html", methods=["GET", "HEAD"])
    async def page(request: Request) -> Response:
        try:
            payload = await _queued(explorer, request, explorer.payload, explorer.default_text)
        except Exception as e:
            return _error_for(e)
        return _send(200, render_html(payload, inline=False).encode("utf-8"), "text/html; charset=utf-8")

    @router.api_route("/static/{name}", methods=["GET", "HEAD"])
    async def static(name: str) -> Response:
        # A fixed list: a name is looked up, never joined to a folder, so `..`,
        # %2e%2e, absolute paths and symlinks cannot reach any other file.
        if name not in STATIC_FILES:
            return _json(404, {"error": "not found"})
        return _send(200, static_file(name).encode("utf-8"), STATIC_FILES[name])

    @router.get("/favicon.ico")
    async def favicon() -> Response:
        return _send(204, b"", "image/x-icon")

    async def answer(request: Request, work) -> Response:
        """The body's JSON, `work(req)` -> (function, *args) run in the thread pool, its result or the error."""
        try:
            fn, *args = work(await _read_json(request))
            return _json(200, await _queued(explorer, request, fn, *args))
        except Exception as e:
            return _error_for(e)

    @router.post("/api/trace")
    async def trace(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.payload, _text_of(req, explorer), _checkpoint_of(req)))

    @router.post("/api/explain")
    async def explain(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.calculation, _text_of(req, explorer), *_probe_of(req),
                                                  _checkpoint_of(req)))

    @router.post("/api/sample")
    async def sample(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.sample, _text_of(req, explorer), *_sample_of(req),
                                                  _checkpoint_of(req)))
    for more in (run_routes, research_routes, heads_route, features_route):  # views' routes in their own functions
        more(router, explorer, answer)

    @router.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.generation, _text_of(req, explorer), *_generate_of(req),
                                                  _checkpoint_of(req)))

    return router


def _queued(explorer: Explorer, request: Request, fn, *args):
    """fn(*args) as `request`'s work in the explorer's queue: capped, and cancelled when its client leaves."""
    return explorer.work.run(request, explorer.max_queued, fn, *args)


def heads_route(router: APIRouter, explorer: Explorer, answer) -> None:
    """POST /api/heads {"text", "kv_heads"}: the page's data with the model's KV heads averaged to kv_heads
    (viewer/heads.py; 400 where the explorer has no head switch). answer: explorer_router's."""

    @router.post("/api/heads")
    async def heads(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.payload, _text_of(req, explorer), _kv_of(req)))


def features_route(router: APIRouter, explorer: Explorer, answer) -> None:
    """GET /features: the SAE feature browser that `view --sae SAE --sae-data D` built at start-up
    (viewer/features.py; 404 without one). answer: explorer_router's (unused: the page is ready-made)."""

    @router.api_route("/features", methods=["GET", "HEAD"])
    async def features() -> Response:
        if explorer.features_page is None:
            return _json(404, {"error": "no feature browser: start the explorer with --sae SAE --sae-data DATA"})
        return _send(200, explorer.features_page.encode("utf-8"), "text/html; charset=utf-8")


def run_routes(router: APIRouter, explorer: Explorer, answer) -> None:
    """The Training view's routes (`view --run`; 404 without a run): GET /api/run, its curves and
    checkpoints; POST /api/update, one optimizer update explained. answer: explorer_router's."""

    @router.get("/api/run")
    async def run_view(request: Request) -> Response:
        try:
            return _json(200, await _queued(explorer, request, explorer.training))
        except Exception as e:
            return _error_for(e)

    @router.post("/api/update")
    async def update(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.update, *_update_of(req)))


def research_routes(router: APIRouter, explorer: Explorer, answer) -> None:
    """The patching and attribution view's routes (docs/research.md#in-the-explorer): POST /api/patch,
    a patching sweep; POST /api/attribute, a direct logit attribution. answer: explorer_router's."""

    @router.post("/api/patch")
    async def patch(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.researched, "patch", req))

    @router.post("/api/attribute")
    async def attribute(request: Request) -> Response:
        return await answer(request, lambda req: (explorer.researched, "attribute", req))


def make_explorer_app(explorer: Explorer, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
                      allowed_hosts=()) -> FastAPI:
    """The explorer alone on the HTTP base: its Host check (loopback and `allowed_hosts`), its body
    limit, `{"error"}` bodies; with `api_key`, every route needs it (docs/viewer.md)."""
    app = make_app(host=host, port=port, api_key=api_key, limits=LIMITS, error_body=plain_error,
                   allowed_hosts=allowed_hosts)
    app.include_router(explorer_router(explorer))
    return app


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 8000,
                on_ready: Callable[[str], None] | None = None, *, api_key: str | None = None,
                allowed_hosts=()) -> Server:
    """A server for `explorer` bound to (host, port) now; port 0 picks a free one.

    Serve with `.run()` (until Ctrl-C) or `.start_in_thread()` (tests, notebooks; `.stop()`).
    `api_key`, `allowed_hosts`: as make_explorer_app.
    """
    return Server(make_explorer_app(explorer, host, port, api_key=api_key, allowed_hosts=allowed_hosts), host, port,
                  on_ready=on_ready)
