"""The generated-text view's data (docs/viewer.md#generated-text): for each token `generate` gave,
the probability the model had for it (the softmax of one full forward over prompt + generated
text, at the position before it), its top alternatives, the sampler's stages at that step
(generation.sampling_stages, the draw being the token generate drew) and the calculations behind
those probabilities. Pure functions of a model's logits; `generated_part` puts them together.

The token at position p was chosen from the logits at position p - 1: the decode step whose
query is the token before it (for the first new token, the prompt's last token, read by the
prefill). A causal model's row p - 1 of a full forward is that step's row, so one trace of the
whole text holds every step's KV cache and new row of scores (the page reads them from it).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import UserError
from ..generation.logprobs import raw_logprobs
from ..generation.sampling_stages import sampling_stages, stage_outputs
from ..generation.session import generate
from ..text.labels import token_label
from .cancel import check as check_cancelled
from .sample_calc import probability_calcs

MAX_TOKENS = 64  # new tokens per generation in the explorer: the page's trace grows with T², its data with T
ALTERNATIVES = 5  # top alternatives listed per token
STAGE_IDS = 10  # ids kept per sampling stage: the page draws ten bars a stage, as the sampling view does
STAGE_CALCS = 3  # the last stage's most likely ids whose calculation is stored (and the token drawn): 0.7 kB each
EXPLAIN_LIMIT = 300  # calculations a saved page stores of the trace's numbers (render's default: 1,200)
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
DEFAULTS = {"temperature": 1.0, "repetition_penalty": 1.0}  # generate's; the others default to off (None)

Piece = Callable[[int], str]  # id -> the token's text


def check_max_tokens(n: int, prompt_len: int, context: int, flag: str = "max_tokens") -> None:
    """UserError unless 1 <= n <= MAX_TOKENS and the prompt and n new tokens fit the context."""
    if not 1 <= n <= MAX_TOKENS:
        raise UserError(f"{flag} must be in 1..{MAX_TOKENS} (the generated-text view draws at most {MAX_TOKENS} new tokens), got {n}")
    if prompt_len + n > context:
        raise UserError(f"the prompt has {prompt_len} tokens and {n} more do not fit the model's context of "
                        f"{context}: ask for at most {max(context - prompt_len, 0)}")


def new_tokens(model, ids: list[int], max_tokens: int, settings: dict, stop: list[int] | None = None) -> list[int]:
    """The tokens `glassformer.generate` gives after `ids` with these settings (a seed fixes the draws),
    the stop token included where it came: the same as `glassformer generate` prints."""
    kw = {k: settings[k] for k in SETTINGS if k in settings}
    out = []
    for i in generate(model, ids, max_new_tokens=max_tokens, stop=stop, **kw):
        out.append(int(i))
        check_cancelled()  # the explorer's client left: stop at this token, not after max_tokens
    return out


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits (T, V) of one full forward over `ids`, in float32."""
    x = torch.tensor([ids], device=next(model.parameters()).device)  # (1, T)
    with torch.inference_mode():
        logits, _ = model(x)  # (1, T, V)
    return logits[0].float()  # (T, V)


def _g(x: float) -> str:
    return f"{float(x):.6g}"


def row_sums(row: torch.Tensor) -> dict:
    """What every probability of one row of logits (V,) shares: its largest logit m and Σ exp(z − m)."""
    z = row.double()
    m = float(z.max())
    return {"max": m, "total": float(torch.exp(z - m).sum()), "vocab": int(row.shape[-1])}


def probability_calc(z: float, value: float, sums: dict, label: str, query: int) -> dict:
    """{"title", "text", "result", "value"}: the softmax that gives one id the probability `value`
    at position `query` from its logit z, recomputed from the numbers shown (the page marks
    whether it equals the forward's)."""
    m, total = sums["max"], sums["total"]
    p = math.exp(z - m) / total
    lines = [f"logit z = {_g(z)}: the model's output for “{label}” at position {query}",
             f"the row's largest logit m = {_g(m)} (subtracted so that no exp overflows)",
             f"Σ exp(z_j − m) over all {sums['vocab']:,} ids = {_g(total)}",
             f"p = exp(z − m) / Σ = exp({_g(z - m)}) / {_g(total)} = {_g(p)}"]
    return {"title": f"p(“{label}”) = {_g(value)}", "text": "\n".join(lines), "result": p, "value": value}


def candidate(row: torch.Tensor, probs: torch.Tensor, i: int, sums: dict, piece: Piece, query: int) -> dict:
    """One id at one position: id, piece, label (text.labels.token_label), prob, logit and the prob's calculation."""
    text = str(piece(i))
    label, prob, logit = token_label(text), float(probs[i]), float(row[i])
    return {"id": int(i), "piece": text, "label": label, "prob": prob, "logit": logit,
            "calc": probability_calc(logit, prob, sums, label, query)}


def token_entry(row: torch.Tensor, i: int, piece: Piece, query: int, k: int = ALTERNATIVES) -> dict:
    """The token `i` chosen from logits `row` (V,) at position `query`: its candidate entry, its
    log-probability (generation.logprobs: of the raw distribution), its rank and the k most likely ids."""
    probs = torch.softmax(row, -1)  # (V,)
    sums = row_sums(row)
    top = probs.topk(min(k, probs.shape[-1])).indices.tolist()
    return {**candidate(row, probs, i, sums, piece, query), "logprob": float(raw_logprobs(row)[i]),
            "rank": int((probs > probs[i]).sum()) + 1,
            "top": [candidate(row, probs, j, sums, piece, query) for j in top]}


def _trimmed(stage: dict, n: int = STAGE_IDS) -> dict:
    """A stage of sampling_stages with only its n most likely ids listed (the rest's mass grows by what is cut)."""
    rest = stage["rest"] + sum(stage["probs"][n:])
    return {**stage, "ids": stage["ids"][:n], "values": stage["values"][:n], "probs": stage["probs"][:n], "rest": rest}


def step_sampling(row: torch.Tensor, seen: list[int], settings: dict, chosen: int, piece: Piece) -> dict:
    """The sampler's stages at one step (as /api/sample answers them, STAGE_IDS ids a stage), `chosen`
    being the token generate drew there; `sampled`: the probability the draw gave it; `calc`: the
    calculations of the last stage's listed probabilities."""
    filters = {k: settings[k] for k in SETTINGS if k in settings and k != "seed"}
    outs = stage_outputs(row, seen, **filters)
    out = sampling_stages(row, seen, **filters, seed=settings.get("seed") or 0, outputs=outs)
    stages = [_trimmed(st) for st in out["stages"]]
    final = outs["probs"][0]  # (V,)
    greedy = not filters.get("temperature")
    sampled = 1.0 if greedy else float(final[chosen])
    shown = {i for st in stages for i in st["ids"]} | {chosen}
    pieces = {str(i): str(piece(i)) for i in sorted(shown)}
    labels = {i: token_label(p) for i, p in pieces.items()}
    calc_ids = list(dict.fromkeys(stages[-1]["ids"][:STAGE_CALCS] + ([chosen] if sampled > 0 else [])))
    return {"stages": stages, "chosen": int(chosen), "sampled": sampled, "pieces": pieces, "labels": labels,
            "calc": probability_calcs(outs, {**filters, "seed": settings.get("seed")}, calc_ids, labels)}


def generated_part(logits: torch.Tensor, prompt: list[int], new: list[int], settings: dict, piece: Piece,
                   *, text: str = "", roundtrip: bool = True, max_tokens: int | None = None) -> dict:
    """The payload's `generated` part: logits (T, V) of one full forward over prompt + new, one entry
    per new token (position, query, id, piece, label, prob, logprob, rank, top, sampling).

    text: the prompt and its continuation as text; roundtrip: whether that text encodes back to the
    same ids (the page's other views re-read the text from the server)."""
    ids, n = list(prompt) + list(new), len(prompt)
    if logits.shape[0] != len(ids):
        raise ValueError(f"{len(ids)} ids need logits at {len(ids)} positions, got {logits.shape[0]}")
    tokens = []
    for j, i in enumerate(new):
        q = n + j - 1  # the position whose logits chose it
        entry = token_entry(logits[q], i, piece, q)
        entry.update(position=n + j, query=q, sampling=step_sampling(logits[q], ids[:n + j], settings, i, piece))
        tokens.append(entry)
    return {"prompt_tokens": n, "ids": ids, "settings": {k: settings.get(k, DEFAULTS.get(k)) for k in SETTINGS},
            "max_tokens": len(new) if max_tokens is None else max_tokens, "text": text, "roundtrip": roundtrip,
            "tokens": tokens}
