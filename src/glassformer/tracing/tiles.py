"""The FlashAttention walk-through: one query row through the tiled kernel, tile by tile.

The kernel (attention/tiled.py) logs its running max m, sum l, output o and rescale alpha
per (query tile, key tile); this is the one place that turns the log into one row's walk
(`row_walk`, a trace's `blocks.i.attn.tiles`), runs the kernel for one (`kernel_walk`) and
reads one head out (`head_walk`). Stored form: docs/trace-format.md#tiles-the-flashattention-walk-through-of-one-query-row.
"""

from __future__ import annotations

import torch

from ..attention.tiled import tiled_attention
from .format import json_ready


def row_walk(log: list[dict], row: int, heads: list[int], n_heads: int, position: int, tile: int) -> dict:
    """The tiles that query row `row` went through, from the tiled kernel's tile_log (batch row 0)."""
    steps = []
    for e in log:
        q0, q1 = e["q"]
        if not q0 <= row < q1:
            continue
        step = {"q": [q0, q1], "k": list(e["k"]), "skipped": bool(e["skipped"])}
        if not e["skipped"]:
            r = row - q0

            def per_head(t):  # (B, K, G, tq, X) -> (heads, X) for this row
                t = t[0].reshape(n_heads, t.shape[3], t.shape[4])[:, r]  # (N, X)
                return t[heads].float().cpu()

            step["scores"] = per_head(e["scores"])  # (h, tk), -inf where masked
            step["m"] = per_head(e["m"])[:, 0]
            step["l"] = per_head(e["l"])[:, 0]
            step["alpha"] = per_head(e["alpha"])[:, 0]
            step["o"] = per_head(e["o"])  # (h, H)
        steps.append(step)
    return {"query": row, "position": position, "tile_size": tile, "heads": list(heads), "steps": steps}


def kernel_log(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, tile: int, positions: list[int] | None = None,
               window: int | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Run the tiled kernel on one text's q (T, N, H), k and v (T, K, H) (as traced: after RoPE):
    its output (T, N, H) and its tile log."""
    T = q.shape[0]
    positions = list(range(T)) if positions is None else list(positions)
    log: list[dict] = []
    out = tiled_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # (1, heads, T, H)
                          q_pos=torch.tensor([positions]), window=window, start=positions[0], tile=tile, tile_log=log)
    return out[0].transpose(0, 1), log  # (T, N, H)


def kernel_walk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, row: int, tile: int,
                positions: list[int] | None = None, window: int | None = None, heads: list[int] | None = None) -> dict:
    """Row `row`'s walk (row_walk's form) of the tiled kernel run on q, k, v (see kernel_log);
    `output` holds the kernel's whole result (T, N, H)."""
    T, N = q.shape[0], q.shape[1]
    positions = list(range(T)) if positions is None else list(positions)
    out, log = kernel_log(q, k, v, tile=tile, positions=positions, window=window)
    walk = row_walk(log, row, list(range(N)) if heads is None else list(heads), N, positions[row], tile)
    walk["output"] = out
    return walk


def head_walk(tiles: dict, head: int) -> dict:
    """One head's steps of a row walk (tensors or their JSON lists), as plain JSON data.

    Each step: key range, skipped or not, this row's scaled scores in the tile (None where
    masked), and m, l, alpha, o after it. `output` = o / l after the last tile: the kernel's
    output for this row.
    """
    h = tiles["heads"].index(head)
    steps, l, o = [], None, None
    for s in tiles["steps"]:
        step = {"q": list(s["q"]), "k": list(s["k"]), "skipped": bool(s["skipped"])}
        if not s["skipped"]:
            l, o = float(s["l"][h]), [float(x) for x in s["o"][h]]
            step.update(scores=[None if x is None else float(x) for x in s["scores"][h]], m=float(s["m"][h]), l=l,
                        alpha=float(s["alpha"][h]), o=o)
        steps.append(step)
    output = [x / l for x in o] if l else None
    return json_ready({"head": head, "query": tiles["query"], "position": tiles["position"],
                       "tile_size": tiles["tile_size"], "steps": steps, "output": output})


__all__ = ["row_walk", "kernel_log", "kernel_walk", "head_walk"]
