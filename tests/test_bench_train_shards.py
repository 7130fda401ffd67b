"""bench/train_shards.py (scripts/gpu_checks.sh's training run from shards made on the machine)
runs end to end on the CPU at tiny shapes: a JSONL corpus, several llm.c shards, a training run,
and the figures it reports taken from that run."""

from __future__ import annotations

import importlib.util
import json

from .support import REPO


def test_smoke_run_reports_from_its_own_shards(tmp_path):
    spec = importlib.util.spec_from_file_location("train_shards", REPO / "bench" / "train_shards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--smoke", "--out", str(tmp_path / "r.json"), "--work", str(tmp_path / "work")])
    assert json.loads((tmp_path / "r.json").read_text()) == res
    assert len(res["train_shards"]) >= 2 and res["train_shards"][0] == "train_000000.bin"
    assert res["tok_s_median"] > 0 and 0 < res["loader_share"] < 1 and res["mfu_median"] > 0
    assert res["final_loss"] < 6.3  # it trained: a 512-id vocabulary starts near ln 512 = 6.24
    assert not (tmp_path / "work" / "run").exists()  # the run folder is removed; the shards stay with --work
    assert (tmp_path / "work" / "data" / "train_000000.bin").is_file()
