"""`glassformer serve` as a user runs it: the one ready line (port 0 named), a request answered,
the explorer beside it (--explorer), a clean stop on Ctrl-C; a non-loopback bind without a key refuses to start; /health says 503
while the model loads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from glassformer.cli import main
from glassformer.serve.backend import Backend
from glassformer.serve.http import make_app
from glassformer.serve.openai import add_routes, openai_error

from ..support import REPO, synthetic_text, tiny_checkpoint


@pytest.mark.parametrize("argv", [["--host", "0.0.0.0"], ["--host", "192.168.1.2", "--api-key", ""]])
def test_a_non_loopback_bind_without_a_key_refuses_to_start(argv, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("GLASSFORMER_API_KEY", raising=False)
    assert main(["serve", "--checkpoint", str(tmp_path / "none"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("--api-key" in err) and "Traceback" not in err


@pytest.mark.parametrize("flag, value, says", [("--max-batch", "0", "--max-batch must be >= 1"),
                                               ("--stream-interval-ms", "-1", "--stream-interval-ms must be between")])
def test_bad_flags_are_refused_before_anything_listens(flag, value, says, capsys, tmp_path):
    assert main(["serve", "--checkpoint", str(tmp_path), flag, value]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_health_is_503_while_loading():
    backend = Backend("m")
    app = add_routes(make_app(host="127.0.0.1", port=0, error_body=openai_error), backend)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert (client.get("/health").status_code, client.get("/health").json()) == (503, {"status": "loading"})
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_serve_prints_one_ready_line_answers_with_the_explorer_and_stops_on_ctrl_c(tmp_path):
    tiny_checkpoint(tmp_path / "ckpt", synthetic_text(200, 1))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GLASSFORMER_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "glassformer", "serve", "--checkpoint", str(tmp_path / "ckpt"),
                             "--port", "0", "--explorer"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline()
        found = re.fullmatch(r"serving ckpt at (http://127\.0\.0\.1:(\d+)/v1)\n", line)
        assert found and int(found[2]) > 0, line + proc.stderr.read() if not found else ""
        client = openai.OpenAI(base_url=found[1], api_key="unused", max_retries=0)
        assert client.completions.create(model="ckpt", prompt="The king", max_tokens=3).usage.completion_tokens >= 1
        root = found[1].removesuffix("/v1")
        assert httpx.get(root + "/health").json() == {"status": "ok"}
        page = httpx.get(root + "/")  # --explorer: the explorer's page on the same app, over the served model
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        traced = httpx.post(root + "/api/trace", json={"text": "The king"}, timeout=60).json()
        assert traced["trace"]["ids"] and client.completions.create(model="ckpt", prompt="x", max_tokens=2).choices
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "" and "Traceback" not in err


def test_serve_explorer_with_a_key_guards_the_explorer_too(tmp_path):
    """The issue's reproduction: with --explorer and --api-key, /api/generate answered 200 to anyone."""
    tiny_checkpoint(tmp_path / "ckpt", synthetic_text(200, 1))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GLASSFORMER_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "glassformer", "serve", "--checkpoint", str(tmp_path / "ckpt"),
                             "--port", "0", "--explorer", "--api-key", "k"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, keyed = proc.stdout.readline(), proc.stdout.readline()
        found = re.fullmatch(r"serving ckpt at (http://127\.0\.0\.1:\d+)/v1\n", ready)
        assert found, ready + keyed + (proc.stderr.read() if not keyed else "")
        root = found[1]
        assert keyed == f"explorer at {root}/?key=k\n"
        body = {"text": "hi", "max_tokens": 3}
        assert httpx.post(root + "/api/generate", json=body, timeout=60).status_code == 401
        assert httpx.get(root + "/").status_code == 401 and httpx.get(root + "/v1/models").status_code == 401
        assert httpx.get(root + "/health").json() == {"status": "ok"}  # the one open route
        key = {"Authorization": "Bearer k"}
        assert httpx.post(root + "/api/generate", json=body, headers=key, timeout=60).status_code == 200
        with httpx.Client(base_url=root, timeout=60) as browser:  # the printed URL, as a browser opens it
            assert browser.get(keyed.strip().removeprefix("explorer at ")).status_code == 303
            assert browser.get("/").status_code == 200 and browser.post("/api/generate", json=body).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out == "" and "Traceback" not in err
