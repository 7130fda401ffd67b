"""AdamW with one weight-decay rule, and the learning-rate schedule: linear warm-up, then cosine.

Pure functions of the config and the step, so a resumed run recomputes the same rate at the
same step and the schedule never depends on the clock.
"""

from __future__ import annotations

import inspect
import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay tensors of 2+ dims (matrices, embeddings); never norms' gains or biases (nanoGPT's rule)."""
    decay, no_decay = [], []
    for p in model.parameters():  # a tied matrix is listed once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                   device: torch.device, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW, fused where this PyTorch and device support it (one kernel for all tensors), else foreach."""
    kwargs = {}
    fused_ok = "fused" in inspect.signature(torch.optim.AdamW).parameters and device.type in ("cuda", "cpu", "mps")
    if fused_ok and not sharded:  # FSDP2's DTensor parameters take the foreach path
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=1e-8, **kwargs)


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Rate for optimizer step `step` (0-based): (step+1)/warmup·lr, then cosine from lr to min_lr at `total`.

    >>> lr_at(0, 1.0, 0.1, 10, 100), lr_at(9, 1.0, 0.1, 10, 100), lr_at(100, 1.0, 0.1, 10, 100)
    (0.1, 1.0, 0.1)
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = value
