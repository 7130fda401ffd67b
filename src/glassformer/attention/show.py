"""The score grid and the weights, formed for a recorder only (the kernels may never hold them):
`.scores` as the softmax reads them (scaled, soft-capped), `.weights` after the mask, and with
attention sinks `.sink_weight`, the share each head's sink took. docs/trace-format.md."""

from __future__ import annotations

import torch

from ..probes import tap
from .mask import allowed


def scores_of(q, k, scale=None, softcap=None):
    """q (B, N, T, H), k (B, K, Tk, H) -> scores (B, N, T, Tk): q·k scaled (by 1/√H unless given), then
    cap·tanh(s/cap) where a soft cap is set (Gemma 2)."""
    H = q.shape[-1]
    kr = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, N, Tk, H)
    scores = (q @ kr.transpose(-1, -2)) * (H**-0.5 if scale is None else scale)  # (B, N, T, Tk)
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def softmax_with_sinks(scores, ok, sinks=None):
    """softmax over the readable keys (ok (B, 1|N, T, Tk)), a sink logit per head (N,) joining the
    denominator; rows with no readable key get zeros. Returns (weights (B, N, T, Tk), sink weight (B, N, T) or None)."""
    masked = scores.masked_fill(~ok, float("-inf"))
    any_ok = ok.any(-1, keepdim=True)  # (B, 1, T, 1)
    masked = masked.masked_fill(~any_ok, 0.0)
    if sinks is None:
        return torch.softmax(masked, -1) * any_ok, None
    sink = sinks.to(masked.dtype)[None, :, None, None].expand(*masked.shape[:-1], 1)  # (B, N, T, 1)
    both = torch.softmax(torch.cat([masked, sink], -1), -1)  # (B, N, T, Tk + 1)
    return both[..., :-1] * any_ok, both[..., -1] * any_ok[..., 0]


def show_scores(name, q, k, q_pos, key_mask=None, window=None, scale=None, softcap=None, sinks=None):
    scores = scores_of(q, k, scale, softcap)  # (B, N, T, Tk)
    tap(name + ".scores", scores.transpose(1, 2))  # (B, T, N, Tk)
    ok = allowed(q_pos, torch.arange(k.shape[2], device=q.device), key_mask, window)[:, None]  # (B, 1, T, Tk)
    weights, sink = softmax_with_sinks(scores, ok, sinks)
    tap(name + ".weights", weights.transpose(1, 2))  # (B, T, N, Tk)
    if sink is not None:
        tap(name + ".sink_weight", sink.transpose(1, 2))  # (B, T, N)
