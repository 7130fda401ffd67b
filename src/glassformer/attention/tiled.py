"""FlashAttention's online softmax, written in plain PyTorch (Dao et al., 2022).

Tile by tile, a running max m, sum l and weighted sum o per query, rescaled by alpha =
exp(m_old - m_new) when a tile raises the max: o / l is exactly softmax(scores) @ V, with no
more than one tile × tile block of scores, and hidden tiles skipped. docs/model.md#attention-kernels.
"""

from __future__ import annotations

import math

import torch

from .mask import allowed


def _tile_is_hidden(q_lo: int, q_hi: int, k0: int, k1: int, window: int | None) -> bool:
    """True when no query with positions in [q_lo, q_hi] may read any key in [k0, k1)."""
    if k0 > q_hi:  # every key lies in every query's future
        return True
    if window is not None and q_lo - (k1 - 1) >= window:  # every key has slid out of the window
        return True
    return False


def tiled_attention(q, k, v, *, q_pos, key_mask=None, window=None, scale=None, start=None, tile=64, tile_log=None,
                    softcap=None, sinks=None):
    """Same result as naive_attention, computed tile by tile with an online softmax.

    tile: rows and columns per tile (any T works; the last tile may be short). tile_log: a list, to
    which one dict per (query tile, key tile) is appended, the running m, l, o, alpha after it or
    `skipped`: the walk-through of docs/trace-format.md#tiles-the-flashattention-walk-through-of-one-query-row.
    softcap: scores become softcap·tanh(s/softcap) (Gemma 2); sinks (N,): a logit per head added to each
    row's denominator once its tiles are done, exp(sink − m) (gpt-oss).
    """
    B, N, Tq, H = q.shape
    K, Tk = k.shape[1], k.shape[2]
    G = N // K
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    qg = q.reshape(B, K, G, Tq, H)  # (B, K, G, Tq, H)
    k_pos = torch.arange(Tk, device=q.device)
    outs = []
    for q0 in range(0, Tq, tile):
        q1 = min(q0 + tile, Tq)
        qt = qg[:, :, :, q0:q1]  # (B, K, G, tq, H)
        pos_t = q_pos[:, q0:q1]  # (B, tq)
        if start is not None:  # positions known without reading the tensor
            q_lo, q_hi = start + q0, start + q1 - 1
        else:
            q_lo, q_hi = int(pos_t.min()), int(pos_t.max())
        m = qt.new_full((B, K, G, q1 - q0, 1), float("-inf"))  # running max
        l = qt.new_zeros((B, K, G, q1 - q0, 1))  # running sum of exp(s - m)
        o = qt.new_zeros((B, K, G, q1 - q0, H))  # running sum of exp(s - m) · v
        for k0 in range(0, Tk, tile):
            k1 = min(k0 + tile, Tk)
            km = None if key_mask is None else key_mask[:, k0:k1]  # (B, tk)
            if _tile_is_hidden(q_lo, q_hi, k0, k1, window) or (km is not None and not bool(km.any())):
                if tile_log is not None:
                    tile_log.append(dict(q=(q0, q1), k=(k0, k1), skipped=True))
                continue
            s = torch.einsum("bkgqh,bkth->bkgqt", qt, k[:, :, k0:k1]) * scale  # (B, K, G, tq, tk)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            ok = allowed(pos_t, k_pos[k0:k1], km, window)[:, None, None]  # (B, 1, 1, tq, tk)
            s = s.masked_fill(~ok, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (B, K, G, tq, 1)
            # While a row has seen no readable key its max is -inf; measure from 0 instead.
            m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_ref)  # how much the old sums are worth now
            p = torch.exp(s - m_ref)  # (B, K, G, tq, tk) unnormalised weights; masked -> 0
            l = alpha * l + p.sum(-1, keepdim=True)
            o = alpha * o + torch.einsum("bkgqt,bkth->bkgqh", p.to(v.dtype), v[:, :, k0:k1])  # (B, K, G, tq, H)
            m = m_new
            if tile_log is not None:
                tile_log.append(dict(q=(q0, q1), k=(k0, k1), skipped=False, scores=s.detach(),
                                     m=m.detach(), l=l.detach(), o=o.detach(), alpha=alpha.detach()))
        if sinks is not None:  # the sink's share joins the denominator: l + exp(sink - m)
            sink = sinks.to(l.dtype).view(1, K, G, 1, 1)
            l = torch.where(l > 0, l + torch.exp(sink - torch.where(torch.isinf(m), sink, m)), l)
        # Rows that read no key at all keep l = 0: their output is zero, as in the other kernels.
        outs.append(torch.where(l > 0, o / l.clamp_min(torch.finfo(l.dtype).tiny), torch.zeros_like(o)))
    out = torch.cat(outs, dim=3)  # (B, K, G, Tq, H)
    return out.reshape(B, N, Tq, H)  # (B, N, Tq, H)
