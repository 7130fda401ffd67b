"""The explorer's patching and attribution view: POST /api/patch and /api/attribute answer what the
CLI's --json prints, bad requests are one-line 400s, and the page loads research.js."""

from __future__ import annotations

import numpy as np
import pytest

from glassformer.research.reports import attribute_report, patch_report
from ..support import tiny_checkpoint

TEXT = "the cat sat on the mat. the dog sat on the log. "


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from starlette.testclient import TestClient

    from glassformer.viewer.server import make_explorer_app
    from glassformer.viewer.source import explorer

    model, tok = tiny_checkpoint(tmp_path_factory.mktemp("view") / "ckpt", TEXT * 20)
    ex = explorer(model, tok, "the cat sat on the", model_name="tiny")
    c = TestClient(make_explorer_app(ex), base_url="http://127.0.0.1", raise_server_exceptions=False)
    c.model, c.tok = model, tok
    return c


def test_patch_and_attribute_answer_what_the_cli_prints(client):
    req = {"clean": "the cat sat on the", "corrupt": "the dog sat on the", "answer": " mat", "wrong": " log",
           "site": "z", "method": "both"}
    res = client.post("/api/patch", json=req)
    assert res.status_code == 200, res.text
    body = res.json()
    want = patch_report(client.model, client.tok, **req)
    np.testing.assert_allclose(body["grid"], want["grid"], atol=1e-6)
    assert body["site"] == "z" and np.shape(body["grid"]) == (2, 4)
    assert body["clean"] == pytest.approx(want["clean"]) and body["correlation"] == pytest.approx(want["correlation"])
    res = client.post("/api/attribute", json={"text": "the cat sat on the", "answer": " mat", "wrong": " log"})
    assert res.status_code == 200, res.text
    parts = res.json()["parts"]
    assert parts == pytest.approx(attribute_report(client.model, client.tok, "the cat sat on the", " mat", " log")["parts"])


@pytest.mark.parametrize("route, req, says", [
    ("/api/patch", {"clean": "the cat", "corrupt": "the cat sat on", "answer": " mat", "wrong": " log"}, "clean is"),
    ("/api/patch", {"clean": "a", "corrupt": "b", "answer": " mat", "wrong": " log", "site": "q"}, "the sites are"),
    ("/api/patch", {"clean": "a", "corrupt": "b", "answer": " mat", "wrong": " log", "layer": 1}, "unknown field"),
    ("/api/attribute", {"text": "the cat", "answer": "the mat", "wrong": " log"}, "answer"),
    ("/api/attribute", {"text": "the cat", "answer": " mat", "wrong": 3}, "wrong must be a string"),
])
def test_bad_requests_are_one_line(client, route, req, says):
    res = client.post(route, json=req)
    assert res.status_code == 400
    err = res.json()["error"]
    assert says in err and "\n" not in err


def test_the_page_loads_the_view(client):
    page = client.get("/").text
    assert 'src="static/research.js"' in page and 'id="view-research"' in page
    js = client.get("/static/research.js")
    assert js.status_code == 200 and "api/patch" in js.text
