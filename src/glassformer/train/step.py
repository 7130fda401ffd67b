"""One optimizer step, as a function of the model, the optimizer and a batch of token ids.

`train_step` is what the loop (train/loop.py) calls once per step, and what tests call on a
tiny model with tensors they made themselves: no data folder, run folder or process group.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..moe import aux_loss
from .distributed import Dist, all_mean, all_sum, micro_batch_sync, unwrap
from .optim import set_lr


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean cross-entropy over the step's micro-batches (and ranks)
    grad_norm: float  # global L2 norm of the gradient, before clipping
    stepped: bool  # False: loss or norm not finite, so the gradients were dropped and no weight moved
    # A mixture of experts trained with router_aux_loss_coef > 0: the load-balancing loss (summed over the
    # mixture layers, mean over the micro-batches, this process's rows), before the coefficient. `loss`
    # stays the cross-entropy alone, comparable with a dense model's; the gradient is of loss + coef·aux.
    aux_loss: float | None = None


def forward_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch (a module-level function so tests can inject faults)."""
    _, loss = model(x, y)
    return loss


def masked_nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross-entropy over the targets that are not -1 (B, T, V logits, B, T targets):
    a masked position's logits get exactly zero gradient."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                             ignore_index=-1, reduction="sum")


def forward_loss_sum(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over one micro-batch's unmasked targets (y -1: masked)."""
    logits, _ = model(x)
    return masked_nll_sum(logits, y)


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *,
               accum: int = 1, lr: float | None = None, grad_clip: float = 0.0,
               autocast=contextlib.nullcontext, d: Dist | None = None,
               device: torch.device | None = None, masked: bool = False) -> StepResult:
    """One optimizer step on this process's rows x, y (B, T): `accum` micro-batches of B/accum rows,
    their mean loss backpropagated (gradients reduced across ranks on the last one only), the global
    gradient norm, clipping to grad_clip (0: none), then the optimizer step at learning rate lr
    (None: as the optimizer has it). A non-finite loss or norm drops the gradients and skips the step.
    net: the model or its DDP/FSDP wrapper; d: the process group (None: one process); masked: the
    global masked mean instead (docs/chat.md#fine-tuning-on-conversations).
    """
    assert x.shape == y.shape and x.shape[0] % accum == 0, (x.shape, y.shape, accum)
    if lr is not None:
        set_lr(optimizer, lr)
    device = device or next(net.parameters()).device
    aux = _Aux(unwrap(net), accum, device)
    if masked:
        loss = _accumulate_masked(net, x, y, accum, autocast, d, device, aux)
    else:
        loss_mean = _accumulate_gradients(net, x, y, accum, autocast, d, device, aux)
        loss = float(all_mean(loss_mean, d)) if d is not None else float(loss_mean)
    params = [p for p in unwrap(net).parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2: the norm is a DTensor
        norm = norm.full_tensor()
    norm = float(norm)
    stepped = math.isfinite(loss) and math.isfinite(norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=loss, grad_norm=norm, stepped=stepped, aux_loss=aux.mean())


class _Aux:
    """The mixture's load-balancing term: after each micro-batch's forward, coef · aux / accum joins the
    loss that is backpropagated (so the step's gradient has coef times the mean aux loss); a dense model,
    or a coefficient of 0, adds nothing."""

    def __init__(self, model: torch.nn.Module, accum: int, device: torch.device):
        cfg = getattr(model, "config", None)
        self.coef = float(getattr(cfg, "router_aux_loss_coef", 0.0)) if getattr(cfg, "n_experts", 0) else 0.0
        self.model, self.accum = model, accum
        self.sum = torch.zeros((), device=device) if self.coef > 0 else None

    def term(self) -> torch.Tensor | float:
        if self.sum is None:
            return 0.0
        aux = aux_loss(self.model)  # the forward just run: every mixture layer's loss, summed
        if aux is None:
            return 0.0
        self.sum += aux.detach().float()
        return self.coef * aux / self.accum

    def mean(self) -> float | None:
        return None if self.sum is None else float(self.sum) / self.accum


def _backward_micro_batches(net, x, y, accum, autocast, d, device, loss_of, weigh, aux: _Aux) -> torch.Tensor:
    """For each of `accum` micro-batches, backward of weigh(loss_of(micro-batch)) (plus the mixture's
    aux term), gradients reduced across ranks on the last one only; returns the summed detached losses
    (a tensor on device)."""
    micro = x.shape[0] // accum
    loss_sum = torch.zeros((), device=device)
    for m in range(accum):
        xm = x[m * micro:(m + 1) * micro].to(device, non_blocking=True)  # (micro, T)
        ym = y[m * micro:(m + 1) * micro].to(device, non_blocking=True)  # (micro, T)
        with micro_batch_sync(net, d, last=m == accum - 1):
            with autocast():
                loss = loss_of(net, xm, ym)
                extra = aux.term()
            (weigh(loss) + extra).backward()
        loss_sum += loss.detach().float()
    return loss_sum


def _accumulate_gradients(net, x, y, accum, autocast, d, device, aux: _Aux) -> torch.Tensor:
    """Backward of each micro-batch's loss / accum, so the summed gradient is that of the whole
    batch's mean loss; returns the mean loss (a tensor on device, detached)."""
    weigh = lambda loss: loss / accum  # noqa: E731
    return _backward_micro_batches(net, x, y, accum, autocast, d, device, forward_loss, weigh, aux) / accum


def _accumulate_masked(net, x, y, accum, autocast, d, device, aux: _Aux) -> float:
    """Backward of each micro-batch's summed loss / the global batch's count of unmasked targets
    (times the world size: DDP and FSDP average gradients over ranks), so the summed gradient is
    that of the global masked mean; returns that mean. The count stays a tensor (no device sync
    before the forwards); a batch with nothing to train has zero loss and gradient."""
    world = d.world_size if d is not None and d.enabled else 1
    count = (y >= 0).sum().to(device)
    if d is not None:
        count = all_sum(count, d)
    count = count.clamp(min=1).float()
    scale = world / count
    loss_sum = _backward_micro_batches(net, x, y, accum, autocast, d, device, forward_loss_sum, lambda loss: loss * scale,
                                      aux)
    if d is not None:
        loss_sum = all_sum(loss_sum, d)
    return float(loss_sum / count)
