"""MHA -> GQA/MQA by mean-pooling key and value heads (Ainslie et al., 2023, "GQA").

Query heads are split into K consecutive groups; the group's new key head is the mean of
its members' key projections (weights and biases), and likewise for values. K equal to
n_kv_heads returns an identical copy.
"""

from __future__ import annotations

import copy

import torch

from ..model import Transformer


def pool_heads(w: torch.Tensor, n_from: int, n_to: int, head_dim: int) -> torch.Tensor:
    """Average rows of a (n_from·H, …) projection in groups of n_from // n_to heads -> (n_to·H, …).

    >>> pool_heads(torch.tensor([[1.], [3.], [5.], [7.]]), 2, 1, 2).flatten().tolist()
    [3.0, 5.0]
    """
    g = n_from // n_to
    rest = w.shape[1:]
    return w.reshape(n_to, g, head_dim, *rest).mean(dim=1).reshape(n_to * head_dim, *rest)  # (K·H, …)


@torch.no_grad()
def convert_kv_heads(model: Transformer, n_kv_heads: int) -> Transformer:
    """A new model whose attention has n_kv_heads key/value heads, pooled from the current ones."""
    cfg = model.config
    if n_kv_heads < 1 or cfg.n_kv_heads % n_kv_heads:
        raise ValueError(
            f"cannot pool {cfg.n_kv_heads} key/value heads into {n_kv_heads}: choose a divisor of {cfg.n_kv_heads}"
        )
    new = copy.deepcopy(model)
    new.config = cfg.replace(n_kv_heads=n_kv_heads)
    for block in new.blocks:
        attn = block.attn
        attn.cfg = new.config
        for name in ("wk", "wv"):
            old = getattr(attn, name)
            lin = torch.nn.Linear(cfg.dim, n_kv_heads * cfg.head_dim, bias=old.bias is not None,
                                  device=old.weight.device, dtype=old.weight.dtype)
            lin.weight.copy_(pool_heads(old.weight, cfg.n_kv_heads, n_kv_heads, cfg.head_dim))
            if old.bias is not None:
                lin.bias.copy_(pool_heads(old.bias, cfg.n_kv_heads, n_kv_heads, cfg.head_dim))
            setattr(attn, name, lin)
        if attn.ve is not None:  # v = x·W_V + ve: pooling V's heads pools the value table's columns alike
            old = attn.ve.weight  # (V, K·H)
            attn.ve = torch.nn.Embedding(old.shape[0], n_kv_heads * cfg.head_dim, device=old.device, dtype=old.dtype)
            attn.ve.weight.copy_(pool_heads(old.t(), cfg.n_kv_heads, n_kv_heads, cfg.head_dim).t())  # (V, K'·H)
    for b in new.blocks:
        b.cfg = new.config
        if b.ffn is not None:  # ffn='none': an attention-only block
            b.ffn.cfg = new.config
    return new
