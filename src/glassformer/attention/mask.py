"""Which keys each query may read: the one rule that all three kernels share."""

from __future__ import annotations

import torch


def allowed(
    q_pos: torch.Tensor,  # (B, Tq) positions of the queries
    k_pos: torch.Tensor,  # (Tk,) positions of the keys
    key_mask: torch.Tensor | None = None,  # (B, Tk) True where a key is real
    window: int | None = None,
) -> torch.Tensor:
    """Boolean (B, Tq, Tk): True where query i of row b may read key j.

    Causal by position rather than by index, so the same rule serves a full forward, a
    prefill into a cache and one decode step, and rows that sit at different positions.
    """
    diff = q_pos[:, :, None] - k_pos[None, None, :]  # (B, Tq, Tk) how far back each key is
    ok = diff >= 0
    if window is not None:
        ok = ok & (diff < window)
    if key_mask is not None:
        ok = ok & key_mask[:, None, :]
    return ok
