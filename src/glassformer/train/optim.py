"""AdamW with one weight-decay rule (or Muon for the block matrices beside it), and the
learning-rate schedule: linear warm-up, then cosine or warm-up–stable–decay (wsd).

Pure functions of the config and the step, so a resumed run recomputes the same rate at the
same step and the schedule never depends on the clock.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..errors import UserError


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


# The block matrices Muon trains (docs/training.md#muon): the products of attention and the feed-forward.
MUON_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def is_block_matrix(name: str) -> bool:
    """Whether parameter `name` is one of a block's product matrices (not embedding, head, norm or bias).

    >>> is_block_matrix("blocks.3.attn.wq.weight"), is_block_matrix("blocks.3.attn.wq.bias"), is_block_matrix("embed.weight")
    (True, False, False)
    """
    parts = name.split(".")
    return len(parts) == 5 and parts[0] == "blocks" and parts[3] in MUON_MATRICES and parts[4] == "weight"


class Optimizers:
    """Several optimizers stepped as one: what train_step, the schedule and the checkpoint see.

    Iterable, so torch.distributed.checkpoint's state-dict functions take it as their list of
    optimizers and key every moment and momentum buffer by parameter name."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def check_optimizer(cfg) -> None:
    """--optimizer and its companions checked before anything is written (a TrainConfig)."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise UserError(f"--optimizer {cfg.optimizer!r}: choose adamw or muon")
    if cfg.optimizer != "muon":
        return
    if cfg.fsdp:
        raise UserError("--optimizer muon with --fsdp: Muon orthogonalises each whole matrix, and FSDP gives each "
                        "process a shard of it (orthogonalising a shard is not orthogonalising the matrix): "
                        "drop --fsdp (DDP works) or use --optimizer adamw")
    if cfg.lora_r:
        raise UserError("--optimizer muon with --lora-r: the block matrices are frozen under LoRA and Muon would "
                        "only see the thin rank-r adapter factors: use --optimizer adamw for adapters")


def make_muon(model: torch.nn.Module, lr: float, muon_lr: float, momentum: float, weight_decay: float,
              betas: tuple[float, float], device: torch.device) -> Optimizers:
    """torch.optim.Muon for the block matrices, AdamW (one decay rule) for everything else.

    The Muon group carries lr_ratio = muon_lr / lr, so the one schedule (set_lr) scales both."""
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        raise UserError(f"--optimizer muon needs torch.optim.Muon (PyTorch 2.9 or later; this is {torch.__version__}): "
                        "upgrade torch or use --optimizer adamw")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_block_matrix(n)]
    if not matrices:
        raise UserError("--optimizer muon found no trainable block matrices (wq wk wv wo w_gate w_up w_down)")
    chosen = {id(p) for p in matrices}
    rest = torch.nn.Module()
    rest.params = torch.nn.ParameterList([p for _, p in named if id(p) not in chosen])
    muon = muon_cls([{"params": matrices, "lr_ratio": muon_lr / lr}], lr=muon_lr, momentum=momentum,
                    weight_decay=weight_decay, nesterov=True)
    return Optimizers(muon, make_optimizer(rest, lr, weight_decay, betas, device))


SCHEDULES = ("cosine", "wsd")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, schedule: str = "cosine",
          decay_frac: float = 0.4) -> float:
    """Rate for optimizer step `step` (0-based): (step+1)/warmup·lr, then the schedule down to min_lr at step total-1.

    'cosine': half a cosine from lr to min_lr over all steps after the warm-up.
    'wsd' (warm-up, stable, decay; the speedrun lineage's): lr held, then a straight line to
    min_lr over the last decay_frac of the steps (decay_start gives where it starts).

    >>> lr_at(0, 1.0, 0.1, 10, 100), lr_at(9, 1.0, 0.1, 10, 100), lr_at(99, 1.0, 0.1, 10, 100)
    (0.1, 1.0, 0.1)
    >>> lr_at(59, 1.0, 0.0, 10, 100, "wsd", 0.4), lr_at(99, 1.0, 0.0, 10, 100, "wsd", 0.4)
    (1.0, 0.0)
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    if schedule == "wsd":
        start = decay_start(warmup, total, decay_frac)
        progress = min(1.0, max(0.0, (step - start) / max(1, total - 1 - start)))
        return lr + (min_lr - lr) * progress
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def decay_start(warmup: int, total: int, decay_frac: float) -> int:
    """The last step at the full rate under 'wsd': the decay_frac·total steps after it decay (never inside the warm-up).

    >>> decay_start(10, 100, 0.4), decay_start(10, 100, 1.0)
    (59, 10)
    """
    return max(warmup, total - 1 - round(decay_frac * total))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    """The schedule's rate into every group (a Muon group's scaled by its lr_ratio)."""
    for g in optimizer.param_groups:
        g["lr"] = value * g.get("lr_ratio", 1.0)
