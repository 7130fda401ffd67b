"""The HTTP base (serve/http.py) on a real uvicorn on 127.0.0.1: the Host check, the API key,
the body limit, the deadlines on half-sent requests, the concurrency cap, CORS, streaming
that is not buffered, disconnects that reach the app, and errors shaped by the caller."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import signal
import socket
import threading

import pytest
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.testclient import TestClient

from glassformer.errors import UserError
from glassformer.serve.http import Limits, Server, bind, make_app

KEY = "test-key-1234"
LIMITS = Limits(max_body=1000, header_timeout=1.0, body_timeout=1.5)


def shaped(status, message):
    """An error body unlike the default, to show the caller's shape is the one sent."""
    return {"error": {"message": message, "code": status}}


class Probe:
    """What the routes let the tests steer and see (set from the server's thread)."""

    def __init__(self):
        self.release = threading.Event()
        self.next_chunk = threading.Event()
        self.disconnected = threading.Event()
        self.entered = threading.Semaphore(0)  # one release per request inside /v1/hold


def build_app(probe: Probe, limits: Limits = LIMITS, **kw):
    app = make_app(host="127.0.0.1", port=0, api_key=KEY, limits=limits, error_body=shaped, **kw)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.post("/tokenize")
    def tokenize():
        return {"tokens": []}

    @app.get("/v1/hold")
    async def hold():
        probe.entered.release()
        await asyncio.to_thread(probe.release.wait, 30)
        return {"held": True}

    @app.get("/v1/stream")
    async def stream(request: Request):
        async def pieces():
            try:
                yield b"first\n"
                await asyncio.to_thread(probe.next_chunk.wait, 30)  # sent only once the test saw "first"
                yield b"second\n"
                while not await request.is_disconnected():  # endless, but for a client that leaves
                    await asyncio.sleep(0.02)
                    yield b"more\n"
            finally:  # reached when the client leaves (the stream is cancelled, or sees the disconnect)
                probe.disconnected.set()
        return StreamingResponse(pieces(), media_type="text/plain")

    @app.post("/v1/boom")
    async def boom(request: Request):
        raise RuntimeError((await request.body()).decode())  # a message quoting the prompt

    return app


@pytest.fixture(scope="module")
def probe():
    return Probe()


@pytest.fixture(scope="module")
def server(probe):
    srv = Server(build_app(probe), "127.0.0.1", 0)  # the deadlines come from the app (LIMITS)
    srv.start_in_thread()
    yield srv
    probe.release.set()
    probe.next_chunk.set()
    srv.stop()


def request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
    finally:
        conn.close()


AUTH = {"Authorization": f"Bearer {KEY}"}


def raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(data)
    return sock


def read_all(sock) -> bytes:
    """Everything the server sends until it closes the connection (b'' if it just closes)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return out


def test_server_reports_its_real_port_and_ready_url(probe):
    seen = []
    srv = Server(build_app(probe), "127.0.0.1", 0, LIMITS, on_ready=seen.append)
    try:
        assert srv.port != 0 and srv.url == f"http://127.0.0.1:{srv.port}"
        assert srv.start_in_thread() == srv.url
        assert seen == [srv.url]
        assert request(srv, "GET", "/health")[0] == 200
        with pytest.raises(UserError, match="cannot listen"):  # the port is taken
            Server(build_app(probe), "127.0.0.1", srv.port, LIMITS)
    finally:
        srv.stop()


def test_connections_send_small_writes_at_once():
    """The listening socket says TCP, so asyncio turns Nagle's algorithm off on every connection it
    accepts (else a kept-alive connection's answer body waits for the client's delayed ACK, 40 ms)."""
    sock = bind("127.0.0.1", 0)
    seen = []

    class Note(asyncio.Protocol):
        def connection_made(self, transport):
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def accept_one():
        server = await asyncio.get_running_loop().create_server(Note, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(accept_one())
    assert seen == [1]


def test_api_key_guards_every_path_but_health(server):
    status, _, body = request(server, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    for path, with_key in (("/v1/echo", 200), ("/tokenize", 200), ("/nowhere", 404), ("/", 404)):  # 401 before 404
        status, headers, body = request(server, "POST", path, b"{}")
        assert status == 401 and "Authorization: Bearer" in json.loads(body)["error"]["message"]
        assert headers["www-authenticate"] == "Bearer"
        status, _, body = request(server, "POST", path, b"{}", {"Authorization": "Bearer wrong-key-1234"})
        assert status == 401 and json.loads(body)["error"] == {"message": "invalid API key", "code": 401}
        assert request(server, "POST", path, b"{}", {"Authorization": f"Basic {KEY}"})[0] == 401
        assert request(server, "POST", path, b"{}", AUTH)[0] == with_key


def test_host_check_and_security_headers(server):
    for host in ("evil.example:80", "127.attacker.example", "127.0.0.1.nip.io", "127.0.0.1.evil.com:80",
                 "localhost:80:80", "user@localhost", "local host"):
        status, headers, body = request(server, "GET", "/health", headers={"Host": host})
        assert status == 403 and json.loads(body)["error"]["code"] == 403, host
        assert headers["x-content-type-options"] == "nosniff"
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:80", "LOCALHOST.", "127.0.3.4:1"):
        status, headers, _ = request(server, "GET", "/health", headers={"Host": host})
        assert status == 200 and headers["x-content-type-options"] == "nosniff"
    # Bound to another address, the user chose to be reached by other names.
    open_app = make_app(host="0.0.0.0", port=0)
    open_app.get("/x")(lambda: {"ok": 1})
    assert TestClient(open_app).get("/x", headers={"Host": "box.example"}).status_code == 200


def test_body_limit_by_length_and_by_stream(server):
    assert json.loads(request(server, "POST", "/v1/echo", b"x" * 1000, AUTH)[2]) == {"bytes": 1000}
    status, headers, body = request(server, "POST", "/v1/echo", b"x" * 1001, AUTH)
    assert status == 413 and headers["connection"] == "close" and "1000 bytes" in json.loads(body)["error"]["message"]
    # A claimed length over the limit is refused before any byte of the body is sent.
    sock = raw(server, b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
               + b"\r\nContent-Length: 5000000\r\n\r\n")
    assert read_all(sock).startswith(b"HTTP/1.1 413 ")
    # A chunked body has no length to check: it is counted as it arrives.
    head = b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    chunk = b"1f4\r\n" + b"y" * 500 + b"\r\n"
    answer = read_all(raw(server, head + chunk * 2 + b"0\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"bytes":1000}')
    answer = read_all(raw(server, head + chunk * 3 + b"0\r\n\r\n"))
    assert answer.startswith(b"HTTP/1.1 413 ") and b"over 1000 bytes" in answer


def test_errors_take_the_callers_shape_and_hide_tracebacks(server, caplog):
    status, _, body = request(server, "GET", "/nowhere", headers=AUTH)
    assert status == 404 and json.loads(body) == {"error": {"message": "not found", "code": 404}}
    with caplog.at_level(logging.INFO):
        status, _, body = request(server, "POST", "/v1/boom", b"secret prompt text", AUTH)
    assert status == 500 and json.loads(body) == {"error": {"message": "internal error: RuntimeError", "code": 500}}
    assert b"secret" not in body and b"Traceback" not in body
    # The log says where it broke, and not the message (which may quote a prompt).
    assert "RuntimeError" in caplog.text and "in boom" in caplog.text and "secret" not in caplog.text
    status, _, body = request(server, "GET", "/docs", headers=AUTH)  # no docs pages or schema of the API
    assert status == 404 and request(server, "GET", "/openapi.json", headers=AUTH)[0] == 404


def test_half_sent_requests_are_closed_at_their_deadlines(server):
    # Headers that never end, and headers whose promised body never comes.
    stalled = [raw(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") for _ in range(5)]
    stalled += [raw(server, b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                    + b"\r\nContent-Length: 100\r\n\r\nhalf") for _ in range(5)]
    # Meanwhile everyone else is answered.
    for _ in range(5):
        assert request(server, "GET", "/health")[0] == 200
    for sock in stalled:  # the server closes each one (the socket timeout is far past the deadlines)
        assert read_all(sock) == b""


def test_streams_are_not_buffered_and_disconnects_reach_the_app(server, probe):
    sock = raw(server, b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
    got = b""
    while b"first\n" not in got:  # the first piece arrives while the route still waits to send the second
        got += sock.recv(4096)
    assert b"second" not in got
    probe.next_chunk.set()
    while b"second\n" not in got:
        got += sock.recv(4096)
    sock.close()
    assert probe.disconnected.wait(30)


def test_concurrency_cap_answers_503():
    probe = Probe()
    limits = Limits(limit_concurrency=2)
    srv = Server(build_app(probe, limits), "127.0.0.1", 0, limits)
    srv.start_in_thread()
    results = []
    holders = [threading.Thread(target=lambda: results.append(request(srv, "GET", "/v1/hold", headers=AUTH)))
               for _ in range(2)]
    for t in holders:
        t.start()
    try:
        assert probe.entered.acquire(timeout=30) and probe.entered.acquire(timeout=30)
        # The two holders fill the cap; one more is refused at once.
        status, headers, body = request(srv, "GET", "/health")
        assert status == 503 and headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == 503
    finally:
        probe.release.set()
        for t in holders:
            t.join(30)
        assert request(srv, "GET", "/health")[0] == 200  # the cap frees with the answers
        srv.stop()
    assert [r[0] for r in results] == [200, 200]


def test_cors_only_when_origins_are_given(probe):
    origin = {"Origin": "https://notebook.example"}
    plain = TestClient(build_app(probe), base_url="http://127.0.0.1")
    assert "access-control-allow-origin" not in plain.get("/health", headers=origin).headers
    cors = TestClient(build_app(probe, cors_origins=["https://notebook.example"]), base_url="http://127.0.0.1")
    assert cors.get("/health", headers=origin).headers["access-control-allow-origin"] == "https://notebook.example"
    pre = cors.options("/v1/echo", headers={**origin, "Access-Control-Request-Method": "POST",
                                             "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
    other = cors.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only")
def test_run_serves_until_ctrl_c_and_stops_cleanly(probe):
    seen = []

    def client(url):
        seen.append(request(srv, "GET", "/health")[0])
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

    srv = Server(build_app(probe), "127.0.0.1", 0, LIMITS,
                 on_ready=lambda url: threading.Thread(target=client, args=(url,)).start())
    srv.run()  # returns, rather than raising KeyboardInterrupt
    assert seen == [200]
    with pytest.raises(OSError):  # nobody listens any more
        socket.create_connection(("127.0.0.1", srv.port), timeout=5)
