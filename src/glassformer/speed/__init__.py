"""Speed, put on from outside the model: `install(model)` re-classes its modules in place, the way
FSDP2's `fully_shard` and torchao's `quantize_` do, so the same module objects, parameters,
state-dict keys, paths and hooks stay, and every call still goes through the module (hooks, probes,
LoRA wrappers and int8 modules apply as before). `remove(model)` undoes it.

What it puts on (docs/architecture.md#speed):
- each plain `nn.Linear` becomes a `RowsLinear` (rows.py): inside `decoding()` (a session's eager
  decode steps on a CPU) a one-row product reads a row-block copy of the weight, one block per
  thread; compiled, a one-row product is a multiply-and-sum over the weight's rows, which inductor
  makes one streaming loop; on a GPU the LM head's products over many rows run over a padded
  vocabulary (head.py). Everywhere else it is `F.linear`, to the bit.
- each `RMSNorm` becomes a `FusedRMSNorm` (norm.py): torch's `F.rms_norm` where no gradient is
  wanted in fp32, the same numbers as the formula (tests/speed).

Outside `decoding()` the model's numbers are the plain model's, so the explorer and traces show
the same values whether or not a session installed speed on the model they share.
"""

from __future__ import annotations

import torch.nn as nn

from ..model import RMSNorm
from .head import PaddedHead
from .norm import FusedRMSNorm
from .rows import RowsLinear, decoding

__all__ = ["install", "remove", "installed", "decoding", "RowsLinear", "FusedRMSNorm", "PaddedHead"]

# each re-classed type and the plain type it came from
_PLAIN = {RowsLinear: nn.Linear, PaddedHead: nn.Linear, FusedRMSNorm: RMSNorm}


def install(model: nn.Module) -> nn.Module:
    """Re-class the model's plain projections and RMS norms in place (idempotent); returns the model.
    A module someone else replaced (a LoRA wrapper, an int8 Linear) keeps its own class; a plain
    Linear inside it (a LoRA base) is re-classed like any other."""
    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = PaddedHead if m is head else RowsLinear
        elif type(m) is RMSNorm:
            m.__class__ = FusedRMSNorm
    return model


def remove(model: nn.Module) -> nn.Module:
    """Give every re-classed module its plain class back and drop the copies it held."""
    for m in model.modules():
        plain = _PLAIN.get(type(m))
        if plain is not None:
            m.__dict__.pop("held", None)
            m.__class__ = plain
    return model


def installed(model: nn.Module) -> bool:
    """Whether any module of the model wears one of this package's classes."""
    return any(type(m) in _PLAIN for m in model.modules())
