"""--activation-checkpointing: the loss and every gradient are the plain run's, bit for bit (dropout
included: checkpoint replays the RNG); what the forward keeps is each block's input, and with one
block's recomputed activations that is what `cost --activation-checkpointing` counts; a training
run with the flag gives the plain run's losses."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from glassformer.cli import main
from glassformer.config import ModelConfig
from glassformer.cost import activations
from glassformer.model import Block, Transformer
from glassformer.train.metrics import read_metrics
from glassformer.train.recompute import checkpoint_blocks

from ..support import data  # noqa: F401  (a fixture)


def model_pair(**overrides) -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    plain = Transformer(ModelConfig.from_preset("tiny", **overrides)).train()
    recomputed = copy.deepcopy(plain)
    assert checkpoint_blocks(recomputed) == plain.config.n_layers and checkpoint_blocks(recomputed) == 0
    return plain, recomputed


def test_loss_and_gradients_are_the_plain_runs():
    plain, recomputed = model_pair(dropout=0.1)
    assert all(isinstance(b, Block) for b in recomputed.blocks)
    assert recomputed.state_dict().keys() == plain.state_dict().keys()
    idx = torch.randint(0, plain.config.vocab_size, (2, 48))
    losses = []
    for m in (plain, recomputed):
        torch.manual_seed(1)  # the same dropout noise, drawn in the forward and replayed in the recomputation
        loss = m(idx, idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        assert torch.equal(a.grad, b.grad), name


def held_after_forward(model: Transformer, idx: torch.Tensor, inside_block: int | None = None) -> int:
    """Floating-point elements the forward leaves for backward, each storage once, weights not
    counted: what autograd's saved-tensor hooks see, plus the blocks' inputs (checkpoint keeps
    those itself, out of the hooks' sight). inside_block: only what block i saves (plain model)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}
    where = {"block": None}

    def keep(t):
        s = t.untyped_storage()
        if t.dtype.is_floating_point and s.data_ptr() not in skip and (inside_block is None or where["block"] == inside_block):
            seen.setdefault(s.data_ptr(), s.nbytes() // t.element_size())

    hooks = []
    for i, b in enumerate(model.blocks):
        def pre(mod, args, i=i):
            where["block"] = i
            if inside_block is None and getattr(mod, "recomputed", False):
                keep(args[0])  # the block's input (B, T, D), held by checkpoint for the recomputation
        hooks += [b.register_forward_pre_hook(pre), b.register_forward_hook(lambda *a: where.update(block=None))]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (keep(t), t)[1], lambda t: t):
        model(idx, idx)
    for h in hooks:
        h.remove()
    return sum(seen.values())


@pytest.mark.parametrize("n_layers", [2, 6])
def test_what_is_held_is_what_cost_counts(n_layers):
    plain, recomputed = model_pair(n_layers=n_layers)
    B, T = 2, 64
    idx = torch.randint(0, plain.config.vocab_size, (B, T))
    full = held_after_forward(plain, idx)
    one_block = held_after_forward(plain, idx, inside_block=0)  # what one recomputation holds at once
    peak = held_after_forward(recomputed, idx) + one_block
    cfg = plain.config
    assert activations(cfg, B, T)["total"] == pytest.approx(full, rel=0.15)
    assert activations(cfg, B, T, recompute=True)["total"] == pytest.approx(peak, rel=0.15)
    assert activations(cfg, B, T, recompute=True)["block_inputs"] == n_layers * B * T * cfg.dim
    assert peak < full * (0.8 if n_layers == 2 else 0.5)  # the saving grows with depth


def test_cost_flag(capsys):
    args = ["cost", "--preset", "gpt2-124m", "--batch", "16", "--seq", "1024", "--json"]
    reports = []
    for extra in ([], ["--activation-checkpointing"]):
        assert main([*args, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    plain, ckpt = reports
    assert not plain["inputs"]["activation_checkpointing"] and ckpt["inputs"]["activation_checkpointing"]
    assert plain["activations_by_part"]["block_inputs"] == 0
    assert ckpt["activation_bytes"] < plain["activation_bytes"] / 1.9 and ckpt["max_batch"] > plain["max_batch"]
    assert ckpt["params"] == plain["params"] and ckpt["flops_train_step"] == plain["flops_train_step"]


ARGS = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "2", "--dropout", "0.1", "--no-progress",
        "--seed", "6", "--threads", "1", "--stats-every", "0"]


def test_a_training_run_with_the_flag_is_the_plain_run(data, tmp_path, monkeypatch):
    import glassformer.train.recompute as R

    calls = []
    monkeypatch.setattr(R, "checkpoint", lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    runs = {}
    for name, extra in (("plain", []), ("recomputed", ["--activation-checkpointing"])):
        assert main(["train", "--data", str(data), "--out", str(tmp_path / name), *ARGS, *extra]) == 0
        runs[name] = [(r.get("loss"), r.get("val_loss")) for r in read_metrics(tmp_path / name / "metrics.jsonl")]
        assert len(calls) == (0 if name == "plain" else 4 * 2)  # 4 steps × 2 blocks, none while evaluating
    assert runs["recomputed"] == runs["plain"] and len(runs["plain"]) >= 4
