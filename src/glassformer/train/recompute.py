"""--activation-checkpointing: each block keeps only its input from the forward and recomputes its
own activations during backward (torch.utils.checkpoint, non-reentrant).

Applied from outside the model: each Block is re-classed to a subclass whose forward runs the
plain Block.forward under checkpoint, so model.py stays the architecture alone, the state dict
keeps its names, and isinstance(block, Block) still holds. Dropout draws the same noise in the
recomputation (checkpoint restores the RNG state), so the loss and gradients are the plain run's.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

_CLASSES: dict[type, type] = {}


def _recomputing(cls: type) -> type:
    """The subclass of a block class whose training forward is checkpointed (one per class)."""
    if cls not in _CLASSES:
        def forward(self, *args, **kwargs):
            if not (self.training and torch.is_grad_enabled()):  # evaluation and generation: nothing to save
                return cls.forward(self, *args, **kwargs)
            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _CLASSES[cls] = type(f"Recomputed{cls.__name__}", (cls,), {"forward": forward, "recomputed": True})
    return _CLASSES[cls]


def checkpoint_blocks(model: torch.nn.Module) -> int:
    """Re-class every block of `model` (a Transformer) to recompute in backward; returns how many.
    Idempotent: a block already re-classed is left as it is."""
    n = 0
    for block in model.blocks:
        if not getattr(block, "recomputed", False):
            block.__class__ = _recomputing(type(block))
            n += 1
    return n
