"""The model's forward with its weights packed for generation: same math, fewer and faster matmuls.

At batch 1 a decode step is a chain of matrix-vector products, bound by how fast the
weights stream from memory. Two layout changes make them stream faster without changing a
single number of the model:

- fusion: Q, K and V become one (D, (N+2K)·H) matrix and SwiGLU's gate and up one
  (D, 2F) matrix (gpt-fast's wqkv), so a layer runs 4 products instead of 7;
- (in, out) storage: x @ W reads W row after row, each row a long contiguous run that
  updates the whole output vector, where nn.Linear's (out, in) layout computes one short
  dot product per output. On a CPU that streams ~1.4x more bytes per second (bench/decode.py).

The packed copy costs one more copy of the weights' memory; it is rebuilt when any
parameter of the model changes (tracked by tensor version counters). The forward below
mirrors Transformer.forward, Block.forward, Attention.forward and FeedForward.forward
line for line but shows nothing to probes: tracing uses the model itself.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .model import RMSNorm, apply_rope, ffn_activation, rope_angles

_PACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.detach().t().contiguous()  # (in, out)


def _cat_bias(*linears):
    if linears[0].bias is None:
        return None
    return torch.cat([lin.bias.detach() for lin in linears])


def _signature(model) -> tuple:
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


def pack(model) -> dict:
    """The packed weights of `model` (cached; rebuilt when a parameter changed)."""
    sig = _signature(model)
    hit = _PACKS.get(model)
    if hit is not None and hit["sig"] == sig:
        return hit
    layers = []
    with torch.no_grad():
        for b in model.blocks:
            a, f = b.attn, b.ffn
            gu = (f.w_gate, f.w_up) if f.w_gate is not None else (f.w_up,)
            layers.append(dict(
                qkv=_t(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight])),  # (D, (N+2K)H)
                qkv_b=_cat_bias(a.wq, a.wk, a.wv),
                o=_t(a.wo.weight), o_b=None if a.wo.bias is None else a.wo.bias.detach(),  # (NH, D)
                gu=_t(torch.cat([lin.weight for lin in gu])),  # (D, 2F) or (D, F)
                gu_b=_cat_bias(*gu),
                down=_t(f.w_down.weight), down_b=None if f.w_down.bias is None else f.w_down.bias.detach(),  # (F, D)
            ))
        head = _t(model.lm_head.weight)  # (D, V)
    hit = dict(sig=sig, layers=layers, head=head)
    _PACKS[model] = hit
    return hit


def _lin(x, w, b):
    return x @ w if b is None else torch.addmm(b, x.flatten(0, -2), w).view(*x.shape[:-1], w.shape[1])


def _attention(block, p, x, rope, q_pos, cache, start):
    cfg = block.cfg
    B, T, _ = x.shape
    qkv = _lin(x, p["qkv"], p["qkv_b"])  # (B, T, (N+2K)H)
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qk = qkv[..., : (N + K) * H].view(B, T, N + K, H)  # (B, T, N+K, H): queries and keys side by side
    if rope is not None:
        qk = apply_rope(qk, *rope, cfg.rope_pairs)  # one rotation for both (same angles per position)
    q, k = qk[:, :, :N], qk[:, :, N:]  # (B, T, N, H), (B, T, K, H)
    v = qkv[..., (N + K) * H:].view(B, T, K, H)  # (B, T, K, H)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, H)
    k, v = cache.update(q_pos, k, v)  # (B, K, Tk, H)
    z = block.attn.kernel(q, k, v, q_pos=q_pos, window=cfg.sliding_window, start=start)  # (B, N, T, H)
    return _lin(z.transpose(1, 2).reshape(B, T, cfg.q_dim), p["o"], p["o_b"])  # (B, T, D)


def _norm(norm, x):
    """The block's norm; RMSNorm as one fused op (same formula: fp32, then the weight)."""
    if isinstance(norm, RMSNorm) and norm.bias is None:
        return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)
    return norm(x)


def _ffn(block, p, x):
    kind = block.cfg.ffn
    h = _lin(x, p["gu"], p["gu_b"])  # (B, T, 2F) or (B, T, F)
    if kind == "swiglu":
        gate, up = h.chunk(2, dim=-1)  # (B, T, F) each
        act = ffn_activation(kind, up, gate)
    else:
        act = ffn_activation(kind, h)
    return _lin(act, p["down"], p["down_b"])  # (B, T, D)


def packed_forward(model, idx: torch.Tensor, cache, pos=0) -> torch.Tensor:
    """Logits (B, T, V) of Transformer.forward(idx, cache=cache, pos=pos), in eval mode."""
    P = pack(model)
    cfg = model.config
    B, T = idx.shape
    q_pos = model._positions(pos, B, T, idx.device)  # (B, T)
    start = None if isinstance(pos, torch.Tensor) and pos.dim() > 0 else int(pos)
    cache.prepare(pos, T)
    x = model.embed(idx)  # (B, T, D)
    if model.pos_embed is not None:
        x = x + model.pos_embed(q_pos)
    rope = rope_angles(q_pos, model.rope_inv_freq) if cfg.pos == "rope" else None
    for i, (block, p) in enumerate(zip(model.blocks, P["layers"])):
        layer_cache = cache.layer(i)
        if cfg.norm_placement == "pre":
            h = x + _attention(block, p, _norm(block.attn_norm, x), rope, q_pos, layer_cache, start)
            x = h + _ffn(block, p, _norm(block.ffn_norm, h))
        else:
            h = _norm(block.attn_norm, x + _attention(block, p, x, rope, q_pos, layer_cache, start))
            x = _norm(block.ffn_norm, h + _ffn(block, p, h))
    return _norm(model.final_norm, x) @ P["head"]  # (B, T, V)
