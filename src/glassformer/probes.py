"""Named probes: the places where the model shows its intermediate tensors.

The model calls `tap(name, x)` at every point named in design.md (`embed`,
`blocks.0.attn.q`, ...). With no recorder installed, `tap` returns `x` after one global
read, so a trace costs nothing when off. A recorder (see `glassformer.trace`) may store the
tensor and may return a replacement for it (ablation, patching).

Shapes as tapped (batch first, then token, then head, then feature):
    embed, blocks.i.attn_norm, blocks.i.attn.out, blocks.i.resid_mid,
    blocks.i.ffn_norm, blocks.i.ffn.down, blocks.i.resid_out, final_norm   (B, T, D)
    blocks.i.attn.q, .q_rot, .z                                            (B, T, N, H)
    blocks.i.attn.k, .v, .k_rot                                            (B, T, K, H)
    blocks.i.attn.scores (scaled, before the mask), .weights (after it)    (B, T, N, Tk)
    blocks.i.ffn.up, .gate, .act                                           (B, T, F)
    logits, probs                                                          (B, T, V)
`.scores` and `.weights` are only computed when a recorder asks for them
(`wants(name)`), since the fused kernels never form them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Recorder(Protocol):
    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def wants(self, name: str) -> bool: ...


_recorder: Recorder | None = None


def tap(name: str, x: torch.Tensor) -> torch.Tensor:
    """Show `x` to the active recorder under `name`; returns x (or the recorder's replacement)."""
    r = _recorder
    return x if r is None else r(name, x)


def wants(name: str) -> bool:
    """True when a recorder is active and asks for probe `name` (used for costly extras)."""
    r = _recorder
    return r is not None and r.wants(name)


def active() -> bool:
    return _recorder is not None


def set_recorder(r: Recorder | None) -> Recorder | None:
    """Install `r` (None removes it); returns the recorder that was active before."""
    global _recorder
    old, _recorder = _recorder, r
    return old
