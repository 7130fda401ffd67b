"""--optimizer muon: one step equals a direct computation of Muon's update (bf16 Newton–Schulz as
torch computes it) for the block matrices and AdamW's for the rest; a resumed Muon run is bitwise
the uninterrupted one; the refusals."""

from __future__ import annotations

import copy
import math
import os
import signal

import pytest
import torch

from glassformer.cli import main
from glassformer.config import TrainConfig
from glassformer.errors import UserError
from glassformer.train.metrics import read_metrics
from glassformer.train.optim import check_optimizer, is_block_matrix, make_muon, set_lr

from ..support import data, tiny_model  # noqa: F401  (a fixture)

LR, MUON_LR, MOMENTUM, WD, BETAS = 0.01, 0.05, 0.9, 0.1, (0.9, 0.99)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's quintic Newton–Schulz in bf16 (Keller Jordan's coefficients), wide side last."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adamw_reference(model) -> torch.optim.AdamW:
    """Plain (unfused) AdamW on the rest: decay on 2-D tensors (embedding, head), none on norms."""
    rest = [(n, p) for n, p in model.named_parameters() if not is_block_matrix(n)]
    return torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": WD},
                              {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=1e-8, foreach=False)


def test_one_muon_step_equals_its_direct_computation():
    model = tiny_model(seed=2, n_kv_heads=2, ffn_dim=96).train()
    ref = copy.deepcopy(model)
    opt, adamw = make_muon(model, LR, MUON_LR, MOMENTUM, WD, BETAS, torch.device("cpu")), adamw_reference(ref)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    y = torch.randint(0, model.config.vocab_size, (2, 16))
    grads = []
    for step in range(2):  # two steps at the schedule's rates LR/2, LR: the second reads the momentum buffer
        set_lr(opt, LR * (step + 1) / 2)
        set_lr(adamw, LR * (step + 1) / 2)
        model(x, y)[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n, p in ref.named_parameters():
            p.grad = grads[-1][n].clone()
        opt.step()
        adamw.step()
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(MUON_LR)  # the schedule scales Muon's rate with --lr's
    start = dict(tiny_model(seed=2, n_kv_heads=2, ffn_dim=96).named_parameters())  # the weights before both steps
    after = dict(model.named_parameters())
    matrices = {n for n in after if is_block_matrix(n)}
    assert {"blocks.0.attn.wk.weight", "blocks.1.ffn.w_gate.weight"} <= matrices
    assert "embed.weight" not in matrices and "lm_head.weight" not in matrices
    for name, p in ref.named_parameters():
        if name in matrices:
            want = muon_two_steps(start[name].detach(), grads[0][name], grads[1][name])
            assert torch.equal(after[name], want), name  # bitwise
        else:
            assert torch.allclose(after[name], p, rtol=0, atol=1e-7), name


def muon_two_steps(w, g1, g2):
    """Two Muon steps at the schedule's rates MUON_LR/2 and MUON_LR, written out with the same
    elementwise operations torch uses (lerp for the buffer and Nesterov's look-ahead, the bf16
    orthogonalised update added to the fp32 weight), so the result can be compared bitwise."""
    buf = torch.zeros_like(w)
    for g, lr in ((g1, MUON_LR / 2), (g2, MUON_LR)):
        buf = torch.lerp(buf, g, 1 - MOMENTUM)  # B ← μB + (1 − μ)g
        update = newton_schulz(torch.lerp(g, buf, MOMENTUM))  # Nesterov: (1 − μ)g + μB
        w = w.mul(1 - lr * WD).add(update, alpha=-lr * math.sqrt(max(1.0, w.size(0) / w.size(1))))
    return w


# ----------------------------------------------------------------------------- in a run

ARGS = ["--preset", "tiny", "--max-steps", "8", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "3", "--dropout", "0.1", "--keep-last", "10",
        "--no-progress", "--seed", "5", "--threads", "1", "--optimizer", "muon", "--muon-lr", "0.03",
        "--stats-every", "0"]


def losses(run) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_muon_resume_is_bitwise(data, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import glassformer.train.step as T

    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(ref), *ARGS]) == 0
    real, calls = T.forward_loss, {"n": 0}

    def interrupt_at_5(model, x, y):  # SIGINT during step 5: step-000005 is saved, the run exits 130
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real(model, x, y)

    monkeypatch.setattr(T, "forward_loss", interrupt_at_5)
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 130
    monkeypatch.undo()
    state = load_file(str(out / "step-000005" / "train_state.safetensors"))
    assert "optim/blocks.0.attn.wq.weight/momentum_buffer" in state  # Muon's buffers under their weights' names
    assert "optim/embed.weight/exp_avg" in state and "optim/blocks.0.attn.wq.weight/exp_avg" not in state
    assert main(["train", "--data", str(data), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert losses(out) == losses(ref)  # bitwise
    wa, wb = (load_file(str(r / "step-000008" / "model.safetensors")) for r in (ref, out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("settings, words", [
    ({"lora_r": 8, "init_from": "x"}, "--lora-r"),
    ({"optimizer": "sgd"}, "adamw or muon"),
])
def test_refused_by_name(settings, words):
    cfg = TrainConfig(**{"optimizer": "muon", **settings})
    with pytest.raises(UserError, match=words):
        check_optimizer(cfg)


def test_a_torch_without_muon_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(UserError, match="PyTorch 2.9"):
        make_muon(tiny_model(), LR, MUON_LR, MOMENTUM, WD, BETAS, torch.device("cpu"))
