"""The textbook kernel: materialise the T×T score grid, mask it, softmax, weighted sum."""

from __future__ import annotations

import math

import torch

from .mask import allowed


def naive_attention(q, k, v, *, q_pos, key_mask=None, window=None, scale=None, start=None, softcap=None, sinks=None):
    """softmax(QKᵀ/√H + mask) V, with the whole (Tq, Tk) grid in memory (Vaswani et al., 2017).
    softcap: scores become softcap·tanh(s/softcap) before the mask (Gemma 2); sinks (N,): one more
    logit per head in each softmax's denominator, whose weight is dropped (gpt-oss)."""
    B, N, Tq, H = q.shape
    K, Tk = k.shape[1], k.shape[2]
    G = N // K  # query heads per key/value head
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    # Group the query heads by the key/value head they share, so keys are never repeated.
    qg = q.view(B, K, G, Tq, H)  # (B, K, G, Tq, H)
    scores = torch.einsum("bkgqh,bkth->bkgqt", qg, k) * scale  # (B, K, G, Tq, Tk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    ok = allowed(q_pos, torch.arange(Tk, device=q.device), key_mask, window)  # (B, Tq, Tk)
    ok = ok[:, None, None]  # (B, 1, 1, Tq, Tk)
    scores = scores.masked_fill(~ok, float("-inf"))
    # A row with no readable key would be softmax(all -inf) = NaN: give it zero weights.
    any_ok = ok.any(-1, keepdim=True)  # (B, 1, 1, Tq, 1)
    scores = scores.masked_fill(~any_ok, 0.0)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1) * any_ok  # (B, K, G, Tq, Tk)
    else:  # the sink is one more column of the softmax, then dropped: the keys' weights sum to below 1
        sink = sinks.to(scores.dtype).view(1, K, G, 1, 1).expand(B, K, G, Tq, 1)
        weights = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1] * any_ok  # (B, K, G, Tq, Tk)
    out = torch.einsum("bkgqt,bkth->bkgqh", weights.to(v.dtype), v)  # (B, K, G, Tq, H)
    return out.reshape(B, N, Tq, H)  # (B, N, Tq, H)
