"""Who may reach the apps of `serve` and `view`: one key for every route but /health (walked over
each app's route table, so a route added later without the key fails here), the browser's keyed
URL and its cookie, and a Host check that parses hosts (a table of hostile and friendly values)."""

from __future__ import annotations

import re

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from starlette.routing import Route
from starlette.testclient import TestClient

from glassformer.cli import build_parser, main
from glassformer.errors import UserError
from glassformer.serve.http import allowed_host, cookie_token, host_allowed, is_loopback, make_app, parse_host
from glassformer.viewer import source
from glassformer.viewer.server import make_explorer_app, make_server

from ..support import synthetic_text, tiny_checkpoint

KEY = "walk-key-5678"
AUTH = {"Authorization": f"Bearer {KEY}"}

# ----------------------------------------------------------------------------- the Host header, parsed

FRIENDLY = {  # Host header -> (name, port) as the check compares it
    "localhost": ("localhost", None), "localhost:8000": ("localhost", 8000), "LOCALHOST.": ("localhost", None),
    "LocalHost.:80": ("localhost", 80), "127.0.0.1:8000": ("127.0.0.1", 8000), "127.9.8.7": ("127.9.8.7", None),
    "[::1]": ("::1", None), "[::1]:8000": ("::1", 8000), "[0:0:0:0:0:0:0:1]:1": ("::1", 1),
    "127.0.0.1.:80": ("127.0.0.1", 80),  # a trailing dot is the same host (URLs parse it so too)
}
HOSTILE_NAMES = [  # hosts, but not loopback: refused unless allowed
    "127.attacker.example", "127.0.0.1.nip.io", "127.0.0.1.evil.com:80", "evil.com", "127.1", "2130706433",
    "0.0.0.0", "[::ffff:127.0.0.1]", "localhost.evil.com", "10.0.0.1:8000", "[::2]:80",
]
GARBAGE = [  # no host at all: refused always
    "", " ", "local host", "user@localhost", "localhost@evil.com", "::1", "127.0.0.1:80:80", "localhost:",
    "localhost:65536", "localhost:+80", "localhost:8o", "[::1", "[::1]x", "[::1]:", "[fe80::1%eth0]", "[localhost]",
    "..", "a..b", ".localhost", "localhost..", "local/host", "localhost#x", "localhost?x", "127.0.0.1\\.evil",
]


@pytest.mark.parametrize("header, expected", FRIENDLY.items())
def test_friendly_hosts_parse_to_their_loopback_name(header, expected):
    assert parse_host(header) == expected and is_loopback(expected[0]) and host_allowed(header)


@pytest.mark.parametrize("header", HOSTILE_NAMES)
def test_names_that_only_look_like_loopback_are_refused(header):
    name, _ = parse_host(header)
    assert not is_loopback(name) and not host_allowed(header)
    assert host_allowed(header, frozenset({name}))  # what --allowed-host NAME lets through


@pytest.mark.parametrize("header", GARBAGE)
def test_what_is_not_a_host_is_refused_even_where_names_are_allowed(header):
    with pytest.raises(ValueError):
        parse_host(header)
    assert not host_allowed(header, frozenset({"localhost", "evil.com", "::1"}))


@pytest.mark.parametrize("value, name", [("Box.Example.", "box.example"), ("192.168.1.5", "192.168.1.5"),
                                         ("FE80::1", "fe80::1"), ("[fe80::1]", "fe80::1")])
def test_allowed_host_names_are_normalised(value, name):
    assert allowed_host(value) == name


@pytest.mark.parametrize("value", ["box.example:8000", "[::1]:80", "a b", "user@box", "", "http://box.example"])
def test_allowed_host_refuses_what_is_no_bare_name(value):
    with pytest.raises(UserError, match="--allowed-host takes a host name"):
        allowed_host(value)


# ----------------------------------------------------------------------------- the route tables, walked


def _concrete(path: str) -> str:
    """A route's path with each parameter filled in (`/static/{name}` -> `/static/glass.css`)."""
    return re.sub(r"\{[^}]*\}", "glass.css", path)


def _walk(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app answers; a route of another kind (a mount, a websocket)
    fails the walk, so nothing joins the app past this test unseen."""
    out = []
    for route in iter_route_contexts(app.routes):  # (included routers, flattened)
        assert isinstance(route.original_route, Route) and route.path and route.methods, \
            f"a route the walk cannot read: {route!r}"
        out += [(method, _concrete(route.path)) for method in sorted(route.methods)]
    return out


def _assert_every_route_but_health_needs_the_key(app) -> set[str]:
    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
    walked = _walk(app)
    for method, path in walked:
        body = {"json": {}} if method == "POST" else {}
        without = client.request(method, path, **body)
        if path == "/health":
            assert without.status_code != 401, (method, path)
        else:
            assert without.status_code == 401 and without.headers["www-authenticate"] == "Bearer", (method, path)
            assert client.request(method, path, headers={"Authorization": "Bearer not-the-key"},
                                  **body).status_code == 401, (method, path)
        assert client.request(method, path, headers=AUTH, **body).status_code != 401, (method, path)
    return {path for _, path in walked}


def test_every_route_of_serve_with_the_explorer_needs_the_key(tmp_path):
    from glassformer.commands.serve import _thread_engine, build
    from glassformer.serve.backend import Backend

    model, tok = tiny_checkpoint(tmp_path / "ckpt", synthetic_text(200, 1))
    args = build_parser().parse_args(["serve", "--checkpoint", str(tmp_path / "ckpt"), "--explorer", "--port", "0",
                                      "--api-key", KEY])
    backend = Backend("ckpt")
    app, server = build(args, backend, KEY)  # (bound, never started: the walk runs in-process)
    engine = _thread_engine(args, app, model, tok, backend.model_id)  # what mounts the explorer's routes
    backend.ready(engine, model, tok)
    try:
        paths = _assert_every_route_but_health_needs_the_key(app)
    finally:
        engine.stop()
        server.sock.close()
    assert {"/health", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/", "/static/glass.css",
            "/api/trace", "/api/explain", "/api/sample", "/api/generate", "/api/run", "/api/update"} <= paths


def test_every_route_of_view_needs_the_key():
    paths = _assert_every_route_but_health_needs_the_key(make_explorer_app(source.worked_explorer(), api_key=KEY))
    assert {"/", "/index.html", "/static/glass.css", "/favicon.ico", "/api/trace", "/api/generate"} <= paths
    assert "/health" not in paths  # so every one of them needs it


def test_without_a_key_the_routes_stay_open():
    client = TestClient(make_explorer_app(source.worked_explorer()), base_url="http://127.0.0.1")
    assert client.get("/").status_code == 200
    assert client.post("/api/trace", json={}).status_code == 200


# ----------------------------------------------------------------------------- the browser's keyed URL


@pytest.fixture(scope="module")
def keyed_view():
    server = make_server(source.worked_explorer(), port=0, api_key=KEY)
    server.start_in_thread()
    yield server
    server.stop()


def test_a_keyed_url_sets_a_cookie_that_opens_the_page_and_its_calls(keyed_view):
    root = keyed_view.url
    with httpx.Client(base_url=root, timeout=60) as browser:
        assert browser.get("/").status_code == 401 and browser.get("/static/glass.js").status_code == 401
        login = browser.get("/?key=" + KEY)
        assert login.status_code == 303 and login.headers["location"] == "/"
        cookie = login.headers["set-cookie"]
        name = f"glassformer_key_{keyed_view.port}"
        assert cookie.startswith(f"{name}={cookie_token(KEY)};") and KEY not in cookie
        assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= {part.strip() for part in cookie.split(";")}
        # The page, its files and its API calls now pass on the cookie alone, as a browser sends them.
        assert browser.get("/").status_code == 200 and browser.get("/static/glass.js").status_code == 200
        assert browser.post("/api/trace", json={}).json()["trace"]["ids"]
    # Another cookie, or the right one on another port's name, is no key.
    for jar in ({name: cookie_token("other")}, {"glassformer_key_1": cookie_token(KEY)}, {name: KEY}):
        assert httpx.get(root + "/", cookies=jar).status_code == 401


def test_a_keyed_url_keeps_its_path_and_query_and_refuses_a_wrong_key(keyed_view):
    root = keyed_view.url
    got = httpx.get(root + "/index.html?a=1&key=" + KEY + "&b=2")
    assert got.status_code == 303 and got.headers["location"] == "/index.html?a=1&b=2"
    assert httpx.get(root + "//evil.example/?key=" + KEY).headers["location"] == "/evil.example/"  # never off-site
    wrong = httpx.get(root + "/?key=wrong")
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    # A key in the query of a POST is no key: only a page load trades it for the cookie.
    assert httpx.post(root + "/api/trace?key=" + KEY, json={}).status_code == 401


# ----------------------------------------------------------------------------- the Host check in the apps


def test_host_check_of_serve_and_view_apps():
    from glassformer.serve.openai import add_routes, openai_error
    from glassformer.serve.backend import Backend

    serve_app = add_routes(make_app(host="127.0.0.1", port=0, error_body=openai_error), Backend("m"))
    apps = {"serve": (serve_app, "/health"), "view": (make_explorer_app(source.worked_explorer()), "/favicon.ico")}
    for app, path in apps.values():
        client = TestClient(app, base_url="http://127.0.0.1")
        for host in ("127.0.0.1.nip.io", "127.attacker.example", "127.0.0.1.evil.com:80", "local host", "a@localhost"):
            assert client.get(path, headers={"Host": host}).status_code == 403, host
        for host in ("LOCALHOST.:8000", "127.0.0.2", "[::1]:80"):
            assert client.get(path, headers={"Host": host}).status_code != 403, host


def test_allowed_hosts_let_a_name_in_and_turn_the_check_on_anywhere():
    for bind in ("127.0.0.1", "0.0.0.0"):
        app = make_explorer_app(source.worked_explorer(), host=bind, allowed_hosts=["Box.Example."])
        client = TestClient(app, base_url="http://127.0.0.1")
        assert client.get("/favicon.ico", headers={"Host": "box.example:8000"}).status_code == 204
        assert client.get("/favicon.ico", headers={"Host": "other.example"}).status_code == 403
    # Without allowed names a non-loopback bind answers any name (its users reach it by theirs).
    open_app = make_explorer_app(source.worked_explorer(), host="0.0.0.0")
    assert TestClient(open_app).get("/favicon.ico", headers={"Host": "other.example"}).status_code == 204


# ----------------------------------------------------------------------------- the verbs' flags


@pytest.mark.parametrize("verb", [["view", "--worked"], ["serve", "--checkpoint", "none"]])
@pytest.mark.parametrize("argv, says", [(["--host", "0.0.0.0"], "--api-key"),
                                        (["--api-key", " "], "--api-key is empty"),
                                        (["--allowed-host", "box.example:80"], "--allowed-host takes")])
def test_verbs_refuse_an_open_bind_an_empty_key_and_a_bad_host_name(verb, argv, says, capsys, monkeypatch):
    monkeypatch.delenv("GLASSFORMER_API_KEY", raising=False)
    assert main([*verb, "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
