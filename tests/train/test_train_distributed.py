"""torchrun with 2 CPU processes (gloo): DDP and FSDP2 match one process; checkpoints move across world sizes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassformer.checkpoint.folders import write_pointer
from glassformer.cli import main
from glassformer.train.metrics import read_metrics

from ..support import data, REPO  # noqa: F401  (a fixture)

ARGS = ["--preset", "tiny", "--max-steps", "20", "--batch-size", "4", "--seq-len", "32", "--eval-every", "10",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "3", "--keep-last", "5", "--no-progress",
        "--seed", "3", "--threads", "1"]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 0
    return out


def torchrun(out: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glassformer", "train", "--data", str(data), "--out", str(out), *ARGS, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def val_losses(run: Path) -> list[float]:
    return [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(mode, data, single, tmp_path):
    out = tmp_path / mode
    proc = torchrun(out, data, *(["--fsdp"] if mode == "fsdp" else []))
    assert proc.stderr.count("done: 20 steps") == 1  # rank 0 alone speaks
    one, two = train_losses(single), train_losses(out)
    assert len(one) == len(two) == 20
    assert two == pytest.approx(one, abs=1e-5, rel=0)
    assert val_losses(out) == pytest.approx(val_losses(single), abs=1e-5, rel=0)
    # The checkpoint holds full tensors: it loads in one process and resumes there.
    resumed = tmp_path / f"{mode}-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "step-000020")
    write_pointer(resumed, "latest", "step-000010")
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 0
    assert train_losses(resumed) == pytest.approx(one, abs=1e-5, rel=0)


def test_time_budget_under_torchrun_every_rank_plans_the_same_steps(data, tmp_path):
    """Ranks average their calibration timings, so all stop at one step (different counts would hang)."""
    import json

    from glassformer.checkpoint.folders import read_pointer

    out = tmp_path / "budget"
    proc = torchrun(out, data, "--time-budget", "6", "--calibrate-steps", "2")  # --max-steps yields to the budget
    state = json.loads((out / read_pointer(out, "latest") / "train_state.json").read_text())
    assert state["step"] == state["total_steps"] == state["time_budget_plan"]["total_steps"]
    assert proc.stderr.count(f"done: {state['step']} steps") == 1
    assert len(train_losses(out)) == state["step"]
