"""The residual stream: its RMS, and the same weights run with the other norm placement.

Which probe holds the stream is `probes.STREAM_WIRING`; this module holds the two facts
that every view of the stream shares: how its size is measured and how the pre-norm /
post-norm twin of a model is built.
"""

from __future__ import annotations

import copy

import torch

PLACEMENTS = ("pre", "post")


def stream_rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square √(mean x²) over the last axis (one number per token), in float64.

    No ε: this is the stream's own size, not a norm's denominator.

    >>> stream_rms(torch.tensor([[3.0, -4.0]])).tolist()   # √((9 + 16) / 2)
    [3.5355339059327378]
    """
    return x.double().pow(2).mean(-1).sqrt()


def placement_twin(model, norm_placement: str):
    """`model` with its norms `norm_placement` ('pre' or 'post'): the model itself when they
    already are, else a copy in eval mode. A copy rather than a new model from the state dict,
    so the twin keeps whatever the model's modules hold (adapters, quantized weights, hooks)."""
    if norm_placement not in PLACEMENTS:
        raise ValueError(f"norm_placement must be one of {PLACEMENTS}, got {norm_placement!r}")
    if model.config.norm_placement == norm_placement:
        return model
    twin = copy.deepcopy(model)
    # Every block reads the model's one config object (model.Block.forward), so setting it
    # here moves the norms of the whole copy.
    twin.config.norm_placement = norm_placement
    assert all(b.cfg is twin.config for b in twin.blocks), "a block holds a config of its own"
    return twin.eval()


def placement_twins(model) -> dict:
    """{'pre': model, 'post': model}: `model` and its twin with the norms moved."""
    return {kind: placement_twin(model, kind) for kind in PLACEMENTS}


__all__ = ["PLACEMENTS", "stream_rms", "placement_twin", "placement_twins"]
