"""PyTorch's fused scaled_dot_product_attention: the fast default."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import allowed
from .naive import naive_attention

# enable_gqa arrived in torch 2.5; before it, repeat the key/value heads.
_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


# A continuous-batching step's attention (one query per row, each at its own position) on the CPU through
# _masked_decode_step; False sends it to the fused kernel with a boolean mask (bench/batching.py --fused-mask).
MASKED_DECODE = True
# Training in bf16 on a CPU runs the fused kernel in float32 (_fused); False keeps it in bf16 (bench/quality_tuning.py's
# "--dtype bf16 with bf16 attention" recipe prices the difference).
CPU_BF16_IN_FLOAT32 = True


def _decode_step(q, k, v, scale):
    """One query per row reading every cached key: two batched products per key/value head (CPU).

    The fused CPU kernel reads a key/value head once per query head of its group; here the group
    shares one pass, what a long-context step is bound by (bench/decode.py); the same math.
    docs/generation.md#speed."""
    return _grouped(q, k, v, scale)


def _grouped(q, k, v, scale, hidden=None):
    """The two batched products of a one-query step, each KV head's group of queries in one pass;
    `hidden` (B, 1, Tk), where given, is True for the keys a row may not read (-inf before the softmax)."""
    B, N, _, H = q.shape
    K, Tk = k.shape[1], k.shape[2]
    G = N // K
    qg = q.reshape(B * K, G, H)  # (B·K, G, H): each KV head's group of queries
    kg, vg = k.reshape(B * K, Tk, H), v.reshape(B * K, Tk, H)  # (B·K, Tk, H)
    scores = torch.bmm(qg, kg.transpose(1, 2)).mul_(_scale(q, scale))  # (B·K, G, Tk)
    if hidden is not None:
        scores.view(B, K, G, Tk).masked_fill_(hidden[:, None], float("-inf"))
    return torch.bmm(torch.softmax(scores, -1), vg).view(B, N, 1, H)  # (B, N, 1, H)


def _masked_decode_step(q, k, v, q_pos, key_mask, window, scale):
    """One query per row, each row at its own position (a continuous-batching step): _decode_step's
    two batched products with the keys a row may not read set to -inf before the softmax (CPU).

    Cheaper than the fused kernel with a boolean mask at a few rows, the same numbers to 4e-7
    (bench/batching.py --fused-mask; docs/benchmarks-log.md#serve). A row with no readable key gets
    zeros, as from every kernel."""
    Tk = k.shape[2]
    if key_mask is None and window is None:  # causal by position: key j is hidden from a row before it
        hidden = torch.arange(Tk, device=q.device) > q_pos[:, :, None]  # (B, 1, Tk)
        dead = None  # a row reads at least key 0 (positions are >= 0)
    else:
        hidden = ~allowed(q_pos, torch.arange(Tk, device=q.device), key_mask, window)  # (B, 1, Tk)
        dead = hidden.all(-1, keepdim=True)  # (B, 1, 1): no readable key
        hidden = hidden & ~dead  # such a row reads everything (finite), then gets zeros
    out = _grouped(q, k, v, scale, hidden)  # (B, N, 1, H)
    return out if dead is None else out * ~dead[:, None]


def _fused(q, k, v, **kw):
    """F.scaled_dot_product_attention; in float32 while training in bf16 on a CPU, whose fused
    kernel's bf16 backward is slow (the demo model's bf16 step costs 0.67x float32's this way, 0.99x
    without it: bench/quality_tuning.py, docs/benchmarks-log.md#what-bought-what-fixed-steps-one-thread-busy-machine).
    The products around it stay bf16 under autocast."""
    if (CPU_BF16_IN_FLOAT32 and q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad
            and torch.is_grad_enabled()):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def _scale(q, scale) -> float:
    """The scores' scale: 1/sqrt(head size) unless given."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def sdpa_attention(q, k, v, *, q_pos, key_mask=None, window=None, scale=None, start=None, softcap=None, sinks=None):
    """Fused attention; the mask is only built when it is not plain causal. The fused kernel has no
    soft cap or sink, so those go to the naive kernel (same numbers; docs/model.md#attention-kernels)."""
    if softcap is not None or sinks is not None:
        return naive_attention(q, k, v, q_pos=q_pos, key_mask=key_mask, window=window, scale=scale, softcap=softcap, sinks=sinks)
    B, N, Tq, H = q.shape
    K, Tk = k.shape[1], k.shape[2]
    if N != K and not _HAS_GQA:
        k = k.repeat_interleave(N // K, dim=1)  # (B, N, Tk, H)
        v = v.repeat_interleave(N // K, dim=1)  # (B, N, Tk, H)
    gqa = {"enable_gqa": True} if (N != k.shape[1] and _HAS_GQA) else {}
    if key_mask is None and window is None and start == 0 and Tq == Tk:  # plain causal: no mask to build
        return _fused(q, k, v, is_causal=True, scale=scale, **gqa)
    if key_mask is None and window is None and Tq == 1 and start is not None and Tk == start + 1:
        # One decode step over a cache filled up to it: the query may read every key, no mask.
        if q.device.type == "cpu":
            return _decode_step(q, k, v, scale)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **gqa)  # GPUs' fused kernels serve groups well
    if MASKED_DECODE and Tq == 1 and q.device.type == "cpu" and not torch.compiler.is_compiling():
        return _masked_decode_step(q, k, v, q_pos, key_mask, window, scale)
    ok = allowed(q_pos, torch.arange(Tk, device=q.device), key_mask, window)  # (B, Tq, Tk)
    any_ok = ok.any(-1, keepdim=True)  # (B, Tq, 1)
    # Rows with no readable key: let them read everything (finite), then zero their output.
    ok = (ok | ~any_ok)[:, None]  # (B, 1, Tq, Tk)
    out = _fused(q, k, v, attn_mask=ok, scale=scale, **gqa)  # (B, N, Tq, H)
    return out * any_ok[:, None].to(out.dtype)
