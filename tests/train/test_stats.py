"""Per-layer statistics (--stats-every): equal to a direct recomputation, and free of side effects
on the run (same losses and weights with them on at every step as with them off)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.tracing.trace import trace
from glassformer.train.metrics import read_metrics
from glassformer.train.stats import held_out_batch, layer_stats, weights_before

from ..support import data, tiny_model  # noqa: F401  (a fixture)

ARGS = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "1",
        "--eval-tokens", "512", "--log-every", "1", "--warmup-steps", "2", "--dropout", "0.1", "--keep-last", "10",
        "--no-progress", "--seed", "3", "--threads", "1"]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    """The same run with statistics after every step, and with them off."""
    root = tmp_path_factory.mktemp("stats")
    on, off = root / "on", root / "off"
    assert main(["train", "--data", str(data), "--out", str(on), *ARGS, "--stats-every", "1"]) == 0
    assert main(["train", "--data", str(data), "--out", str(off), *ARGS, "--stats-every", "0"]) == 0
    return on, off


def entropy_by_hand(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per-head mean entropy of causal softmax(q·k/√H) from a trace's rotated q (T, N, H), k (T, K, H)."""
    T, N, H = q.shape
    k = np.repeat(k, N // k.shape[1], axis=1)  # (T, N, H)
    s = np.einsum("tnh,snh->nts", q, k) / math.sqrt(H)  # (N, T, T)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(-1).mean(-1)  # (N,)


def recompute(model, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The statistics by other means: a plain mean cross-entropy's gradients, and trace()'s probes per row."""
    m = copy.deepcopy(model).eval()
    _, loss = m(x, y)
    loss.backward()
    grad = {n: float(p.grad.norm()) for n, p in m.named_parameters()}
    rms, ent = {}, {}
    traces = [trace(model, row.tolist()) for row in x]
    for name in traces[0].probes:
        if name == "embed" or name.endswith(("resid_mid", "resid_out")):
            rms[name] = float(np.mean([np.sqrt((t[name].double().numpy() ** 2).mean(-1)).mean() for t in traces]))
    for i in range(model.config.n_layers):
        a = f"blocks.{i}.attn"
        ent[a] = np.mean([entropy_by_hand(t[a + ".q_rot"].double().numpy(), t[a + ".k_rot"].double().numpy())
                          for t in traces], axis=0)
    return {"grad_norm": grad, "stream_rms": rms, "attn_entropy": ent}


def test_layer_stats_equal_a_direct_recomputation():
    model = tiny_model(seed=1)
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    y = torch.randint(0, model.config.vocab_size, (2, 12))
    before = weights_before(model)
    with torch.no_grad():
        model.blocks[0].attn.wq.weight.mul_(1.5)  # an "update": RMS(ΔW)/RMS(W) = 0.5
    got = layer_stats(model, x, y, before)
    want = recompute(model, x, y)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["stream_rms"].keys() == want["stream_rms"].keys()
    assert got["stream_rms"] == pytest.approx(want["stream_rms"], rel=1e-6)
    for name, heads in want["attn_entropy"].items():
        assert got["attn_entropy"][name] == pytest.approx(heads.tolist(), rel=1e-5, abs=1e-7)
    assert got["update_rms_ratio"]["blocks.0.attn.wq.weight"] == pytest.approx(0.5, rel=1e-7)  # fp32 rounding of 1.5·w
    assert got["update_rms_ratio"]["blocks.0.attn.wk.weight"] == 0.0
    assert all(p.grad is None for p in model.parameters())  # nothing left for the next step to add to


def test_statistics_leave_the_run_unchanged(runs):
    on, off = runs
    a, b = read_metrics(on / "metrics.jsonl"), read_metrics(off / "metrics.jsonl")
    assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r]  # bitwise
    from safetensors.torch import load_file

    wa, wb = (load_file(str(r / "step-000004" / "model.safetensors")) for r in runs)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not any("stats" in r for r in b)


def test_logged_statistics_equal_a_recomputation_from_the_checkpoints(runs, data):
    on, _ = runs
    rows = {r["step"]: r["stats"] for r in read_metrics(on / "metrics.jsonl") if "stats" in r}
    assert sorted(rows) == [1, 2, 3, 4]
    logged = rows[3]
    assert set(logged) == {"grad_norm", "update_rms_ratio", "stream_rms", "attn_entropy"}
    model, _ = load(on / "step-000003")
    prev, _ = load(on / "step-000002")
    val = np.fromfile(data / "val.bin", dtype=np.uint16)[:513]
    x, y = held_out_batch(val, 32)
    assert x.shape == (8, 32)
    want = recompute(model, x, y)
    assert logged["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert logged["stream_rms"] == pytest.approx(want["stream_rms"], rel=1e-6)
    for name, heads in want["attn_entropy"].items():
        assert logged["attn_entropy"][name] == pytest.approx(heads.tolist(), rel=1e-5, abs=1e-7)
    w3, w2 = model.state_dict(), prev.state_dict()
    for name, ratio in logged["update_rms_ratio"].items():
        d = (w3[name] - w2[name]).double()
        assert ratio == pytest.approx(float(d.pow(2).mean().sqrt() / w2[name].double().pow(2).mean().sqrt()), rel=1e-6)


def test_the_default_interval_is_the_evaluation_interval():
    from types import SimpleNamespace

    from glassformer.config import TrainConfig
    from glassformer.train.distributed import Dist
    from glassformer.train.stats import due

    def steps(**kw):
        run = SimpleNamespace(cfg=TrainConfig(**kw), d=Dist(), total_steps=12)
        return [s for s in range(1, 13) if due(run, s)]

    assert steps(eval_every=5) == [5, 10, 12]  # and the last step
    assert steps(eval_every=5, stats_every=4) == [4, 8, 12]
    assert steps(eval_every=5, stats_every=0) == []
    assert steps(eval_every=0) == [12]
