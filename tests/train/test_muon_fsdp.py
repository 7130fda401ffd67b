"""--optimizer muon under --fsdp: two processes (torchrun, gloo), each holding row shards of every
matrix, train as one process does (losses and weights to 1e-5), with matrices whose rows do not
split evenly (ffn_dim 175: shards of 88 and 87 rows) so the padding of the gather is exercised.

Muon's Newton-Schulz runs in bf16, where a last-bit difference in a gradient can flip a rounding
and grow to 1e-4 in the loss within a few steps (DDP against one process does that too). So the
one-process run takes the arithmetic path the two take: micro-batches of each rank's 2 rows
(halving is exact, so (g0 + g1)/2 is the same sum either way) and foreach AdamW, which FSDP2's
DTensors use, instead of the fused kernel one process would pick."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from glassformer.checkpoint.folders import write_pointer
from glassformer.cli import main
from glassformer.train.metrics import read_metrics

from ..support import data, REPO  # noqa: F401  (a fixture)

ARGS = ["--preset", "tiny", "--model", "ffn_dim=175", "--max-steps", "6", "--batch-size", "4", "--seq-len", "32",
        "--eval-every", "3", "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "2", "--no-progress",
        "--seed", "4", "--threads", "1", "--optimizer", "muon", "--muon-lr", "0.05", "--stats-every", "0"]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


class ForeachAdamW(torch.optim.AdamW):
    def __init__(self, *args, fused=None, foreach=None, **kwargs):
        super().__init__(*args, foreach=True, **kwargs)


def test_fsdp_muon_two_processes_match_one(data, tmp_path, monkeypatch):
    one, two = tmp_path / "one", tmp_path / "two"
    with monkeypatch.context() as m:
        m.setattr(torch.optim, "AdamW", ForeachAdamW)
        assert main(["train", "--data", str(data), "--out", str(one), *ARGS, "--micro-batch", "2"]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glassformer", "train", "--data", str(data), "--out", str(two), *ARGS, "--fsdp"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6
    assert b == pytest.approx(a, abs=1e-5, rel=0)
    wa, wb = (load_file(str(r / "step-000006" / "model.safetensors")) for r in (one, two))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5), k
    # Their step-3 checkpoint (full tensors: the sharded momentum buffers gathered by name) resumes
    # in one process, under torch.optim.Muon, and goes on as the two did.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    shutil.rmtree(resumed / "step-000006")
    write_pointer(resumed, "latest", "step-000003")
    with monkeypatch.context() as m:
        m.setattr(torch.optim, "AdamW", ForeachAdamW)
        assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress",
                     "--micro-batch", "2"]) == 0
    assert losses(resumed) == pytest.approx(b, abs=1e-5, rel=0)
