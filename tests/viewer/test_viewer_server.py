"""The explorer's server: loopback by default, size limits, only its own files, escaping."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from glassformer.cli import build_parser
from glassformer.errors import UserError
from glassformer.viewer import render
from glassformer.serve.http import Limits, Server
from glassformer.viewer.server import MAX_BODY, MAX_TEXT, Explorer, make_explorer_app, make_server

from ..support import tiny_model, WORKED_FIGURES
from ..support import fixture_trace

WORDS = ["the", "cat", "sat", "on", "mat", "<img", "src=x", "onerror=alert(1)>"]


def word_explorer() -> Explorer:
    """A tiny random model behind a word-level vocabulary, traced with the test recorder."""
    model = tiny_model()

    def encode(text):
        bad = [w for w in text.split() if w not in WORDS]
        if bad:
            raise UserError(f"unknown word {bad[0]!r}: use {', '.join(WORDS)}")
        words = text.split()
        return [WORDS.index(w) for w in words], words

    return Explorer(encode=encode, trace=lambda ids, toks: fixture_trace(model, ids, toks),
                    default_text="the cat sat on the mat", payload_args={"model_name": "tiny"})


@pytest.fixture(scope="module")
def served():
    server = make_server(word_explorer(), port=0)
    server.start_in_thread()
    yield server
    server.stop()


def request(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        res = conn.getresponse()
        return res.status, res.headers, res.read()  # header names in any case
    finally:
        conn.close()


def post_json(server, path, obj):
    return request(server, "POST", path, json.dumps(obj).encode(), {"Content-Type": "application/json"})


def test_default_bind_is_loopback():
    server = make_server(word_explorer(), port=0)
    try:
        assert server.sock.getsockname()[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()
    args = build_parser().parse_args(["view", "--worked"])
    assert args.host == "127.0.0.1"


def test_page_and_own_static_files(served):
    status, headers, body = request(served, "GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in body.decode()
    for name in ("glass.js", "glass.css"):
        status, headers, got = request(served, "GET", f"/static/{name}")
        assert status == 200
        assert got == (render.STATIC / name).read_bytes()
        assert headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("path", [
    "/static/../server.py", "/static/..%2fserver.py", "/static/%2e%2e/render.py", "/../../../etc/passwd",
    "/static/../../cli.py", "/static/page.html/..", "/static//etc/passwd", "/static/", "/server.py",
    "/static/./glass.js", "/%2e%2e/%2e%2e/etc/passwd",
])
def test_path_traversal_is_404(served, path):
    status, _, body = request(served, "GET", path)
    assert status == 404
    assert b"import" not in body and b"root:" not in body


def test_oversize_body_is_413(served):
    big = json.dumps({"text": "the " * (MAX_BODY // 4 + 10)}).encode()
    assert len(big) > MAX_BODY
    status, _, body = request(served, "POST", "/api/trace", big, {"Content-Type": "application/json"})
    assert status == 413
    assert "error" in json.loads(body)
    # A body under the byte limit whose sentence is over the character limit is refused too.
    status, _, _ = post_json(served, "/api/trace", {"text": "cat " * (MAX_TEXT // 4 + 1)})
    assert status == 413
    # A claimed length over the limit is refused before any body is read.
    status, _, _ = request(served, "POST", "/api/trace", b"{}", {"Content-Length": str(MAX_BODY + 1)})
    assert status == 413


def raw(server, data: bytes):
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sock.sendall(data)
    return sock


def read_all(sock) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    finally:
        sock.close()
    return out


def test_a_body_without_a_length_is_411(served):
    for head in (b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                 b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"):
        answer = read_all(raw(served, head))  # answered, then closed: no body is taken for a next request
        assert answer.startswith(b"HTTP/1.1 411 ") and b"Content-Length" in answer
    status, headers, body = request(served, "HEAD", "/")
    assert status == 200 and body == b"" and headers["Content-Type"].startswith("text/html")


def test_traces_are_answered_while_clients_hold_half_sent_requests():
    """The hand-written server lost requests (connection reset by peer) when 40 traces came at
    once while 20 clients held half-sent requests: its listen queue was 5 deep (http.server's
    default), so connections arriving together were reset, stalled clients or not. Now the
    queue is uvicorn's, and the stalled clients hold only their sockets, until the deadline."""
    limits = Limits(max_body=MAX_BODY, header_timeout=2.0, body_timeout=2.0)
    explorer = word_explorer()
    explorer.max_queued = 40  # all 40 traces may wait for the model at once (the cap: test_viewer_limits.py)
    app = make_explorer_app(explorer, "127.0.0.1", 0)
    server = Server(app, "127.0.0.1", 0, limits)
    server.start_in_thread()
    try:
        stalled = [raw(server, b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le") for _ in range(10)]
        stalled += [raw(server, b"POST /api/trace HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40\r\n"
                        b"Content-Type: application/json\r\n\r\n{\"te")
                    for _ in range(10)]
        texts = ["the cat sat", "the mat", "cat on the mat", "sat on mat"]
        together = threading.Barrier(40)

        def one(i):
            conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
            together.wait()  # all 40 connect at once (the old server reset about half of them)
            try:
                conn.request("POST", "/api/trace", json.dumps({"text": texts[i % len(texts)]}).encode(),
                             {"Content-Type": "application/json"})
                res = conn.getresponse()
                return res.status, res.read()
            finally:
                conn.close()

        with ThreadPoolExecutor(40) as pool:
            answers = list(pool.map(one, range(40)))
        for i, (status, body) in enumerate(answers):
            assert status == 200 and json.loads(body)["trace"]["tokens"] == texts[i % len(texts)].split()
        for sock in stalled:  # closed by the server at the deadline (recv gives b"")
            assert read_all(sock) == b""
    finally:
        server.stop()


def test_foreign_host_header_refused(served):
    for host in ("evil.example:8000", "127.attacker.example", "127.0.0.1.nip.io", "127.0.0.1.evil.com:80"):
        status, _, _ = request(served, "GET", "/", headers={"Host": host})
        assert status == 403, host
    for host in ("localhost:8000", "LOCALHOST.:8000", "127.1.2.3"):
        status, _, _ = request(served, "GET", "/", headers={"Host": host})
        assert status == 200, host


def test_trace_endpoint_recomputes(served):
    status, headers, body = post_json(served, "/api/trace", {"text": "the mat sat"})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    payload = json.loads(body)
    assert payload["trace"]["tokens"] == ["the", "mat", "sat"]
    # The endpoint's numbers are the model's: the embedding rows of the ids, and the last
    # position's logits ranked as the model ranks them.
    model = tiny_model()
    ids = [WORDS.index(w) for w in ["the", "mat", "sat"]]
    emb = torch.tensor(payload["trace"]["probes"]["embed"]["data"])
    torch.testing.assert_close(emb, model.embed.weight[ids].detach(), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    top = logits[0, -1].topk(5).indices.tolist()
    assert [c["id"] for c in payload["next"][-1]] == top


def test_bad_input_is_a_message(served):
    status, _, body = post_json(served, "/api/trace", {"text": "the dog"})
    assert status == 400 and "unknown word 'dog'" in json.loads(body)["error"]
    for bad in (b"not json", b"[1, 2]", b'{"text": 5}'):
        status, _, body = request(served, "POST", "/api/trace", bad, {"Content-Type": "application/json"})
        assert status == 400 and json.loads(body)["error"]
    status, _, _ = request(served, "POST", "/api/nothing", b"{}")
    assert status == 404
    status, _, _ = post_json(served, "/api/explain", {"text": "the cat", "probe": "embed", "index": ["x"]})
    assert status == 400


def test_a_bug_is_500_without_its_message():
    from starlette.testclient import TestClient

    def broken(ids, toks):
        raise RuntimeError("the sentence was: the cat")

    ex = Explorer(encode=lambda t: ([0], [t]), trace=broken, default_text="the cat")
    client = TestClient(make_explorer_app(ex), base_url="http://127.0.0.1", raise_server_exceptions=False)
    res = client.post("/api/trace", json={"text": "the cat"})
    assert res.status_code == 500 and res.json() == {"error": "internal error: RuntimeError"}


def test_the_routes_mount_on_another_app():
    """serve --explorer's way: the explorer's routes on an app with its own error shape and key."""
    from starlette.testclient import TestClient

    from glassformer.serve.http import MISSING_KEY, make_app
    from glassformer.viewer.server import explorer_router

    app = make_app(host="127.0.0.1", port=0, api_key="k" * 16, error_body=lambda s, m: {"error": {"message": m}})
    app.include_router(explorer_router(word_explorer()))
    client = TestClient(app, base_url="http://127.0.0.1")
    res = client.post("/api/trace", json={"text": "the mat"})  # the explorer's routes need the app's key too
    assert res.status_code == 401 and res.json() == {"error": {"message": MISSING_KEY}}
    assert client.get("/").status_code == 401
    client.headers["Authorization"] = "Bearer " + "k" * 16
    assert client.get("/").status_code == 200
    res = client.post("/api/trace", json={"text": "the mat"})
    assert res.status_code == 200 and res.json()["trace"]["tokens"] == ["the", "mat"]
    res = client.post("/api/trace", json={"text": "the dog"})  # the explorer's own errors keep their shape
    assert res.status_code == 400 and "unknown word" in res.json()["error"]
    assert client.get("/elsewhere").json() == {"error": {"message": "not found"}}  # the app's shape


def test_hostile_text_never_reaches_html_unescaped():
    ex = word_explorer()
    hostile = "<img src=x onerror=alert(1)>"
    payload = ex.payload(hostile)
    page = render.render_html(payload, inline=True)
    assert hostile not in page and "<img" not in page
    # The data block still holds the sentence exactly, for the page to show as text.
    data = re.search(r'<script type="application/json" id="glass-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data)["sentence"] == hostile
    assert json.loads(data)["trace"]["tokens"] == hostile.split()
    # And the CSP pins the one inline script by its hash: no inline handler could run.
    script_src = re.search(r"script-src ([^;]*);", page).group(1)
    assert script_src.startswith("'sha256-") and "unsafe-inline" not in script_src


def test_json_for_html_cannot_close_the_block():
    nasty = {"s": "</script><script>alert(1)</script>&\u2028"}
    text = render.json_for_html(nasty)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == nasty


# ----------------------------------------------------------------------------- the toy model, end to end

FIGURES = json.loads(WORKED_FIGURES.read_text())


def page_data(path) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="glass-data">(.*?)</script>', page, re.S).group(1))


def test_worked_server_explains_and_refuses_unknown_words():
    from glassformer.commands.view import build_explorer

    server = make_server(build_explorer(build_parser().parse_args(["view", "--worked"])), port=0)
    server.start_in_thread()
    try:
        status, _, body = request(server, "GET", "/")
        assert status == 200 and "I like cats too" in body.decode()
        status, _, body = post_json(server, "/api/explain",
                                    {"text": "I like cats too", "probe": "blocks.0.attn.weights", "index": [2, 0, 0]})
        assert status == 200
        calc = json.loads(body)
        assert calc["value"] == pytest.approx(FIGURES["head0"]["attention_weights_row_cats"][0], abs=5e-4)
        assert calc["steps"][-1]["op"] == "softmax"
        status, _, body = post_json(server, "/api/trace", {"text": "I like birds"})
        assert status == 400 and "birds" in json.loads(body)["error"]
    finally:
        server.stop()


def test_html_options_write_self_contained_pages(tmp_path):
    from glassformer.cli import main

    worked = tmp_path / "worked.html"
    assert main(["worked", "--html", str(worked)]) == 0
    data = page_data(worked)
    assert data["trace"]["tokens"] == ["I", "like", "cats", "too"]
    q = data["explain"]["blocks.0.attn.q|2,0,0"]
    assert q["value"] == pytest.approx(FIGURES["head0"]["query"]["cats"][0], abs=1e-6)
    # The pre-norm vs post-norm view holds the walkthrough's two-block RMS trajectory of cats.
    assert data["norm"]["rms"]["pre"][2] == pytest.approx(FIGURES["two_blocks_prenorm_rms_cats"], abs=5e-3)
    assert data["norm"]["rms"]["post"][2][1:] == pytest.approx([1.0] * 4, abs=1e-4)
    page = worked.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page

    traced = tmp_path / "trace.html"
    assert main(["trace", "--worked", "--attention", "tiled", "--tile", "2", "--query", "2",
                 "--html", str(traced)]) == 0
    data = page_data(traced)
    tiles = data["trace"]["probes"]["blocks.0.attn.tiles"]
    assert [t["skipped"] for t in tiles["data"]] == [False, False]
    flash = FIGURES["flash_attention_tiles_of_2_row_cats"]
    assert tiles["data"][0]["m"][0] == pytest.approx(flash["tile0"]["m"], abs=5e-4)
    assert tiles["data"][1]["alpha"][0] == pytest.approx(flash["tile1"]["alpha"], abs=5e-4)
    assert main(["trace", "--worked", "--html", str(tmp_path / "page.txt")]) == 2


def test_view_from_a_checkpoint_folder(tmp_path):
    # The path a trained model takes: a checkpoint folder with its tokenizer.json, loaded by
    # `glassformer view --checkpoint`, traced live; the toy model's weights give known numbers.
    from glassformer.worked import model as worked
    from glassformer.checkpoint.folders import save_model
    from glassformer.commands.view import build_explorer

    save_model(tmp_path / "ckpt", worked.build_one_head(), worked.TOKENIZER)
    ex = build_explorer(build_parser().parse_args(["view", "--checkpoint", str(tmp_path / "ckpt"), "--text", "I like cats"]))
    payload = ex.payload("I like cats too")
    tr = payload["trace"]
    assert tr["tokens"] == ["I", "like", "cats", "too"]
    assert tr["probes"]["blocks.0.attn.q"]["data"][2][0] == pytest.approx(FIGURES["head0"]["query"]["cats"], abs=1e-6)
    assert payload["norm"]["rms"]["pre"][2][:2] == pytest.approx([1.0, FIGURES["rms_cats"]["after_attention_residual"]], abs=5e-3)
    calc = ex.calculation("I like cats too", "blocks.0.attn.q", [2, 0, 1])
    assert calc["value"] == pytest.approx(-1.0, abs=1e-6) and "W_Q" in calc["text"]
    with pytest.raises(UserError, match="at most 16"):
        ex.payload("I " * 20)  # longer than the model's context of 16
    with pytest.raises(UserError, match="cannot read"):
        ex.payload("I like birds")  # not in the checkpoint's word-level vocabulary


@pytest.mark.parametrize("overrides", [
    {}, {"bias": True}, {"qkv_bias": True, "tie_embeddings": True}, {"pos": "learned", "ffn": "gelu", "n_kv_heads": 4},
    {"sliding_window": 3, "norm": "layer"},
])
def test_cost_formulas_shown_equal_the_estimate(overrides):
    """Each cost the page lists carries its formula with the config's numbers put in; that
    string, evaluated here on its own, gives cost.estimate's figure."""
    import math

    from glassformer.config import ModelConfig
    from glassformer.cost import estimate
    from glassformer.viewer import source
    from glassformer.viewer.cost_calc import figure

    cfg = ModelConfig.from_preset("tiny", **overrides)
    T = 7
    view = source.costs_view(cfg, T)
    r = estimate(cfg, batch=1, seq=T, dtype="fp32", hardware="h100")
    rows = {row["key"]: row for row in view["rows"]}
    # Every figure the page lists has its calculation (crossover_seq can be None: no formula then).
    assert all("calc" in row for row in view["rows"] if row["value"] is not None), \
        [k for k, row in rows.items() if "calc" not in row]
    for key, row in rows.items():
        if "calc" not in row:
            continue
        c = row["calc"]
        filled = c["substituted"]
        assert re.fullmatch(r"[0-9+\-·/(). ceil]*", filled), filled  # only numbers are left
        got = eval(filled.replace("·", "*"), {"__builtins__": {}, "ceil": math.ceil})  # noqa: S307
        want = figure(r, key)
        assert got == pytest.approx(want, rel=1e-12), (key, c["text"])
        assert c["value"] == want == row["value"] and c["result"] == pytest.approx(want, rel=1e-12)
        assert c["text"].splitlines()[1].strip() == f"= {filled}"
        for o in c["operands"]:  # each operand is a config number or another figure
            assert o["source"] == "const" and isinstance(o["value"], (int, float))


def test_rms_calculations_of_the_comparison():
    """Each RMS in the pre/post table carries explain_rms's calculation: recomputed from its
    operands it is the table's number, and its operands are the stream's own numbers."""
    from glassformer.tracing.analysis import norm_rms
    from glassformer.explaining.explain import explain, step_value
    from glassformer.tracing.stream import placement_twins
    from glassformer.viewer import source

    model = tiny_model()
    ids = [5, 9, 2, 7]
    toks = [f"w{i}" for i in ids]
    tr = source.trace_for_page(model, ids, toks)
    view = source.norm_view(placement_twins(model), ids, toks, model, tr)
    own = model.config.norm_placement
    ref = norm_rms(tr)
    for kind in ("pre", "post"):
        for t in range(len(ids)):
            for s, calc in enumerate(view["calc"][kind][t]):
                assert calc["result"] == pytest.approx(view["rms"][kind][t][s], rel=1e-6)
                assert step_value(calc["steps"][-1]) == pytest.approx(calc["value"], rel=1e-6)  # operands kept to 7 digits
                srcs = {o["source"] for term in calc["steps"][-1]["terms"] for o in term if o["label"] != "D"}
                assert srcs == ({"probe"} if kind == own else {"twin"})
    # The page model's RMS operands are the traced stream numbers, each explained in turn.
    calc = view["calc"][own][2][1]
    assert calc["value"] == pytest.approx(float(ref["rms"][1][2]), rel=1e-6)
    o = calc["steps"][-1]["terms"][0][0]
    assert o["name"] == ref["points"][1] and o["index"][0] == 2
    assert explain(tr, o["name"], o["index"], model=model).value == pytest.approx(o["value"], abs=1e-6)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only")
def test_view_verb_serves_until_ctrl_c(capsys):
    import os
    import signal

    from glassformer.cli import main

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a free port to name on the command line
    seen = []

    def client():
        for _ in range(600):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/")
                seen.append(conn.getresponse().status)
                break
            except ConnectionRefusedError:
                threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends

    threading.Thread(target=client, daemon=True).start()
    assert main(["view", "--worked", "--port", str(port)]) == 0
    out, err = capsys.readouterr()
    assert seen == [200]
    assert out.strip() == f"explorer at http://127.0.0.1:{port}/  (Ctrl-C to stop)" and err.strip() == "stopped"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only")
def test_view_verb_with_a_key_prints_the_keyed_url_and_guards_every_route(capsys, monkeypatch):
    import os
    import signal

    import httpx

    from glassformer.cli import main

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    monkeypatch.setenv("GLASSFORMER_API_KEY", "view key/5")  # serve's variable; the URL escapes it
    seen = {}

    def client():
        root = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    seen["bare"] = httpx.get(root + "/").status_code
                    break
                except httpx.ConnectError:
                    threading.Event().wait(0.05)
            seen["trace"] = httpx.post(root + "/api/trace", json={}).status_code
            with httpx.Client(base_url=root, timeout=60) as browser:  # as a browser opens the printed URL
                seen["login"] = browser.get("/?key=view%20key%2F5").status_code
                seen["page"] = browser.get("/").status_code
                seen["keyed trace"] = browser.post("/api/trace", json={}).status_code
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=client, daemon=True).start()
    assert main(["view", "--worked", "--port", str(port)]) == 0
    out, _ = capsys.readouterr()
    assert seen == {"bare": 401, "trace": 401, "login": 303, "page": 200, "keyed trace": 200}
    assert out.strip() == f"explorer at http://127.0.0.1:{port}/?key=view%20key%2F5  (Ctrl-C to stop)"
