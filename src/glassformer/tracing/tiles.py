"""The FlashAttention walk-through: one query row through the tiled kernel, tile by tile.

The kernel (attention/tiled.py) logs its running max m, sum l, output o and rescale alpha
per (query tile, key tile); this is the one place that turns the log into one row's walk
(`row_walk`, a trace's `blocks.i.attn.tiles`), runs the kernel for one (`kernel_walk`) and
reads one head out (`head_walk`), or every row and head of a log in one pass (`head_walks`).
Stored form: docs/trace-format.md#tiles-the-flashattention-walk-through-of-one-query-row.
"""

from __future__ import annotations

import math

import torch

from ..attention.tiled import tiled_attention


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
               window: int | None = None, scale: float | None = None,
               softcap: float | None = None) -> tuple[torch.Tensor, list[dict]]:
    """Run the tiled kernel on one text's q (T, N, H), k and v (T, K, H) (as traced: after RoPE):
    its output (T, N, H) and its tile log. window, scale, softcap: the layer's own (a sliding layer's
    window, Gemma's query_pre_attn_scalar^−½ and score cap)."""
    T = q.shape[0]
    positions = list(range(T)) if positions is None else list(positions)
    log: list[dict] = []
    out = tiled_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],  # (1, heads, T, H)
                          q_pos=torch.tensor([positions]), window=window, start=positions[0], tile=tile, tile_log=log,
                          scale=scale, softcap=softcap)
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


def head_walk(tiles: dict, head: int, sink_weight: float | None = None) -> dict:
    """One head's steps of a row walk (tensors or their JSON lists), as plain JSON data.

    Each step: key range, skipped or not, this row's scaled scores in the tile (None where
    masked), and m, l, alpha, o after it. `output` = o / l after the last tile: the kernel's
    output for this row. sink_weight: with attention sinks, the weight the head's sink took in this
    row (the traced .sink_weight); the sink joins l after the last tile, so output = o / l · (1 − it).
    """
    h = tiles["heads"].index(head)
    steps = []
    for s in tiles["steps"]:
        if s["skipped"]:
            steps.append(_walk_step(s, None, None, None, None, None))
            continue
        m, l, alpha = (_number(s[n][h]) for n in ("m", "l", "alpha"))
        steps.append(_walk_step(s, [_number(x) for x in s["scores"][h]], m, l, alpha, [_number(x) for x in s["o"][h]]))
    return _walk(head, tiles["query"], tiles["position"], tiles["tile_size"], steps, sink_weight)


def head_walks(log: list[dict], rows: list[int], heads: list[int], n_heads: int, positions: list[int],
               tile: int, sink_weight=None) -> dict[tuple[int, int], dict]:
    """{(row, head): head_walk(row_walk(log, row, ...), head)} for every row and head, in one
    pass over the kernel's tile log: each tile's tensors are read out once for all its rows."""
    wanted = set(rows)
    steps: dict[tuple[int, int], list] = {(r, h): [] for r in rows for h in heads}
    for e in log:
        q0, q1 = e["q"]
        mine = [r for r in range(q0, q1) if r in wanted]
        if not mine:
            continue
        if e["skipped"]:
            for key in ((r, h) for r in mine for h in heads):
                steps[key].append(_walk_step(e, None, None, None, None, None))
            continue
        # (B, K, G, tq, X) -> [head][row in tile][X], one tolist per tensor
        got = {n: e[n][0].reshape(n_heads, e[n].shape[3], e[n].shape[4])[heads].float().tolist()
               for n in ("scores", "m", "l", "alpha", "o")}
        for r in mine:
            for j, h in enumerate(heads):
                steps[r, h].append(_walk_step(e, got["scores"][j][r - q0], got["m"][j][r - q0][0],
                                              got["l"][j][r - q0][0], got["alpha"][j][r - q0][0], got["o"][j][r - q0]))
    # sink_weight: (T, heads) the traced .sink_weight, in the order of `heads` (attention sinks only)
    return {(r, h): _walk(h, r, positions[r], tile, st, None if sink_weight is None else float(sink_weight[r][j]))
            for (r, h), st in steps.items() for j in [heads.index(h)]}


def _number(x) -> float | None:
    """A tensor's or a JSON list's entry as a float (None: a masked or non-finite one, as stored)."""
    return None if x is None else float(x)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _walk_step(entry: dict, scores: list | None, m: float | None, l: float | None, alpha: float | None,
               o: list | None) -> dict:
    """One step of a head's walk as JSON data (non-finite numbers as None); scores and o are
    this row's lists, m, l, alpha its numbers, all None for a skipped tile."""
    step = {"q": list(entry["q"]), "k": list(entry["k"]), "skipped": bool(entry["skipped"])}
    if not entry["skipped"]:
        step.update(scores=[_finite(x) for x in scores], m=_finite(m), l=_finite(l), alpha=_finite(alpha),
                    o=[_finite(x) for x in o])
    return step


def _walk(head: int, query: int, position: int, tile: int, steps: list[dict], sink_weight: float | None = None) -> dict:
    """A head's walk from its steps: `output` = o / l after the last computed tile; with a sink,
    times 1 − the weight the sink took (it joins l once the tiles are done: attention/tiled.py)."""
    last = next((st for st in reversed(steps) if not st["skipped"]), None)
    l = last["l"] if last else None
    keep = 1.0 if sink_weight is None else 1.0 - sink_weight
    output = [None if x is None else _finite(x / l * keep) for x in last["o"]] if l else None
    walk = {"head": head, "query": query, "position": position, "tile_size": tile, "steps": steps, "output": output}
    if sink_weight is not None:
        walk["sink_weight"] = sink_weight
    return walk


__all__ = ["row_walk", "kernel_log", "kernel_walk", "head_walk", "head_walks"]
