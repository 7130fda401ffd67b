"""Three attention kernels behind one signature (naive, tiled, sdpa; get_kernel picks one):

    kernel(q, k, v, *, q_pos, key_mask=None, window=None, scale=None, start=None, softcap=None, sinks=None) -> out

q (B, N, Tq, H), k and v (B, K, Tk, H), out (B, N, Tq, H). Which keys a query reads (mask.py), what
`start` promises, and rows with no readable key: docs/model.md#attention-kernels."""

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
