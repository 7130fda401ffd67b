"""Three attention kernels behind one signature.

Every kernel is a function

    kernel(q, k, v, *, q_pos, key_mask=None, window=None, scale=None, start=None) -> out

with q (B, N, Tq, H), k and v (B, K, Tk, H) where N is a multiple of K (GQA: each group of
N // K query heads reads one key/value head; MQA is K = 1), q_pos (B, Tq) the position of
each query, and key j sitting at position j (a key/value cache slot is its position).
Query i of row b may read key j when

    j <= q_pos[b, i]                       (causal: nothing from the future)
    q_pos[b, i] - j < window               (sliding window, when given)
    key_mask[b, j]                         (padding, when given)

A query that may read no key at all (a padding row) gets an output of zeros.
`out` is (B, N, Tq, H). `start`, when given, promises q_pos[b, i] == start + i for every
row, which lets a kernel plan without reading q_pos (sdpa's is_causal fast path, tiled's
skipping) and so without a device sync.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .naive import naive_attention
from .sdpa import sdpa_attention
from .tiled import tiled_attention

Kernel = Callable[..., torch.Tensor]

KERNELS: dict[str, Kernel] = {
    "naive": naive_attention,
    "tiled": tiled_attention,
    "sdpa": sdpa_attention,
}


def get_kernel(name: str, tile: int = 64) -> Kernel:
    """The kernel called `name`; the tiled one comes with its tile size bound."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of: {', '.join(KERNELS)}")
    if name == "tiled":
        return functools.partial(tiled_attention, tile=tile)
    return KERNELS[name]


__all__ = ["KERNELS", "get_kernel", "naive_attention", "tiled_attention", "sdpa_attention"]
