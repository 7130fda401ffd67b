"""Sampling: logits -> probabilities -> one token per row, Hugging Face's filters in its order.

check_sampling (the parameters' ranges, as UserErrors), apply_repetition_penalty (CTRL's, on the
tokens already seen), the stages temperature_stage, top_k_stage, top_p_stage, min_p_stage and
logits_to_probs (all of them in order), sample (one token per row); sampling_stages.py shows
each stage's output for the explorer with these same functions.
docs/generation.md#sampling-exactly.
"""

from __future__ import annotations

import torch

from ..errors import UserError


def check_sampling(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> None:
    """Raise UserError for sampling parameters outside their ranges."""
    if not temperature >= 0:
        raise UserError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise UserError(f"top-k must be an integer >= 1 (or unset), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top-p must be in (0, 1] (1 keeps everything), got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise UserError(f"min-p must be in [0, 1], got {min_p}")
    if not repetition_penalty > 0:
        raise UserError(f"repetition penalty must be > 0 (1 means none), got {repetition_penalty}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al., 2019, as Hugging Face applies it) on the tokens `seen` (B, V) bool:
    a positive logit (B, V) is divided by `penalty`, a negative one multiplied. docs/generation.md#sampling-exactly.

    >>> apply_repetition_penalty(torch.tensor([[2., -2., 2.]]), torch.tensor([[True, True, False]]), 2.0)
    tensor([[ 1., -4.,  2.]])
    """
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # (B, V)
    return torch.where(seen, penalised, logits)


def temperature_stage(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits (..., V) divided by the temperature, in float32 (T > 0; T = 0 is greedy, never divided)."""
    return logits.float() / temperature


def top_k_stage(logits: torch.Tensor, top_k=None) -> torch.Tensor:
    """Logits (..., V) with all but the k largest set to -inf (exactly k: ties broken by index)."""
    V = logits.shape[-1]
    if top_k is None or top_k >= V:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(int(top_k), -1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_stage(probs: torch.Tensor, top_p=None) -> torch.Tensor:
    """Probabilities (..., V) of the tokens whose more likely tokens sum to less than top_p, renormalised."""
    if top_p is None or top_p >= 1:
        return probs
    p_sorted, order = probs.sort(-1, descending=True)  # (..., V) each
    before = p_sorted.cumsum(-1) - p_sorted  # mass of the strictly more likely tokens
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, before < top_p)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def min_p_stage(probs: torch.Tensor, min_p=None) -> torch.Tensor:
    """Probabilities (..., V) of the tokens at least min_p times the most likely one's, renormalised."""
    if min_p is None or min_p <= 0:
        return probs
    probs = probs * (probs >= min_p * probs.amax(-1, keepdim=True))
    return probs / probs.sum(-1, keepdim=True)


def logits_to_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Probabilities (B, V) to sample from: temperature, top_k, top_p, min_p in Hugging Face's order,
    each filter renormalising what it keeps (the stage functions above, one after another).
    docs/generation.md#sampling-exactly.

    >>> logits_to_probs(torch.tensor([[0.5, 0.3, 0.2]]).log(), top_p=0.7)
    tensor([[0.6250, 0.3750, 0.0000]])
    """
    logits = top_k_stage(temperature_stage(logits, temperature), top_k)  # (B, V)
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return min_p_stage(top_p_stage(probs, top_p), min_p)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (..., V) -> (...): each row's first maximum, taken through max(), which returns the
    same index; on the CPU torch's argmax over a few rows of a vocabulary is several times slower."""
    return x.max(-1).indices


def sample(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None, greedy=False, generator=None) -> torch.Tensor:
    """One token id per row (B,) from logits (B, V): the argmax when greedy or temperature == 0.

    Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent
    picks i with probability p_i (the smallest of E_i / p_i, each Exp(p_i), is i's with
    chance p_i / Σp), with no device sync and one random draw per token.
    """
    if greedy or temperature == 0:
        return first_argmax(logits)
    probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)  # (B, V)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)  # (B, V)
    return first_argmax(probs / race)
