"""bench/gpu.py, the GPU goals' benchmark, checked end to end on tiny shapes (on the CPU here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_script_runs_and_compares_like_for_like(tmp_path, one_thread):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--smoke", "--rounds", "1", "--out", str(tmp_path / "gpu.json")])
    train, decode = res["train"], res["decode"]
    # The Hugging Face twins hold our weights: the same first loss, the same greedy tokens.
    losses = [r["first_loss"] for r in train["rows"].values()]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # ours with and without run-ahead, theirs: all the same tokens, from a session that never recompiled
    assert decode["identical_tokens"]
    assert set(decode["rows"]) == {"glassformer", "glassformer, no run-ahead", "transformers"}
    assert decode["recompiles"] == 0
    # The profiled steps: the costliest host operations' own time fits within the wall time (both per step).
    for prof, steps in ((train["step_profile"], 3), (decode["step_profile"], 4)):
        assert prof["steps"] == steps and 0 < sum(prof["top_host_ops_us_per_step"].values()) <= prof["wall_us_per_step"]
    assert all(r["tokens_per_s"] > 0 for r in [*train["rows"].values(), *decode["rows"].values()])
    head = train["head_product"]  # the padded and the plain head product, each timed
    assert set(head["ms"]) == {"plain", "padded to a multiple of 64"} and all(v > 0 for v in head["ms"].values())
    assert (tmp_path / "gpu.json").is_file()
