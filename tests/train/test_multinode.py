"""Two "nodes" on this machine: two torchrun launches of one process each meeting through a c10d
rendezvous on 127.0.0.1 (gloo), as `docs/training.md#past-one-machine` runs them on two machines.
They resume a one-process run's dcp checkpoint (1 -> 2 processes) and must give its losses within
1e-5, with rank 0 alone speaking and each node's process writing its own shards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from glassformer.checkpoint.folders import write_pointer
from glassformer.cli import main

from ..support import REPO, data  # noqa: F401  (a fixture)
from .test_train_distributed import ARGS, train_losses, val_losses

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(node_rank: int, port: int, out, data, *extra: str) -> subprocess.Popen:
    """One node's torchrun, exactly the multi-node command of the docs (--nnodes 2, c10d rendezvous)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "glassformer-test", "-m", "glassformer", "train", "--data", str(data), "--out", str(out),
           *ARGS, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # a one-process run, then two torchrun launches: about 20 s on 2 busy cores
def test_two_nodes_resume_a_one_process_run(data, tmp_path):
    """1 -> 2 across nodes: a one-process dcp run cut back to its step-10 checkpoint is resumed by
    two nodes of one process each; steps 11-20 must be the uninterrupted run's."""
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--checkpoint-format", "dcp"]) == 0
    want_train, want_val = train_losses(out), val_losses(out)
    shutil.rmtree(out / "step-000020")
    write_pointer(out, "latest", "step-000010")
    port = free_port()
    nodes = [launch(r, port, out, data, "--resume") for r in (0, 1)]
    errs = []
    for node in nodes:
        try:
            _, err = node.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
        errs.append(err)
        assert node.returncode == 0, err[-3000:]
    assert sum(e.count("done: 20 steps") for e in errs) == 1  # one rank 0 across both nodes speaks
    assert sum("2 process(es)" in e for e in errs) == 1  # the world is both nodes' processes
    assert train_losses(out) == pytest.approx(want_train, abs=1e-5, rel=0)
    assert val_losses(out) == pytest.approx(want_val, abs=1e-5, rel=0)
    shards = sorted(p.name for p in (out / "step-000020" / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each node's process wrote its own file
