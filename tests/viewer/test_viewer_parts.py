"""The explorer's answer to a sentence and the parts a live page asks for later
(viewer/source.py LiveParts): what one answer computes is bounded (counted, not timed), and
the parts asked for later are the tiled kernel's own walks, equal to attention computed
directly from the traced q, k, v and to the RMS of the traced stream."""

from __future__ import annotations

import http.client
import json
import math
from collections import Counter

import pytest
import torch

from glassformer.errors import UserError
from glassformer.tracing import tiles
from glassformer.viewer import render, source
from glassformer.viewer.server import make_server

from ..support import NumberTokenizer, tiny_model

IDS = [5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10, 12]  # 12 tokens: the page offers tiles of 1, 2, 4 and 8
TEXT = " ".join(map(str, IDS))


@pytest.fixture(scope="module", params=[None, 3], ids=["causal", "window3"])
def live(request):
    model = tiny_model(sliding_window=request.param)
    ex = source.explorer(model, NumberTokenizer(), TEXT, model_name="tiny")
    return model, ex, ex.payload(TEXT)


def _counting(monkeypatch, counts, module, name):
    fn = getattr(module, name)

    def counted(*a, **k):
        counts[name] += 1
        return fn(*a, **k)

    monkeypatch.setattr(module, name, counted)


def test_one_answer_does_a_bounded_amount_of_work(monkeypatch):
    """An answer runs the tiled kernel once per layer (the trace's own run) and no more, reads
    walks out of that run only, and explains the RMS of one token's row of the pre/post table,
    however long the sentence: the same counts at 6 and at 12 tokens. (Walks of every row at
    every tile size, and the RMS calculations of every token, were 7 and 32 times what is
    drawn at first for the `small` preset at 32 tokens.)"""
    model = tiny_model()
    ex = source.explorer(model, NumberTokenizer(), "1 2", model_name="tiny")
    per_length = []
    for n in (6, 12):
        counts: Counter = Counter()
        _counting(monkeypatch, counts, tiles, "tiled_attention")  # kernel_log: a run besides the model's own
        _counting(monkeypatch, counts, source, "head_walks")
        _counting(monkeypatch, counts, render, "head_walk")
        _counting(monkeypatch, counts, source, "explain_rms")
        payload = ex.payload(" ".join(map(str, IDS[:n])))
        monkeypatch.undo()
        steps = len(payload["norm"]["steps"])
        cfg = model.config
        assert counts == {"head_walk": cfg.n_layers * cfg.n_heads, "explain_rms": 2 * steps}, counts
        per_length.append(counts)
        # What was not computed is asked for by name; only the focus row's calculations are in.
        assert payload["norm"]["fetch"] == "norm.calc" and payload["flash"]["fetch"] == "flash.walks"
        for kind, rows in payload["norm"]["calc"].items():
            assert [t for t, row in enumerate(rows) if row is not None] == [n - 1], kind
        assert {w["query"] for w in payload["flash"]["walks"].values()} == {n - 1}
    assert per_length[0] == per_length[1]


def _attention_row(payload, layer, head, row, window):
    """Scaled scores, weights and output of one query row, straight from the traced q, k, v."""
    probes, cfg = payload["trace"]["probes"], payload["trace"]["config"]
    q, k, v = (torch.tensor(probes[f"blocks.{layer}.attn.{n}"]["data"], dtype=torch.float64) for n in ("q_rot", "k_rot", "v"))
    kv = head // (cfg["n_heads"] // cfg["n_kv_heads"])
    s = k[:, kv] @ q[row, head] / math.sqrt(cfg["head_dim"])  # (T,)
    j = torch.arange(len(s))
    seen = (j <= row) & ((row - j < window) if window else True)
    w = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    return s, seen, w @ v[:, kv]


@pytest.mark.parametrize("row", [0, 5, 11])
def test_walks_asked_for_are_attention_itself(live, row):
    """Every layer's and head's walk of a row at every tile size the page offers, asked for as
    the page does: each tile's scores are the traced q·k/√H (None where masked), the last m and
    l the row's max and Σ exp(s − m), and the output softmax(s)·v."""
    model, ex, payload = live
    window = model.config.sliding_window
    for tile in payload["flash"]["tiles"]:
        walks = ex.calculation(TEXT, "flash.walks", [row, tile])["walks"]
        assert len(walks) == model.config.n_layers * model.config.n_heads
        for key, w in walks.items():
            layer, head, r, t = map(int, key.split("|"))
            assert (r, t, w["head"], w["tile_size"]) == (row, tile, head, tile)
            s, seen, out = _attention_row(payload, layer, head, row, window)
            live_steps = [st for st in w["steps"] if not st["skipped"]]
            assert [st["k"] for st in w["steps"]][-1][1] == len(IDS) and live_steps
            for st in live_steps:
                k0, k1 = st["k"]
                want = [float(s[j]) if seen[j] else None for j in range(k0, k1)]
                assert [x is None for x in st["scores"]] == [x is None for x in want]
                assert [x for x in st["scores"] if x is not None] == pytest.approx([x for x in want if x is not None], abs=1e-4)
            m = float(s[seen].max())
            assert live_steps[-1]["m"] == pytest.approx(m, abs=1e-4)
            assert live_steps[-1]["l"] == pytest.approx(float(torch.exp(s[seen] - m).sum()), rel=1e-4)
            assert w["output"] == pytest.approx(out.tolist(), abs=1e-4)


def test_the_rerun_kernel_walks_as_the_models_own_run(live):
    """The focus row's walks in the answer come from the trace's own run of the tiled kernel;
    the same row asked for later (the kernel run again over the traced q, k, v) is the same."""
    model, ex, payload = live
    tile, focus = payload["flash_tile"], len(IDS) - 1
    own = payload["flash"]["walks"]
    again = ex.calculation(TEXT, "flash.walks", [focus, tile])["walks"]
    assert sorted(own) == sorted(again)
    for key in own:
        assert [st["skipped"] for st in own[key]["steps"]] == [st["skipped"] for st in again[key]["steps"]]
        assert again[key]["output"] == pytest.approx(own[key]["output"], abs=1e-5)


def test_rms_calculations_asked_for_are_the_streams(live):
    """Another token's row of the pre/post table, asked for later: each calculation's value is
    the table's RMS, and for the page's own model √(mean x²) of the traced stream vector."""
    model, ex, payload = live
    own = model.config.norm_placement
    for t in (0, 4):
        rows = ex.calculation(TEXT, "norm.calc", [t])
        assert sorted(rows) == ["post", "pre"]
        for kind, calcs in rows.items():
            assert len(calcs) == len(payload["norm"]["steps"])
            for s, calc in enumerate(calcs):
                assert calc["result"] == pytest.approx(payload["norm"]["rms"][kind][t][s], rel=1e-5)
        for calc in rows[own]:
            name = calc["steps"][-1]["terms"][0][0]["name"]
            x = torch.tensor(payload["trace"]["probes"][name]["data"][t], dtype=torch.float64)
            assert calc["value"] == pytest.approx(float(x.pow(2).mean().sqrt()), rel=1e-5)


def test_parts_refuse_what_the_page_cannot_show(live):
    _, ex, _ = live
    for probe, index in (("flash.walks", [12, 2]), ("flash.walks", [3, 3]), ("flash.walks", [3]),
                         ("norm.calc", [-1]), ("norm.calc", [0, 1])):
        with pytest.raises(UserError):
            ex.calculation(TEXT, probe, index)


def test_parts_over_http(live):
    """The page asks through POST /api/explain, the part's name in `probe`."""
    _, ex, _ = live
    server = make_server(ex, port=0)
    server.start_in_thread()
    try:
        def ask(probe, index):
            conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
            conn.request("POST", "/api/explain", body=json.dumps({"text": TEXT, "probe": probe, "index": index}),
                         headers={"Content-Type": "application/json"})
            res = conn.getresponse()
            body = json.loads(res.read())
            conn.close()
            return res.status, body

        status, body = ask("flash.walks", [3, 2])
        assert status == 200 and {w["query"] for w in body["walks"].values()} == {3}
        status, body = ask("norm.calc", [2])
        assert status == 200 and body["pre"][0]["label"].startswith("RMS(") and body["pre"][0]["index"] == [2]
        status, body = ask("flash.walks", [3, 5])
        assert status == 400 and "tiles of 5" in body["error"]
    finally:
        server.stop()
