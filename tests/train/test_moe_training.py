"""Training a mixture of experts: the load-balancing loss joins the step's gradient (Switch/Mixtral form,
times router_aux_loss_coef), and a run logs it with each expert's load into metrics.jsonl, which the
Training view reads."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.moe import aux_loss, expert_load
from glassformer.train.metrics import read_metrics
from glassformer.train.step import train_step
from glassformer.viewer.training import training_payload

from ..support import data  # noqa: F401  (a fixture)

MOE = dict(n_experts=4, n_active_experts=2)


def tiny_moe(coef: float, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_preset("tiny", dropout=0.0, router_aux_loss_coef=coef, **MOE))


def batch(model: Transformer, rows: int = 4, T: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def reference_grads(model: Transformer, x, y, coef: float) -> tuple[dict, float]:
    """Autograd of the mean cross-entropy + coef · the summed aux loss of the same forward."""
    model = copy.deepcopy(model)
    logits, _ = model(x)
    aux = aux_loss(model)
    (F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)) + coef * aux).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, float(aux.detach())


@pytest.mark.parametrize("accum", [1, 2])
def test_the_step_descends_cross_entropy_plus_the_aux_loss(accum):
    model = tiny_moe(coef=0.5)
    x, y = batch(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads, aux = reference_grads(model, x, y, 0.5)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), x, y, accum=accum)
    assert res.stepped and res.aux_loss is not None
    if accum == 1:
        assert res.aux_loss == pytest.approx(aux, rel=1e-6)
    # E·Σ f·P is k = 2 when the load is perfectly even and grows as it concentrates; between 1 and E·k per layer.
    assert 2 * 2 * 0.99 <= res.aux_loss <= 2 * 4 * 2
    router = "blocks.0.ffn.router.weight"
    if accum == 1:  # (with 2 micro-batches the aux loss is each half's, so the gradient differs on purpose)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n], rtol=1e-5, atol=1e-6, msg=n)
    # Without the coefficient the router moves by the cross-entropy's gradient alone: a different update.
    plain = tiny_moe(coef=0.0)
    res0 = train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.5), x, y, accum=accum)
    assert res0.aux_loss is None
    assert not torch.allclose(plain.state_dict()[router], model.state_dict()[router])


def test_a_dense_step_reports_no_aux_loss():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", router_aux_loss_coef=0.5))  # no experts: nothing to balance
    x, y = batch(model)
    assert train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y).aux_loss is None


def test_a_moe_run_learns_and_logs_each_experts_load(data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--preset", "tiny", "--model",
            "n_experts=4,n_active_experts=2,router_aux_loss_coef=0.01", "--max-steps", "40", "--batch-size", "8",
            "--seq-len", "32", "--eval-every", "40", "--eval-tokens", "512", "--log-every", "5", "--lr", "3e-3",
            "--warmup-steps", "2", "--no-progress", "--seed", "3", "--threads", "1"]
    assert main(args) == 0
    logged = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r and "val_loss" not in r]
    assert len(logged) == 8
    first, last = logged[0], logged[-1]
    assert last["loss"] < first["loss"] - 0.5, (first["loss"], last["loss"])
    for r in logged:
        assert r["aux_loss"] > 0
        assert len(r["moe_load"]) == 2 and all(len(layer) == 4 for layer in r["moe_load"])  # 2 layers × 4 experts
        assert all(sum(layer) == pytest.approx(1.0, abs=1e-4) for layer in r["moe_load"])
    moe = training_payload(out)["moe"]
    assert moe["step"] == [r["step"] for r in logged]
    assert moe["aux_loss"] == [r["aux_loss"] for r in logged]
    assert moe["load"] == [r["moe_load"] for r in logged]


def test_a_dense_run_has_no_moe_in_its_training_view(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert training_payload(tmp_path)["moe"] is None


def test_expert_load_is_the_share_of_routed_slots():
    model = tiny_moe(coef=0.0).eval()
    with torch.no_grad():
        model(torch.arange(24)[None])
    load = expert_load(model)
    assert len(load) == 2 and all(sum(layer) == pytest.approx(1.0) for layer in load)
    # 24 tokens × 2 slots each: every share is a whole number of slots out of 48.
    assert all(abs(s * 48 - round(s * 48)) < 1e-4 for layer in load for s in layer)
