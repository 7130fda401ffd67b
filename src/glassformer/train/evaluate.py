"""Held-out loss of a token stream: non-overlapping windows of the model's context.

Every token after the first is scored exactly once; each window's first input token is
conditioned on nothing but the window (no overlap, no carried state), so the number is
independent of batch size and world size up to float summation order.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch


def windows(n_tokens: int, ctx: int, block: int | None = None) -> list[tuple[int, int]]:
    """(start, length) of each window: inputs ids[s:s+len], targets ids[s+1:s+1+len]; with block,
    one a block, of at most block-1 (docs/data.md#conversation-data).

    >>> windows(10, 4), windows(10, 8, block=5)
    ([(0, 4), (4, 4), (8, 1)], [(0, 4), (5, 4)])
    """
    step = ctx if block is None else block
    ctx = ctx if block is None else min(ctx, block - 1)
    return [(s, min(ctx, n_tokens - 1 - s)) for s in range(0, max(0, n_tokens - 1), step)]


@torch.no_grad()
def score(model, ids, ctx: int, device, batch_size: int = 8, rank: int = 0, world_size: int = 1,
          autocast=contextlib.nullcontext, mask=None, block: int | None = None) -> tuple[float, int]:
    """(sum of nats, tokens scored) over this rank's share of the windows of `ids` (1-D ints);
    with mask (aligned with ids, 0 = not scored) and block, over a conversation folder's scored
    targets in its whole-conversation windows."""
    ids = np.asarray(ids)
    keep = None if mask is None else np.asarray(mask)
    mine = windows(len(ids), ctx, block)[rank::world_size]
    ctx = ctx if block is None else min(ctx, block - 1)
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    # Full-length windows go in batches; a short last window on its own.
    full = [s for s, n in mine if n == ctx]
    short = [(s, n) for s, n in mine if n != ctx]
    groups = [(full[i:i + batch_size], ctx) for i in range(0, len(full), batch_size)]
    groups += [([s], n) for s, n in short]
    for starts, n in groups:
        rows = np.stack([ids[s:s + n + 1] for s in starts]).astype(np.int64)  # (B, n+1)
        rows = torch.from_numpy(rows).to(device)
        targets = rows[:, 1:]  # (B, n)
        if keep is not None:
            on = torch.from_numpy(np.stack([keep[s + 1:s + n + 1] for s in starts]).astype(bool)).to(device)  # (B, n)
            targets = targets.masked_fill(~on, -1)
        with autocast():
            logits, _ = model(rows[:, :-1])  # (B, n, V)
        nll = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum", ignore_index=-1)
        total += nll.double()
        count += rows.shape[0] * n if keep is None else int(on.sum())
    return float(total), count


def summary(nats: float, tokens: int, n_bytes: int) -> dict:
    """The eval contract's object: loss (nats/token), ppl, bpb (bits per UTF-8 byte), tokens, bytes."""
    loss = nats / max(1, tokens)
    return {
        "loss": round(loss, 6),
        "ppl": round(math.exp(min(loss, 700.0)), 4),
        "bpb": round(nats / math.log(2) / max(1, n_bytes), 6),
        "tokens": int(tokens),
        "bytes": int(n_bytes),
    }
