"""The HTTP base that `glassformer serve` and `glassformer view` stand on: one FastAPI app
with its guards, run by uvicorn in-process.

    app = make_app(host="127.0.0.1", port=8000, api_key=None, limits=Limits())
    app.include_router(routes)          # the caller's routes
    Server(app, "127.0.0.1", 8000, on_ready=print).run()

The guards are pure ASGI middleware (Starlette's BaseHTTPMiddleware would buffer streamed
answers and hide disconnects), outermost first:

- the Host check: on a loopback bind (or wherever the caller names allowed hosts), a request
  whose Host header is not `localhost`, an address in 127.0.0.0/8, `::1` or one of the
  allowed names is refused with 403, and so is a Host header that is not a host at all (a
  page on another site cannot reach the server by pointing its own name at 127.0.0.1: DNS
  rebinding; `127.0.0.1.evil.example` is a name, not an address);
- CORS, only when origins are given (Starlette's CORSMiddleware);
- the gate: with an API key, every path but the open ones (`/health`) needs it (401): as
  `Authorization: Bearer KEY`, or as the cookie a browser gets by opening any page once as
  `/?key=KEY` (answered 303 to the same page without the key, setting an HttpOnly,
  SameSite=Strict cookie that holds a digest of the key, not the key); both compared in
  constant time. Then a cap on concurrent requests (503), and the body size limit (413 for a
  Content-Length over it, or for a streamed body the moment it passes it).

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
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qsl, quote, urlencode

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

LOOPBACK_NET = ipaddress.IPv4Network("127.0.0.0/8")  # with "localhost" and ::1: the names a loopback bind answers
IPV6_LOOPBACK = ipaddress.IPv6Address("::1")
OPEN_PATHS = ("/health",)  # the paths an API key does not guard (a load balancer's probe); every other needs it
KEY_COOKIE = "glassformer_key"  # + "_PORT": the browser's proof of the key (cookies do not tell ports apart)
_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")  # dot-separated labels (IDNs arrive as punycode)
_PORT = re.compile(r"[0-9]{1,5}")
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


def parse_host(value: str) -> tuple[str, int | None]:
    """(name, port) of a Host header (port None when it names none); ValueError when it is no host.

    The name comes back normalised: lower case, one trailing dot dropped, an IPv6 address without
    its brackets in its short form. Refused: spaces, userinfo (`@`), a second colon outside
    brackets, a port that is not a number in 0..65535, empty labels, IPv6 zone ids.

    >>> parse_host("LocalHost.:8000"), parse_host("[0:0::1]:80"), parse_host("127.0.0.1")
    (('localhost', 8000), ('::1', 80), ('127.0.0.1', None))
    >>> bad = ["", "a b", "user@localhost", "::1", "localhost:80:80", "[::1", "[::1]x", "[fe80::1%eth0]",
    ...        "localhost:", "localhost:99999", "localhost:-1", "..", "a..b", "local/host", "localhost\t"]
    >>> [b for b in bad if _parses(b)]
    []
    """
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        try:
            address = ipaddress.IPv6Address(inside) if bracket and "%" not in inside else None
        except ValueError:
            address = None
        if address is None:
            raise ValueError(f"not a host: {value!r}")
        name = address.compressed
    else:
        name, colon, port = value.partition(":")
        name, rest = name.lower(), colon + port
        name = name[:-1] if name.endswith(".") else name
        if not _HOST_NAME.fullmatch(name):
            raise ValueError(f"not a host: {value!r}")
    if not rest:
        return name, None
    if not (rest[0] == ":" and _PORT.fullmatch(rest[1:]) and int(rest[1:]) <= 65535):
        raise ValueError(f"not a host and port: {value!r}")
    return name, int(rest[1:])


def _parses(value: str) -> bool:
    try:
        parse_host(value)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, no port) is this machine's loopback: `localhost`, an
    address in 127.0.0.0/8, or ::1. A name that merely starts like one is not.

    >>> [is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "localhost", "LOCALHOST.", "::1", "0.0.0.0",
    ...                           "example.org", "127.attacker.example", "127.0.0.1.nip.io", "::ffff:127.0.0.1")]
    [True, True, True, True, True, False, False, False, False, False]
    """
    name = host.lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address in LOOPBACK_NET if address.version == 4 else address == IPV6_LOOPBACK


def allowed_host(value: str) -> str:
    """A name the user allows in Host headers (`--allowed-host`), as the Host check compares it;
    UserError when it is not a host name or address, or names a port.

    >>> allowed_host("Box.Example."), allowed_host("192.168.1.5"), allowed_host("FE80::1"), allowed_host("[::2]")
    ('box.example', '192.168.1.5', 'fe80::1', '::2')
    """
    shown = value if value.startswith("[") or ":" not in value else f"[{value}]"  # a bare IPv6 address
    try:
        name, port = parse_host(shown)
    except ValueError:
        port = name = None
    if name is None or port is not None:
        raise UserError(f"--allowed-host takes a host name or address without a port (box.example, "
                        f"192.168.1.5), got {value!r}")
    return name


def host_allowed(header: str | None, allowed: frozenset[str] = frozenset()) -> bool:
    """Whether a request with this Host header may be answered: a loopback name or one of `allowed`
    (names as `allowed_host` gives them). A request without one (HTTP/1.0; never a browser) may.

    >>> [host_allowed(h) for h in ("localhost:8000", "[::1]:80", "127.0.0.1.evil.com:80", "127.1", "evil.com")]
    [True, True, False, False, False]
    >>> host_allowed("BOX.example.:8000", frozenset({"box.example"})), host_allowed(None)
    (True, True)
    """
    if header is None:
        return True
    try:
        name, _ = parse_host(header)
    except ValueError:
        return False
    return is_loopback(name) or name in allowed


def keyed_url(url: str, key: str | None) -> str:
    """The page at `url` ("http://HOST:PORT/...") as a browser opens it once to get the key's cookie.

    >>> keyed_url("http://127.0.0.1:8000/", "k y&z"), keyed_url("http://127.0.0.1:8000/", None)
    ('http://127.0.0.1:8000/?key=k%20y%26z', 'http://127.0.0.1:8000/')
    """
    return url if key is None else f"{url}?key={quote(key, safe='')}"


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
    """Refuses (403) a Host header that is neither loopback nor `allowed` when `check` is on (a
    loopback bind, or allowed names given); adds SECURITY_HEADERS to every answer."""

    def __init__(self, app, *, check: bool, allowed: frozenset[str] = frozenset(), error_body: ErrorBody):
        self.app, self.check, self.allowed, self.error_body = app, check, allowed, error_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + SECURITY_HEADERS}
            await send(message)

        if self.check and not host_allowed(Headers(scope=scope).get("host"), self.allowed):
            answer = json_response(403, self.error_body(403, "unexpected Host header: reach this server as 127.0.0.1 "
                                                             "or localhost, or start it with --allowed-host NAME"))
            return await answer(scope, receive, send_with_headers)
        await self.app(scope, receive, send_with_headers)


MISSING_KEY = ("missing API key: send the header 'Authorization: Bearer KEY' (a browser: open the page once "
               "as /?key=KEY, the URL the server printed)")


class Gate:
    """The API key (401 on every path but `open_paths`), the cap on concurrent requests (503), the
    body limit (413). A GET or HEAD whose query holds `key=KEY` is answered 303 to the same path
    without it, setting the cookie that stands for the key (`cookie_token`) on this port."""

    def __init__(self, app, *, api_key: str | None, open_paths: tuple[str, ...], limits: Limits,
                 error_body: ErrorBody):
        self.app, self.limits, self.error_body = app, limits, error_body
        self.key = None if api_key is None else api_key.encode("utf-8")
        self.token = None if api_key is None else cookie_token(api_key).encode("ascii")
        self.open_paths = frozenset(open_paths)
        self.active = 0  # requests inside the app now (one event loop: no lock needed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        login = self._login(scope)
        if login is not None:
            return await login(scope, receive, send)
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

    def _login(self, scope) -> Response | None:
        """The answer to a keyed URL (`?key=KEY` on a GET or HEAD): 303 to the path without the key,
        setting the key's cookie (401 for a wrong key); None for any other request."""
        if self.key is None or scope["method"] not in ("GET", "HEAD"):
            return None
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = [v for k, v in query if k == "key"]
        if not given:
            return None
        if not hmac.compare_digest(given[-1].encode("utf-8"), self.key):
            return json_response(401, self.error_body(401, "invalid API key"), {"WWW-Authenticate": "Bearer"})
        rest = urlencode([(k, v) for k, v in query if k != "key"])
        where = "/" + scope["path"].lstrip("/") + (f"?{rest}" if rest else "")  # never //host: no redirect away
        cookie = (f"{_cookie_name(scope)}={self.token.decode()}; Path=/; HttpOnly; SameSite=Strict")
        return Response(status_code=303, headers={"Location": where, "Set-Cookie": cookie})

    def _key_refusal(self, scope, headers: Headers) -> str | None:
        """Why this request may not pass the key check (None: it may): the key in the Authorization
        header, else the cookie a keyed URL set; each compared in constant time."""
        if self.key is None or scope["path"] in self.open_paths:
            return None
        got = headers.get("authorization")
        if got is not None:
            scheme, _, token = got.partition(" ")
            if scheme.lower() != "bearer" or not token:
                return MISSING_KEY
            return None if hmac.compare_digest(token.strip().encode("utf-8"), self.key) else "invalid API key"
        cookie = Request(scope).cookies.get(_cookie_name(scope))
        if cookie is None:
            return MISSING_KEY
        if not hmac.compare_digest(cookie.encode("utf-8"), self.token):
            return "invalid API key cookie (the server's key changed?): open the URL the server printed, /?key=KEY"
        return None

    def _refusal(self, scope) -> tuple[int, str, dict] | None:
        headers = Headers(scope=scope)
        why = self._key_refusal(scope, headers)
        if why is not None:
            return 401, why, {"WWW-Authenticate": "Bearer"}
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


def cookie_token(key: str) -> str:
    """What the key's cookie holds: a digest of the key, so the cookie is no key (and any key's
    characters are safe in it)."""
    return hmac.new(key.encode("utf-8"), b"glassformer page cookie", hashlib.sha256).hexdigest()


def _cookie_name(scope) -> str:
    """The key's cookie on this server's port: a browser sends a host's cookies to all its ports, and
    two servers on one machine keep their keys apart."""
    server = scope.get("server")
    return f"{KEY_COOKIE}_{server[1]}" if server and server[1] is not None else KEY_COOKIE


# ----------------------------------------------------------------------------- the app


def make_app(*, host: str, port: int, api_key: str | None = None, cors_origins=(), limits: Limits = Limits(),
             error_body: ErrorBody = plain_error, open_paths: tuple[str, ...] = OPEN_PATHS,
             allowed_hosts=()) -> FastAPI:
    """A FastAPI app with the guards in front and every error answered as JSON by `error_body`.

    With `api_key`, every path but `open_paths` needs it. The Host check runs on a loopback `host`,
    or on any `host` once `allowed_hosts` (names or addresses the Host header may also name) are
    given. No docs pages, no redirects between `/x` and `/x/`: the app answers the paths its routes
    name and 404 for every other (401 first, without the key). `port` is part of the signature for
    the callers' symmetry with Server; the Host check accepts any port.
    """
    allowed = frozenset(allowed_host(h) for h in allowed_hosts)
    middleware = [Middleware(HostCheck, check=is_loopback(host) or bool(allowed), allowed=allowed,
                             error_body=error_body)]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    middleware.append(Middleware(Gate, api_key=api_key, open_paths=tuple(open_paths), limits=limits,
                                 error_body=error_body))
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
