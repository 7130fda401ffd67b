"""Log-likelihoods of continuations, batched by length, each shared context prefilled once.

A multiple-choice question asks for log P(choice | question) for every choice: the question's
tokens are the same in each request. They go through the model once, into a KV cache row; the
row is copied for every choice, and only each choice's own tokens run after it (the model's own
forward with cache= and pos=, the same modules as every other path). This module knows nothing
of the harness: requests are (context ids, continuation ids) pairs.

    >>> fit([1, 2, 3, 4], [5, 6], max_len=4)    # the harness's left cut: at most 4 input tokens
    ([2, 3, 4], [5, 6])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..generation.session import prefill
from ..kv_cache import KVCache


def fit(context: list[int], continuation: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """(the context tokens the model reads, continuation) with the input cut on the left to
    max_len tokens, as the harness's own models cut it: the input is context + continuation
    without its last token."""
    if not continuation:
        raise UserError("a log-likelihood request has an empty continuation: nothing to score")
    if len(continuation) > max_len:
        raise UserError(f"a continuation of {len(continuation)} tokens does not fit the model's context "
                        f"of {max_len}: use a model with a longer context or a task with shorter answers")
    whole = (context + continuation)[-(max_len + 1):]
    return whole[: len(whole) - len(continuation)], continuation


@dataclass
class Group:
    """Requests that read the same context: one cache row prefilled, copied for the others."""
    context: list[int]
    members: list[int] = field(default_factory=list)  # indices into the request list
    tails: list[list[int]] = field(default_factory=list)  # each member's continuation

    @property
    def longest(self) -> int:
        return len(self.context) + max(len(t) for t in self.tails)


def group_requests(requests: list[tuple[list[int], list[int]]], max_len: int) -> list[Group]:
    """Requests (context, continuation) by their fitted context, longest first (the harness's
    order: padding stays small, and memory runs out on the first batch if it ever does)."""
    groups: dict[tuple[int, ...], Group] = {}
    for i, (ctx, cont) in enumerate(requests):
        ctx, cont = fit(list(ctx), list(cont), max_len)
        g = groups.setdefault(tuple(ctx), Group(ctx))
        g.members.append(i)
        g.tails.append(cont)
    return sorted(groups.values(), key=lambda g: (-g.longest, -len(g.context), g.context))


def batches(groups: list[Group], batch_size: int, max_len: int) -> list[list[Group]]:
    """Whole groups in batches of about batch_size rows (a group larger than that goes alone),
    so that every row's context plus the batch's longest continuation tail fits max_len
    positions (a right-padded tail must not run past the model's last position)."""
    out: list[list[Group]] = []
    rows = ctx = tail = 0
    for g in groups:
        g_tail = max(len(t) for t in g.tails) - 1
        fits = rows + len(g.members) <= batch_size and max(ctx, len(g.context)) + max(tail, g_tail) <= max_len
        if out and fits:
            out[-1].append(g)
            rows, ctx, tail = rows + len(g.members), max(ctx, len(g.context)), max(tail, g_tail)
        else:
            out.append([g])
            rows, ctx, tail = len(g.members), len(g.context), g_tail
    return out


def _right_padded(rows: list[list[int]], device) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long, device=device)  # (B, T)


@torch.inference_mode()
def score_batch(model, batch: list[Group]) -> dict[int, tuple[float, bool]]:
    """{request index: (log-likelihood of its continuation, whether greedy decoding gives it)}.

    Rows 0..G-1 hold each group's first member: its context is prefilled there (one forward,
    right-padded), then copied into the rows of the group's other members; every row's
    continuation but its last token then runs in a second forward at its own position."""
    device = next(model.parameters()).device
    firsts = [(g, 0) for g in batch]
    others = [(g, j) for g in batch for j in range(1, len(g.members))]
    rows = firsts + others  # (group, member) per cache row
    group_row = {id(g): r for r, g in enumerate(batch)}
    n_ctx = [len(g.context) for g, _ in rows]
    tails = [g.tails[j][:-1] for g, j in rows]  # the continuation tokens fed as input
    T = max(len(t) for t in tails)
    cache = KVCache.for_model(model, len(rows), max(c + T for c in n_ctx))
    lengths = torch.tensor(n_ctx[: len(batch)], device=device)  # (G,)
    first = prefill(model, _right_padded([g.context for g in batch], device),
                    cache.view(0, len(batch)), 0, lengths).float().log_softmax(-1)  # (G, V)
    for r in range(len(batch), len(rows)):
        cache.copy_row(group_row[id(rows[r][0])], r, n_ctx[r])
    lp = first[torch.tensor([group_row[id(g)] for g, _ in rows], device=device)][:, None]  # (R, 1, V)
    if T > 0:
        # Each row goes on where its context ends: one position for all (a slice of the cache) or (R,).
        pos = n_ctx[0] if len(set(n_ctx)) == 1 else torch.tensor(n_ctx, device=device)
        logits, _ = model(_right_padded([t or [0] for t in tails], device), cache=cache, pos=pos)  # (R, T, V)
        lp = torch.cat([lp, logits.float().log_softmax(-1)], 1)  # (R, 1 + T, V): row r's position i predicts cont[i]
    return _picked(lp, [g.tails[j] for g, j in rows], [g.members[j] for g, j in rows])


def _picked(lp: torch.Tensor, conts: list[list[int]], members: list[int]) -> dict[int, tuple[float, bool]]:
    """Each row's summed log-probability of its continuation and whether every token is the argmax,
    read off lp (R, 1 + T, V) in one pass (one copy to the host, not one per row)."""
    want = _right_padded(conts, lp.device)  # (R, C) with C <= 1 + T
    lengths = torch.tensor([len(c) for c in conts], device=lp.device)  # (R,)
    real = torch.arange(want.shape[1], device=lp.device)[None] < lengths[:, None]  # (R, C): not padding
    lp = lp[:, : want.shape[1]]  # (R, C, V)
    picked = lp.gather(-1, want[..., None])[..., 0].double().masked_fill(~real, 0.0)  # (R, C)
    greedy = ((lp.argmax(-1) == want) | ~real).all(-1)  # (R,)
    return {m: (s, g) for m, s, g in zip(members, picked.sum(-1).tolist(), greedy.tolist())}


def loglikelihoods(model, requests: list[tuple[list[int], list[int]]], batch_size: int,
                   progress=None) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of every request (context ids, continuation ids), in order."""
    S = model.config.max_seq_len
    out: dict[int, tuple[float, bool]] = {}
    for batch in batches(group_requests(requests, S), batch_size, S):
        done = score_batch(model, batch)
        out.update(done)
        if progress is not None:
            progress(done)
    return [out[i] for i in range(len(requests))]
