"""bench/moe.py runs end to end on tiny shapes: a mixture's forward against a dense model of the same
active weights, and a family's decode against transformers giving the same tokens."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .support import REPO

pytest.importorskip("transformers")


def test_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_moe", REPO / "bench" / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--smoke", "--threads", "1", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == res
    fwd = res["forward"]
    assert fwd["1x64"]["ratio"] > 0 and fwd["dense_weights"] < fwd["moe_weights"]
    # the mixture's active weights: the dense model's plus the routers (E·D a layer), nothing more
    assert fwd["moe_active_weights"] - fwd["dense_weights"] == 6 * 8 * 64
    dec = res["decode"]["mixtral"]
    assert dec["same_tokens"] and dec["ours_tok_s"] > 0 and dec["hf_tok_s"] > 0
