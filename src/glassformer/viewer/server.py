"""`glassformer view`: a small local server for the explorer page.

It serves GET / (the page), GET /static/NAME (its own CSS and JavaScript, a fixed list),
POST /api/trace and POST /api/explain (docs/viewer.md#the-servers-endpoints), nothing else.
Loopback by default, size limits (413), 404 for any other path, loopback Host names only,
JSON with nosniff: docs/viewer.md#safety.
"""

from __future__ import annotations

import json
import sys
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

from ..errors import UserError
from .render import _finite, build_payload, render_html, static_file, to_plain

MAX_BODY = 64 * 1024  # bytes of one request body
MAX_TEXT = 2000  # characters of one sentence
LOOPBACK = ("127.0.0.1", "localhost", "::1")
STATIC_FILES = {"glass.css": "text/css; charset=utf-8", "glass.js": "text/javascript; charset=utf-8"}


class TooLarge(Exception):
    """A request over a size limit (answered with 413)."""


@dataclass
class Explorer:
    """What the server computes with: turn text into ids, trace them, explain a number.

    encode(text) -> (ids, tokens), raising UserError for text the model cannot read.
    trace(ids, tokens) -> a Trace or its dict form. explain(trace, probe, index) -> one number's
    calculation (optional). as_dict(trace, digits) -> the dict form (optional).
    extras(ids, tokens, trace_dict, trace) -> more build_payload arguments: norm, costs, ... (optional).
    """

    encode: Callable[[str], tuple[list[int], list[str]]]
    trace: Callable[[list[int], list[str]], dict]
    default_text: str
    explain: Callable[[Any, str, list[int]], Any] | None = None
    as_dict: Callable[[Any, int], dict] | None = None
    extras: Callable[[list[int], list[str], dict, Any], dict] | None = None
    payload_args: dict = field(default_factory=dict)
    cache_size: int = 8
    digits: int = 6  # decimals (or significant digits, as as_dict reads it) of the numbers sent
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _traced(self, text: str) -> tuple[dict, dict]:
        """(trace, payload) for `text`, computed once and kept for the next few requests."""
        if len(text) > MAX_TEXT:
            raise TooLarge(f"the sentence has {len(text)} characters; the limit is {MAX_TEXT}")
        # One model, one probe recorder: computations take turns (the recorder is global).
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
            ids, tokens = self.encode(text)
            if not ids:
                raise UserError("the sentence is empty: type a few words")
            tr = self.trace(ids, tokens)
            shown = self.as_dict(tr, self.digits) if self.as_dict else tr
            args = dict(self.payload_args)
            if self.extras is not None:
                args.update(self.extras(ids, tokens, shown, tr))
            # The live page asks the server for calculations, so it needs only what it draws.
            payload = build_payload(shown, mode="server", sentence=text, slim=True, **args)
            self._cache[text] = (tr, payload)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return tr, payload

    def payload(self, text: str) -> dict:
        return self._traced(text)[1]

    def calculation(self, text: str, probe: str, index: list[int]) -> Any:
        if self.explain is None:
            raise UserError("this server has no calculations to show")
        tr, _ = self._traced(text)
        with self._lock:
            return to_plain(self.explain(tr, probe, index))


def _is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def _host_name(header: str) -> str:
    """The name part of a Host header: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Handler(BaseHTTPRequestHandler):
    server_version = "glassformer-view"
    sys_version = ""
    timeout = 30  # seconds a client may take to send its request
    explorer: Explorer  # set on the subclass that make_server builds
    quiet = True

    # ---- plumbing -----------------------------------------------------------------
    def log_message(self, fmt: str, *args: Any) -> None:
        if not self.quiet:
            sys.stderr.write("view: " + (fmt % args) + "\n")

    def _send(self, status: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Frame-Options", "DENY")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        try:
            text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a NaN somewhere: JSON has no spelling for it
            text = json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False)
        body = text.encode("utf-8")
        self._send(status, body, "application/json; charset=utf-8")

    def _error(self, status: int, message: str) -> None:
        if status in (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.LENGTH_REQUIRED):
            self.close_connection = True  # the unread body must not be taken for a next request
        self._json(status, {"error": message})

    def _host_ok(self) -> bool:
        bound = self.server.server_address[0]
        if not _is_loopback(bound):
            return True  # the user asked for another address: any name may reach it
        return _is_loopback(_host_name(self.headers.get("Host", "127.0.0.1")))

    # ---- GET ------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self._host_ok():
            return self._error(HTTPStatus.FORBIDDEN, "unexpected Host header")
        path = urlsplit(self.path).path
        if path in ("/", "/index.html"):
            try:
                payload = self.explorer.payload(self.explorer.default_text)
            except (UserError, ValueError, TooLarge) as e:
                return self._error(HTTPStatus.BAD_REQUEST, str(e))
            except Exception as e:  # report, keep serving
                traceback.print_exc()
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}")
            page = render_html(payload, inline=False).encode("utf-8")
            return self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
        if path.startswith("/static/"):
            name = path[len("/static/"):]
            # A fixed list: a name is looked up, never joined to a folder, so `..`,
            # %2e%2e, absolute paths and symlinks cannot reach any other file.
            if name in STATIC_FILES:
                return self._send(HTTPStatus.OK, static_file(name).encode("utf-8"), STATIC_FILES[name])
        if path == "/favicon.ico":
            return self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        return self._error(HTTPStatus.NOT_FOUND, "not found")

    do_HEAD = do_GET

    # ---- POST -----------------------------------------------------------------------
    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HTTPError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
        try:
            n = int(length)
        except ValueError:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "bad Content-Length") from None
        if n < 0:
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "bad Content-Length")
        if n > MAX_BODY:
            raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body over {MAX_BODY} bytes")
        try:
            obj = json.loads(self.rfile.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "the body must be JSON") from None
        if not isinstance(obj, dict):
            raise _HTTPError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return obj

    def do_POST(self) -> None:  # noqa: N802
        if not self._host_ok():
            return self._error(HTTPStatus.FORBIDDEN, "unexpected Host header")
        path = urlsplit(self.path).path
        if path not in ("/api/trace", "/api/explain"):
            return self._error(HTTPStatus.NOT_FOUND, "not found")
        try:
            req = self._read_json()
            text = req.get("text", self.explorer.default_text)
            if not isinstance(text, str):
                raise UserError("text must be a string")
            if path == "/api/trace":
                return self._json(HTTPStatus.OK, self.explorer.payload(text))
            probe, index = req.get("probe"), req.get("index")
            if not isinstance(probe, str) or not isinstance(index, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in index):
                raise UserError("explain needs a probe name and an index (a list of integers)")
            return self._json(HTTPStatus.OK, self.explorer.calculation(text, probe, index))
        except _HTTPError as e:
            return self._error(e.status, e.message)
        except TooLarge as e:
            return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e))
        except (UserError, ValueError, KeyError, IndexError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return self._error(HTTPStatus.BAD_REQUEST, msg)
        except Exception as e:  # report, keep serving
            traceback.print_exc()
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(e).__name__}")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ExplorerServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 8000, quiet: bool = True) -> ExplorerServer:
    """A server for `explorer` bound to (host, port); port 0 picks a free one. Not yet serving."""
    handler = type("ExplorerHandler", (Handler,), {"explorer": explorer, "quiet": quiet})
    if ":" in host:
        cls = type("ExplorerServer6", (ExplorerServer,), {"address_family": __import__("socket").AF_INET6})
    else:
        cls = ExplorerServer
    try:
        return cls((host, port), handler)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host") from None


def serve_in_thread(server: ExplorerServer) -> threading.Thread:
    """Serve in a daemon thread (tests, notebooks); stop with server.shutdown()."""
    t = threading.Thread(target=server.serve_forever, name="glassformer-view", daemon=True)
    t.start()
    return t
