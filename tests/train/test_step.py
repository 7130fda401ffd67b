"""train_step on a tiny model and tensors made here (no data folder), against plain autograd;
and the one gradient-sync helper for DDP/FSDP micro-batches."""

from __future__ import annotations

import copy
import contextlib

import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer
from glassformer.train import distributed as gdist
from glassformer.train import step as S
from glassformer.train.step import train_step


def tiny(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_preset("tiny", dropout=0.0))


def batch(model: Transformer, rows: int = 8, T: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, T + 1), generator=g)  # (B, T+1)
    return ids[:, :-1], ids[:, 1:]  # (B, T) each


def reference_grads(model: Transformer, x, y) -> dict[str, torch.Tensor]:
    """The gradient of the whole batch's mean cross-entropy, by autograd on the logits alone."""
    model = copy.deepcopy(model)
    logits, _ = model(x)  # (B, T, V)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sgd(model: Transformer) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.5)  # w ← w - 0.5 g: the update shows the gradient


@pytest.mark.parametrize("accum", [1, 4])
def test_update_is_the_whole_batch_gradient(accum):
    """Accumulating 4 micro-batches of 2 rows moves the weights as one batch of 8 does, by -lr · gradient."""
    model = tiny()
    x, y = batch(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = reference_grads(model, x, y)
    res = train_step(model, sgd(model), x, y, accum=accum, grad_clip=0.0)
    assert res.stepped
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert res.grad_norm == pytest.approx(float(ref_norm), rel=1e-5)
    with torch.no_grad():
        logits, _ = tiny()(x)  # the same initial weights (same seed)
        ref_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    assert res.loss == pytest.approx(float(ref_loss), rel=1e-6)
    moved = 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n], rtol=1e-5, atol=1e-6)
        moved += not torch.equal(p.detach(), before[n])
    assert moved == len(before)  # every tensor moved (the check above is not vacuous)
    assert all(p.grad is None for p in model.parameters())  # the step leaves no gradient behind


def test_accumulation_matches_one_batch_over_steps_with_clipping():
    """accum 4 and accum 1 on the same rows, two clipped steps with momentum: the same weights.
    (SGD rather than AdamW: Adam divides by the gradient's own size, so float noise in a gradient
    entry near zero becomes an update of about lr either way, and no tolerance tells them apart.)"""
    a, b = tiny(), tiny()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    for seed in (1, 2):
        x, y = batch(a, seed=seed)
        ra = train_step(a, opt_a, x, y, accum=4, grad_clip=1.0)
        rb = train_step(b, opt_b, x, y, accum=1, grad_clip=1.0)
        assert ra.grad_norm > 1.0  # clipping took part
        assert ra.loss == pytest.approx(rb.loss, rel=1e-5)
        assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=1e-5)
    changed = False
    for (n, pa), (_, pb), p0 in zip(a.named_parameters(), b.named_parameters(), tiny().parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=n)
        changed |= not torch.equal(pa, p0)
    assert changed


def test_clipping_scales_the_update_to_the_clip_norm():
    model = tiny()
    x, y = batch(model)
    before = [p.detach().clone() for p in model.parameters()]
    res = train_step(model, sgd(model), x, y, grad_clip=1e-3)
    assert res.grad_norm > 1e-3  # the logged norm is the one before clipping
    step = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    assert float(step.norm()) == pytest.approx(0.5 * 1e-3, rel=1e-3)


def test_sets_the_learning_rate():
    model = tiny()
    opt = sgd(model)
    x, y = batch(model)
    train_step(model, opt, x, y, lr=0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_loss_skips_the_optimizer_step(monkeypatch, bad):
    from glassformer.train.optim import make_optimizer

    model = tiny()
    opt = make_optimizer(model, 1e-2, 0.1, (0.9, 0.95), torch.device("cpu"))
    x, y = batch(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    real, calls = S.forward_loss, []

    def poisoned(net, xm, ym):  # the third of four micro-batches
        calls.append(1)
        loss = real(net, xm, ym)
        return loss * bad if len(calls) == 3 else loss

    monkeypatch.setattr(S, "forward_loss", poisoned)
    res = train_step(model, opt, x, y, accum=4, lr=1e-2)
    assert len(calls) == 4 and not res.stepped
    assert not (torch.isfinite(torch.tensor(res.loss)) and torch.isfinite(torch.tensor(res.grad_norm)))
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
        assert p.grad is None  # the poisoned gradients are dropped, not carried into the next step
    assert not opt.state  # AdamW took no step: no moments yet
    monkeypatch.undo()
    assert train_step(model, opt, x, y, accum=4, lr=1e-2).stepped  # the next step goes ahead
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- gradient sync


class FakeDDP:
    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.entered += 1
        yield


class FakeFSDP:
    def __init__(self):
        self.flags = []

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.flags.append(flag)


def test_grad_sync_only_on_the_last_micro_batch():
    two = gdist.Dist(rank=0, world_size=2)
    ddp, fsdp = FakeDDP(), FakeFSDP()
    for m in range(3):
        with gdist.micro_batch_sync(ddp, two, last=m == 2):
            pass
        with gdist.micro_batch_sync(fsdp, two, last=m == 2):
            pass
    assert ddp.entered == 2  # no_sync around the first two backwards, not the last
    assert fsdp.flags == [False, False, True]
    one_ddp, one_fsdp = FakeDDP(), FakeFSDP()
    for d in (None, gdist.Dist()):  # one process: nothing to synchronise
        with gdist.micro_batch_sync(one_ddp, d, last=False), gdist.micro_batch_sync(one_fsdp, d, last=False):
            pass
    assert one_ddp.entered == 0 and one_fsdp.flags == []
