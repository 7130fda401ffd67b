"""Speed, put on from outside the model: `install(model)` re-classes its projections in place, the
way FSDP2's `fully_shard` and torchao's `quantize_` do, so the same module objects, parameters,
state-dict keys, paths and hooks stay, and every call still goes through the module (hooks, probes,
LoRA wrappers and int8 modules apply as before). `remove(model)` undoes it.

What it puts on (docs/architecture.md#speed):
- each plain `nn.Linear` becomes a `RowsLinear` (rows.py): in a compiled decode step on a CPU a
  one-row product is a multiply-and-sum over the weight's rows, which inductor makes one streaming loop;
- the LM head becomes a `PaddedHead` (head.py): on a GPU its products over many rows run over a
  vocabulary padded to a multiple of 64.
Everywhere else a re-classed module runs exactly what the plain one runs (F.linear), so an eager
session, the explorer and traces all get the plain model's numbers.
"""

from __future__ import annotations

import torch.nn as nn

from .head import PaddedHead
from .rows import RowsLinear

__all__ = ["install", "remove", "installed", "RowsLinear", "PaddedHead"]

_CLASSES = (RowsLinear, PaddedHead)  # what install puts on, each over a plain nn.Linear


def install(model: nn.Module) -> nn.Module:
    """Re-class the model's plain projections in place (idempotent); returns the model. A module
    someone else replaced (a LoRA wrapper, an int8 Linear) keeps its own class; a plain Linear inside
    it (a LoRA base) is re-classed like any other."""
    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = PaddedHead if m is head else RowsLinear
    return model


def remove(model: nn.Module) -> nn.Module:
    """Give every re-classed module its plain class back."""
    for m in model.modules():
        if type(m) in _CLASSES:
            m.__class__ = nn.Linear
    return model


def installed(model: nn.Module) -> bool:
    """Whether any module of the model wears one of this package's classes."""
    return any(type(m) in _CLASSES for m in model.modules())
