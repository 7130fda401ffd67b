"""The model's forward with its weights packed for generation: same math, fewer and faster matmuls.

At batch 1 a decode step is a chain of matrix-vector products, bound by how fast the
weights stream from memory. Three layout changes make them stream faster without changing a
single number of the model:

- fusion: Q, K and V become one (D, (N+2K)·H) matrix and SwiGLU's gate and up one
  (D, 2F) matrix (gpt-fast's wqkv), so a layer runs 4 products instead of 7;
- (in, out) storage: x @ W reads W row after row, each row a long contiguous run that
  updates the whole output vector, where nn.Linear's (out, in) layout computes one short
  dot product per output. On a CPU that streams ~1.5x more bytes per second (bench/matvec.py);
- one row block per CPU thread: each matrix is also seen (a view, no copy) as P blocks of
  consecutive rows (P, in/P, out), and x as P pieces (P, 1, in/P), so a matrix-vector
  product becomes one batched product whose P blocks run on P threads side by side (a
  plain x @ W with one row runs on one thread whatever the thread count); the P partial
  outputs are then summed. Each thread streams one contiguous stretch of memory, which
  reads faster than column blocks, whose rows are short runs a stride apart (with 2
  threads 28.2 against 21.0 GB/s, bench/matvec.py). Products of many rows (a prefill)
  use the whole matrix.

A compiled session on the CPU packs the other way ("out_in" layout): the weights stay
(out, in), and each one-row product is written as a multiply-and-sum over the rows, which
torch.compile turns into one loop that streams every weight row once, the rows split among
the threads: ~2x the bytes per second of the BLAS kernels above (65.0 against 28.2 GB/s with
2 threads, 28.6 against 14.7 with 1; bench/matvec.py). Eagerly that formula would build the
(out, in) product first, so eager steps keep the row blocks. Products of many rows take the
residual add inside the library call (addmm), in either layout.

RoPE reads precomputed cos/sin rows and turns each feature pair with one multiply-add
(x·cos + swap(x)·sin, the pair's two features swapped and the sine signed to match), the
same rotation as model.apply_rope in three operations instead of eight.

The packed copy costs one more copy of the weights' memory (the out_in layout shares its
unfused matrices with the model); it is rebuilt when any
parameter of the model changes (tracked by tensor version counters). The forward below
mirrors Transformer.forward, Block.forward, Attention.forward and FeedForward.forward
line for line but shows nothing to probes: tracing uses the model itself.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..model import RMSNorm, ffn_activation

_PACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _t(w: torch.Tensor, P: int, layout: str = "rows") -> tuple:
    """A packed matrix (w, blocks, out_in), from nn.Linear's weight (out, in).

    layout "rows": w is the (in, out) matrix and, for P > 1, blocks a view of it as P row
    blocks (P, in/P, out): block p is rows p·in/P .. (p+1)·in/P, one contiguous stretch.
    layout "out_in": w is the (out, in) weight itself (a compiled step's one-row products
    are generated row sums over it, see _lin), blocks None.
    """
    if layout == "out_in":
        return w.detach().contiguous(), None, True  # (out, in): no copy for a contiguous weight
    w = w.detach().t().contiguous()  # (in, out)
    n_in, n_out = w.shape
    if P == 1 or n_in % P:
        return w, None, False
    return w, w.view(P, n_in // P, n_out), False  # (P, in/P, out), no copy


def _blocks_for(device: torch.device, layout: str = "rows") -> int:
    """Row blocks per matrix: one per CPU thread (on a GPU one kernel already uses the whole chip;
    the out_in layout has none: the compiled loop splits the rows among the threads itself)."""
    return torch.get_num_threads() if device.type == "cpu" and layout == "rows" else 1


def _rope_tables(model) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and signed sin (S, H) for every position, laid out so rotate(x) = x·cos + swap(x)·sin."""
    cfg = model.config
    if cfg.pos != "rope":
        return None
    pos = torch.arange(cfg.max_seq_len, device=model.rope_inv_freq.device)
    angles = pos.float()[:, None] * model.rope_inv_freq  # (S, H/2), as model.rope_angles computes them
    cos, sin = angles.cos(), angles.sin()
    if cfg.rope_pairs == "half":  # pair (i, i + H/2): swap(x) = (b, a)
        return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # (S, H) each
    return torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)  # pairs (2i, 2i+1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """model.apply_rope(x) for x (B, T, heads, H) with cos/sin rows (B or 1, T, 1, H), in fp32."""
    xf = x.float()
    H = x.shape[-1]
    if pairs == "half":
        swapped = xf.roll(H // 2, dims=-1)  # (b, a) for each pair (a, b)
    else:
        swapped = xf.unflatten(-1, (H // 2, 2)).flip(-1).flatten(-2)
    return torch.addcmul(xf * cos, swapped, sin).to(x.dtype)  # (a cos - b sin, b cos + a sin)


def _cat_bias(*linears):
    if linears[0].bias is None:
        return None
    return torch.cat([lin.bias.detach() for lin in linears])


def step_weights(model, layout: str = "rows") -> dict:
    """The tensors a forward reads from the pack (checked fresh), for a compiled step's inputs,
    and `key`: what a step compiled for them depends on (layout, blocks per matrix, dtype,
    device, shapes)."""
    P = pack(model, quick=True, layout=layout)
    return {"layers": P["layers"], "head": P["head"], "rope": P["rope"],
            "key": (layout, P["P"], P["params"][0].dtype, P["device"], P["shapes"])}


def _signature(model) -> tuple:
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


def _quick_signature(params) -> tuple:
    """What can change under a pack between two decode steps: storage (.to) and values (in place)."""
    return tuple((p.data_ptr(), p._version) for p in params)


LAYOUTS = ("rows", "out_in")


def pack(model, quick: bool = False, layout: str = "rows") -> dict:
    """The packed weights of `model` in `layout` (see _t; cached; rebuilt when a parameter changed).

    quick=True (a decode step) checks only the parameters packed last time, for new values
    or storage: walking the module tree to find them anew costs ~0.1 ms, 3% of a step.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    packs = _PACKS.setdefault(model, {})
    hit = packs.get(layout)
    if quick and hit is not None and hit["P"] == _blocks_for(hit["device"], layout):
        if _quick_signature(hit["params"]) == hit["quick"]:
            return hit
    P = _blocks_for(next(model.parameters()).device, layout)
    sig = (P, _signature(model))
    if hit is not None and hit["sig"] == sig:
        return hit
    layers = []
    with torch.no_grad():
        for b in model.blocks:
            a, f = b.attn, b.ffn
            gu = (f.w_gate, f.w_up) if f.w_gate is not None else (f.w_up,)
            layers.append(dict(
                qkv=_t(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]), P, layout),  # (D, (N+2K)H)
                qkv_b=_cat_bias(a.wq, a.wk, a.wv),
                o=_t(a.wo.weight, P, layout), o_b=None if a.wo.bias is None else a.wo.bias.detach(),  # (NH, D)
                gu=_t(torch.cat([lin.weight for lin in gu]), P, layout),  # (D, 2F) or (D, F)
                gu_b=_cat_bias(*gu),
                down=_t(f.w_down.weight, P, layout),  # (F, D)
                down_b=None if f.w_down.bias is None else f.w_down.bias.detach(),
            ))
        head = _t(model.lm_head.weight, P, layout)  # (D, V)
        rope = _rope_tables(model)
    params = list(model.parameters())
    hit = dict(sig=sig, layers=layers, head=head, rope=rope, P=P, device=params[0].device, params=params,
               quick=_quick_signature(params))
    hit["shapes"] = tuple(tuple(t.shape) for t in tensors(hit))
    packs[layout] = hit
    return hit


def tensors(P: dict) -> list[torch.Tensor]:
    """Every tensor a pack (or step_weights) holds: matrices, row-block views, biases, the head, RoPE."""
    parts = [m for layer in P["layers"] for m in layer.values() if m is not None] + [P["head"], P["rope"]]
    return [t for m in parts for t in (m if isinstance(m, tuple) else (m,)) if isinstance(t, torch.Tensor)]


def _lin(x, w, b, add=None):
    """x (..., in) times the packed matrix w (see _t), plus bias b, plus `add` (..., out), the
    residual stream (inside the library call where it can: addmm)."""
    mat, blocks, out_in = w
    io = mat.t() if out_in else mat  # (in, out), a view for the out_in layout
    n_in, n_out = io.shape
    x2 = x.reshape(-1, n_in)  # (M, in)
    base = add if b is None else (b if add is None else add + b)  # what the product adds to
    one_row = x2.shape[0] == 1
    if one_row and out_in:  # each output a dot product over one contiguous weight row
        # torch.compile turns this into a loop that streams the rows, split among the threads
        # (~2x the bytes per second of the BLAS kernels at one row, bench/matvec.py); eagerly
        # it would build the (out, in) product first, so only a compiled step takes this layout.
        y = (mat * x2).sum(-1, keepdim=True).view(1, n_out)  # (out, in) -> (out, 1) -> (1, out)
    elif one_row and blocks is not None:  # a matrix-vector product: the P blocks on P threads at once
        P = blocks.shape[0]
        xs = x2.view(P, 1, -1)  # (P, 1, in/P)
        # baddbmm rather than bmm: torch.compile keeps it a library call on the CPU, where it
        # rewrites a one-row bmm as a multiply-and-sum loop that streams the weights slower.
        y = torch.baddbmm(x2.new_zeros(()), xs, blocks, beta=0).sum(0)  # (P, 1, out) partial sums -> (1, out)
    else:  # one library product, every thread inside it, the residual added inside it (addmm)
        y = x2 @ io if base is None else torch.addmm(base.reshape(-1, n_out), x2, io)  # (M, out)
        return y.view(*x.shape[:-1], n_out)
    y = y if base is None else base.reshape(1, -1) + y  # the one-row forms add after the product
    return y.view(*x.shape[:-1], n_out)


def _attention(block, p, x, rope, q_pos, cache, start, residual=None):
    cfg = block.cfg
    B, T, _ = x.shape
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = _lin(x, p["qkv"], p["qkv_b"]).view(B, T, N + 2 * K, H)  # (B, T, N+2K, H)
    qk, v = qkv[:, :, : N + K], qkv[:, :, N + K:]  # (B, T, N+K, H) queries and keys side by side, (B, T, K, H)
    if rope is not None:
        qk = _rotate(qk, *rope, cfg.rope_pairs)  # one rotation for both (same angles per position)
    qk, v = qk.transpose(1, 2), v.transpose(1, 2)  # (B, N+K, T, H), (B, K, T, H)
    k, v = cache.update(q_pos, qk[:, N:], v)  # (B, K, Tk, H)
    z = block.attn.kernel(qk[:, :N], k, v, q_pos=q_pos, window=cfg.sliding_window, start=start)  # (B, N, T, H)
    return _lin(z.transpose(1, 2).reshape(B, T, cfg.q_dim), p["o"], p["o_b"], residual)  # (B, T, D), + residual


def _norm(norm, x):
    """The block's norm; RMSNorm as one fused op (same formula: fp32, then the weight)."""
    if isinstance(norm, RMSNorm) and norm.bias is None:
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], norm.weight, eps=norm.eps)
        return norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)
    return norm(x)


def _ffn(block, p, x, residual=None):
    kind = block.cfg.ffn
    h = _lin(x, p["gu"], p["gu_b"])  # (B, T, 2F) or (B, T, F)
    if kind == "swiglu":
        F_ = h.shape[-1] // 2
        act = ffn_activation(kind, h[..., F_:], h[..., :F_])  # gate first, then up
    else:
        act = ffn_activation(kind, h)
    return _lin(act, p["down"], p["down_b"], residual)  # (B, T, D), + residual


def packed_forward(model, idx: torch.Tensor, cache, pos=0, last: torch.Tensor | None = None,
                   weights: dict | None = None, layout: str = "rows") -> torch.Tensor:
    """Logits (B, T, V) of Transformer.forward(idx, cache=cache, pos=pos), in eval mode.

    last (B,): only the logits of position last[b] of each row, (B, 1, V). A prefill needs
    no more, and the head over every prompt position would be most of a long prompt's
    work at a large vocabulary (Hugging Face's generate does the same: logits_to_keep).
    weights: pack(model)'s layers, head and rope, checked by the caller (a compiled step
    takes them as inputs, so its graph holds no freshness check).
    """
    cfg = model.config
    B, T = idx.shape
    P = pack(model, quick=T == 1, layout=layout) if weights is None else weights
    q_pos = model._positions(pos, B, T, idx.device)  # (B, T)
    start = None if isinstance(pos, torch.Tensor) and pos.dim() > 0 else int(pos)
    cache.prepare(pos, T)
    x = model.embed(idx)  # (B, T, D)
    if model.pos_embed is not None:
        x = x + model.pos_embed(q_pos)
    rope = None
    if P["rope"] is not None:
        cos, sin = P["rope"]  # (S, H) each
        if start is not None:
            rope = cos[start:start + T, None], sin[start:start + T, None]  # (T, 1, H): every row alike
        else:
            rope = cos[q_pos][:, :, None], sin[q_pos][:, :, None]  # (B, T, 1, H)
    for block, p, layer_cache in zip(model.blocks, P["layers"], cache.layers):
        if cfg.norm_placement == "pre":
            h = _attention(block, p, _norm(block.attn_norm, x), rope, q_pos, layer_cache, start, residual=x)
            x = _ffn(block, p, _norm(block.ffn_norm, h), residual=h)
        else:
            h = _norm(block.attn_norm, x + _attention(block, p, x, rope, q_pos, layer_cache, start))
            x = _norm(block.ffn_norm, h + _ffn(block, p, h))
    if last is not None:
        x = x[torch.arange(B, device=x.device), last.to(x.device)][:, None]  # (B, 1, D)
    return _lin(_norm(model.final_norm, x), P["head"], None)  # (B, T, V) or (B, 1, V)
