"""The HTTP base that `glassformer serve` and `glassformer view` stand on: one FastAPI app
with its guards, run by uvicorn in-process.

    app = make_app(host="127.0.0.1", port=8000, api_key=None, limits=Limits())
    app.include_router(routes)          # the caller's routes
    Server(app, "127.0.0.1", 8000, on_ready=print).run()

The guards are pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed
answers and hide disconnects), outermost first:

- the Host check: on a loopback bind, a request whose Host header names anything but a
  loopback name is refused with 403 (a page on another site cannot reach the server by
  pointing its own name at 127.0.0.1: DNS rebinding);
- CORS, only when origins are given (Starlette's CORSMiddleware);
- the gate: a Bearer API key (compared in constant time) for the paths that need one (401),
  a cap on concurrent requests (503), and the body size limit (413 for a Content-Length
  over it, or for a streamed body the moment it passes it).

The deadlines sit in the connection itself (`_DeadlineProtocol`, uvicorn's h11 protocol
with two timers): a request's headers must arrive within `Limits.header_timeout` seconds
and its body within `Limits.body_timeout`, or the connection is closed. A client that
stalls half-way through a request holds a socket until then and nothing else: every
connection is its own asyncio protocol, so it never blocks another.

Errors are JSON objects built by the app's `error_body(status, message)`: the explorer
answers `{"error": message}`, the OpenAI routes OpenAI's error objects. uvicorn's access
log is off, and no body is ever logged.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import h11
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_PATHS = ("/v1", "/tokenize", "/detokenize")  # what an API key guards by default; /health stays open
# Sent with every answer: no type sniffing, no framing, no caching, no referrer.
SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
                    (b"cache-control", b"no-store"), (b"x-frame-options", b"DENY")]

# FastAPI's OpenTelemetry hooks record exception messages (prompt text, perhaps): all off.
NO_TELEMETRY = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False, "auto_configure": False}

ErrorBody = Callable[[int, str], Any]
_log = logging.getLogger("glassformer.serve")


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server.

    max_body: bytes of a request body (413 past it). header_timeout, body_timeout: seconds
    for a request's headers to arrive (from the connection's start, or the end of the previous
    answer) and for its body to arrive after them; past either the connection is closed.
    limit_concurrency: requests answered at once (None: no cap); one more gets 503.
    shutdown_timeout: seconds running answers get to finish when the server stops.
    """

    max_body: int = 1 << 20
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    limit_concurrency: int | None = None
    shutdown_timeout: float = 5.0


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name, no port) is this machine's loopback.

    >>> [is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "localhost", "::1", "0.0.0.0", "example.org")]
    [True, True, True, True, False, False]
    """
    return host in LOOPBACK or host.startswith("127.")


def host_name(header: str) -> str:
    """The name part of a Host header.

    >>> host_name("localhost:8000"), host_name("[::1]:80"), host_name("127.0.0.1"), host_name("::1")
    ('localhost', '::1', '127.0.0.1', '::1')
    """
    header = header.strip()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def plain_error(status: int, message: str) -> dict:
    """The default error body: `{"error": message}` (the explorer's shape)."""
    return {"error": message}


def json_bytes(obj: Any) -> bytes:
    """Compact JSON; a NaN or infinity (which JSON cannot spell) is refused with ValueError."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")


def json_response(status: int, obj: Any, headers: dict | None = None) -> Response:
    return Response(json_bytes(obj), status_code=status, headers=headers,
                    media_type="application/json; charset=utf-8")


class BodyTooLarge(HTTPException):
    """A streamed body passed the limit: raised from `receive`, answered 413 by the app's handler."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body over {limit} bytes", headers={"Connection": "close"})


# ----------------------------------------------------------------------------- the guards


def _log_internal(scope, e: Exception) -> None:
    """The kind of error and where it was raised, without its message: a message may quote a
    prompt, and the log never holds one."""
    where = "".join(traceback.format_tb(e.__traceback__))
    _log.error("internal error answering %s %s: %s\n%s", scope["method"], scope["path"], type(e).__name__, where)


class HostCheck:
    """Refuses (403) a foreign Host header on a loopback bind; adds SECURITY_HEADERS to every answer."""

    def __init__(self, app, *, check: bool, error_body: ErrorBody):
        self.app, self.check, self.error_body = app, check, error_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + SECURITY_HEADERS}
            await send(message)

        name = host_name(Headers(scope=scope).get("host", "127.0.0.1"))
        if self.check and not is_loopback(name):
            answer = json_response(403, self.error_body(403, "unexpected Host header: use a loopback name "
                                                             "(127.0.0.1 or localhost) to reach this server"))
            return await answer(scope, receive, send_with_headers)
        await self.app(scope, receive, send_with_headers)


class Gate:
    """The API key (401 on `key_paths`), the cap on concurrent requests (503), the body limit (413)."""

    def __init__(self, app, *, api_key: str | None, key_paths: tuple[str, ...], limits: Limits,
                 error_body: ErrorBody):
        self.app, self.limits, self.error_body = app, limits, error_body
        self.key = None if api_key is None else api_key.encode("utf-8")
        self.key_paths = key_paths
        self.active = 0  # requests inside the app now (one event loop: no lock needed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            status, message, headers = refusal
            return await json_response(status, self.error_body(status, message), headers)(scope, receive, send)
        self.active += 1
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._capped(receive), tracked_send)
        except ClientDisconnect:
            pass  # the client left half-way through its body: nobody to answer
        except Exception as e:  # a bug in a route: answered here, so nothing logs its message
            _log_internal(scope, e)
            if not started:  # else uvicorn closes the connection of the unfinished answer
                await json_response(500, self.error_body(500, f"internal error: {type(e).__name__}"))(scope, receive, send)
        finally:
            self.active -= 1

    def _refusal(self, scope) -> tuple[int, str, dict] | None:
        headers = Headers(scope=scope)
        if self.key is not None and self._needs_key(scope["path"]):
            got = headers.get("authorization", "")
            scheme, _, token = got.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return 401, "missing API key: send the header 'Authorization: Bearer KEY'", {"WWW-Authenticate": "Bearer"}
            if not hmac.compare_digest(token.strip().encode("utf-8"), self.key):
                return 401, "invalid API key", {"WWW-Authenticate": "Bearer"}
        cap = self.limits.limit_concurrency
        if cap is not None and self.active >= cap:
            return 503, f"the server is answering its limit of {cap} requests; retry shortly", {"Retry-After": "1"}
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, "bad Content-Length header", {"Connection": "close"}
            if int(length) > self.limits.max_body:
                return 413, f"request body over {self.limits.max_body} bytes", {"Connection": "close"}
        return None

    def _needs_key(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.key_paths)

    def _capped(self, receive):
        seen = 0
        limit = self.limits.max_body

        async def capped_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body, or one longer than its Content-Length said
                    raise BodyTooLarge(limit)
            return message

        return capped_receive


# ----------------------------------------------------------------------------- the app


def make_app(*, host: str, port: int, api_key: str | None = None, cors_origins=(), limits: Limits = Limits(),
             error_body: ErrorBody = plain_error, key_paths: tuple[str, ...] = KEY_PATHS) -> FastAPI:
    """A FastAPI app with the guards in front and every error answered as JSON by `error_body`.

    No docs pages, no redirects between `/x` and `/x/`: the app answers the paths its routes
    name and 404 for every other. `port` is part of the signature for the callers' symmetry
    with Server; the Host check accepts any port.
    """
    middleware = [Middleware(HostCheck, check=is_loopback(host), error_body=error_body)]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    middleware.append(Middleware(Gate, api_key=api_key, key_paths=tuple(key_paths), limits=limits, error_body=error_body))
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False, middleware=middleware,
                  telemetry=NO_TELEMETRY)
    app.state.error_body = error_body
    app.state.limits = limits  # Server's deadlines default to these
    _add_error_handlers(app, error_body)
    return app


def _add_error_handlers(app: FastAPI, error_body: ErrorBody) -> None:
    async def http_error(request: Request, exc: HTTPException):
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
        return json_response(exc.status_code, error_body(exc.status_code, message), exc.headers)

    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return json_response(400, error_body(400, f"{where}: {first.get('msg', 'invalid request')}".lstrip(": ")))

    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)  # (500s are the Gate's: no message logged)


# ----------------------------------------------------------------------------- deadlines


class _DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a timer on the request being read: headers within
    `header_timeout` seconds, then the body within `body_timeout`, else the connection closes.
    (uvicorn's own keep-alive timeout still closes idle connections between requests.)"""

    header_timeout = 10.0
    body_timeout = 60.0

    def connection_made(self, transport) -> None:
        self._phase, self._timer = None, None
        super().connection_made(transport)
        self._follow()

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc) -> None:
        self._set_timer(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm the timer of the phase the request is in (waiting for headers, or for body)."""
        state = self.conn.their_state
        phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if self.transport.is_closing():
            phase = None
        if phase != self._phase:
            self._phase = phase
            self._set_timer({"headers": self.header_timeout, "body": self.body_timeout}.get(phase))

    def _set_timer(self, seconds: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if seconds is None else self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _protocol_for(limits: Limits) -> type:
    return type("DeadlineProtocol", (_DeadlineProtocol,),
                {"header_timeout": limits.header_timeout, "body_timeout": limits.body_timeout})


# ----------------------------------------------------------------------------- the runner


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one. UserError when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    # proto says TCP; with 0, on a kept-alive connection an answer's body waited for the client's
    # delayed ACK of its headers, 40 ms a request (tests/serve/test_http.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready: Callable[[], None]):
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._ready()


class Server:
    """uvicorn running `app` in this process, on a socket bound at construction.

    `limits` (its deadlines and shutdown time) default to those the app was made with.
    `url` ("http://HOST:PORT", the real port when 0 was asked) is known at once. `run()` serves
    until Ctrl-C (or SIGTERM) and returns after a clean stop; `start_in_thread()` serves from a
    daemon thread (tests, notebooks) until `stop()`. `on_ready(url)` is called once the server
    accepts requests; `loop` is then the asyncio loop it serves on.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
                 on_ready: Callable[[str], None] | None = None):
        if limits is None:  # the limits the app was made with (make_app keeps them)
            limits = getattr(getattr(app, "state", None), "limits", None) or Limits()
        self.host = host
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self._ready = threading.Event()
        self._on_ready = on_ready
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        config = uvicorn.Config(app, http=_protocol_for(limits), ws="none", lifespan="on", log_config=None,
                                log_level="warning", access_log=False, server_header=False, proxy_headers=False,
                                timeout_graceful_shutdown=limits.shutdown_timeout)
        self._uvicorn = _Uvicorn(config, self._started)

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    def _started(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._ready.set()
        if self._on_ready is not None:
            self._on_ready(self.url)

    def run(self) -> None:
        try:
            self._uvicorn.run(sockets=[self.sock])
        except KeyboardInterrupt:  # uvicorn stops cleanly, then re-raises the signal it caught
            pass
        finally:
            self.sock.close()

    def start_in_thread(self, timeout: float = 30.0) -> str:
        self._thread = threading.Thread(target=self._serve_thread, name="glassformer-http", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or not self._uvicorn.started:
            raise RuntimeError("the server did not start (see its log above)")
        return self.url

    def _serve_thread(self) -> None:
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self.sock]))
        finally:
            self._ready.set()  # wakes start_in_thread when startup failed

    def stop(self, timeout: float = 30.0) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()
