"""Sampling: logits -> probabilities -> one token per row, Hugging Face's filters in its order.

check_sampling (the parameters' ranges, as UserErrors), apply_repetition_penalty (CTRL's, on the
tokens already seen), the stages temperature_stage, top_k_stage, top_p_stage, min_p_stage and
logits_to_probs (all of them in order), sample (one token per row; draw, the same without the check
that reads the tokens back); sampling_stages.py shows each stage's output for the explorer with these
same functions. Every valid setting gives a distribution (finite, summing to 1) for finite logits;
float32 holds ordinary values exactly as Hugging Face computes them, float64 and the limits past it
the rest. docs/generation.md#sampling-exactly, #the-range-of-the-settings.
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError

F32_MAX = torch.finfo(torch.float32).max  # 3.4e38
F32_TINY = torch.finfo(torch.float32).tiny  # 1.2e-38: the smallest normal float32; below it float32 loses digits
# Penalties applied in the logits' own dtype, as Hugging Face applies them (in float32 a logit up to
# 3.4e32 without overflow). Outside, in float64, the penalty clamped to 2^-896..2^896, where a float32
# logit (< 2^128) divided or multiplied by it stays below float64's 2^1024.
PENALTY_F32 = (1e-6, 1e6)
PENALTY_F64 = (2.0 ** -896, 2.0 ** 896)


class NonFiniteLogits(UserError):
    """A row's logits hold a NaN or +inf, or nothing but -inf: no token can be drawn (a broken model or
    weights, or a dtype that overflows; never a valid sampling setting). The batching engine ends that
    request with finish "error" (serve's 500); the CLI prints it as its one error line."""

    def __init__(self, message: str = ""):
        super().__init__(message or "the model's logits are not finite (NaN or infinite) at this step, so no token "
                                    "can be drawn: the model or its weights are broken, or overflow in this dtype "
                                    "(try float32)")


def check_sampling(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> None:
    """Raise UserError for sampling parameters outside their ranges (inf and NaN are outside every range).
    Every value inside gives a distribution: docs/generation.md#the-range-of-the-settings."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise UserError(f"temperature must be >= 0 (0 means greedy) and finite, got {temperature}")
    if top_k is not None and not (math.isfinite(top_k) and int(top_k) == top_k and top_k >= 1):
        raise UserError(f"top-k must be an integer >= 1 (or unset), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top-p must be in (0, 1] (1 keeps everything), got {top_p}")
    if min_p is not None and not 0 <= min_p <= 1:
        raise UserError(f"min-p must be in [0, 1], got {min_p}")
    if not (repetition_penalty > 0 and math.isfinite(repetition_penalty)):
        raise UserError(f"repetition penalty must be > 0 (1 means none) and finite, got {repetition_penalty}")


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al., 2019, as Hugging Face applies it) on the tokens `seen` (B, V) bool:
    a positive logit (B, V) is divided by `penalty`, a negative one multiplied. docs/generation.md#sampling-exactly.
    In the logits' dtype for a penalty in PENALTY_F32 (a result past the dtype's range saturates at its
    largest number); else in float64 (returned so), the penalty clamped to PENALTY_F64, so that every
    finite logit stays finite (without float64, on MPS: float32, saturating). NaN and infinite logits
    pass unchanged.

    >>> apply_repetition_penalty(torch.tensor([[2., -2., 2.]]), torch.tensor([[True, True, False]]), 2.0)
    tensor([[ 1., -4.,  2.]])
    """
    lo, hi = PENALTY_F32
    if lo <= penalty <= hi:
        return _saturated(logits, seen, penalty)
    if not _has_f64(logits):  # no float64 (Apple's MPS): float32, the penalty within its range
        return _saturated(logits.float(), seen, min(max(penalty, F32_TINY), F32_MAX))
    lo, hi = PENALTY_F64  # float64: a float32 logit times or over the clamped penalty stays finite
    r, z = min(max(penalty, lo), hi), logits.double()  # (B, V)
    return torch.where(seen, torch.where(z > 0, z / r, z * r), z)  # (B, V) float64


def _saturated(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule in the logits' dtype, a result past its range saturating at its largest number."""
    big = torch.finfo(logits.dtype).max
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # (B, V)
    # Only one branch can overflow; the bound is ±inf for an infinite logit, which so stays as it was.
    if penalty < 1:
        penalised = torch.minimum(penalised, logits.clamp(min=big))
    else:
        penalised = torch.maximum(penalised, logits.clamp(max=-big))
    return torch.where(seen, penalised, logits)


def _has_f64(x: torch.Tensor) -> bool:
    """Whether x's device computes in float64 (Apple's MPS does not: float32 and its limits serve there)."""
    return x.device.type != "mps"


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits (..., V) / T: in float32, or in float64 where float32 cannot hold T (below 1.2e-38, where
    it loses digits or becomes 0, or above 3.4e38) or the logits are float64 (a wide penalty's)."""
    if logits.dtype == torch.float64 or not F32_TINY <= temperature <= F32_MAX:
        if _has_f64(logits):
            return logits.double() / temperature
        temperature = min(max(temperature, F32_TINY), F32_MAX)  # MPS: T within float32's range
    return logits.float() / temperature


def temperature_stage(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits (..., V) divided by the temperature (T > 0; T = 0 is greedy, never divided), in float32
    (float64 where float32 cannot hold T or the logits are float64). A row whose largest quotient
    overflows (a logit of 1e9 over T = 1e-30 in float32, of 3e9 over T = 1e-300 in float64) becomes its
    argmax, the first of equal maxima (0 there, -inf elsewhere): greedy, the limit of T -> 0. A row
    without a finite maximum (NaN, +inf, all -inf) stays as it is, for `sample` to refuse.

    >>> temperature_stage(torch.tensor([[1.0, 3e9, 3e9]]), 1e-300)
    tensor([[-inf, 0., -inf]], dtype=torch.float64)
    """
    scaled = _scaled(logits, temperature)  # (..., V)
    if temperature >= 1:  # a quotient no larger than the logit: nothing overflows
        return scaled
    top, at = logits.max(-1, keepdim=True)  # (..., 1) each: the first of equal maxima, as first_argmax
    over = _overflows(top, temperature)  # (..., 1)
    return scaled.masked_fill(over, float("-inf")).scatter_(-1, at, torch.where(over, 0.0, scaled.gather(-1, at)))


def _overflows(top: torch.Tensor, temperature: float) -> torch.Tensor:
    """Where a row's largest logit `top` is finite and its quotient by T is not (as _scaled divides)."""
    return torch.isinf(_scaled(top, temperature)) & torch.isfinite(top)


def temperature_overflows(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(...,) bool: the rows of logits (..., V) that temperature_stage makes their argmax (greedy)."""
    top = logits.max(-1).values  # (...,)
    return _overflows(top, temperature) if 0 < temperature < 1 else torch.zeros_like(top, dtype=torch.bool)


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
    kept = before < top_p  # (..., V) in sorted order
    kept[..., 0] = True  # the most likely token always (a top_p below float32's 1.4e-45 compares as 0)
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order, kept)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def min_p_stage(probs: torch.Tensor, min_p=None) -> torch.Tensor:
    """Probabilities (..., V) of the tokens at least min_p times the most likely one's, renormalised."""
    if min_p is None or min_p <= 0:
        return probs
    probs = probs * (probs >= min_p * probs.amax(-1, keepdim=True))
    return probs / probs.sum(-1, keepdim=True)


def _filtered(scaled: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """The stages after the temperature: top_k on the logits (B, V), softmax, top_p, min_p -> (B, V)."""
    probs = torch.softmax(top_k_stage(scaled, top_k), dim=-1)  # (B, V)
    return min_p_stage(top_p_stage(probs, top_p), min_p)


def logits_to_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """Probabilities (B, V) to sample from: temperature, top_k, top_p, min_p in Hugging Face's order,
    each filter renormalising what it keeps (the stage functions above, one after another).
    docs/generation.md#sampling-exactly.

    >>> logits_to_probs(torch.tensor([[0.5, 0.3, 0.2]]).log(), top_p=0.7)
    tensor([[0.6250, 0.3750, 0.0000]])
    """
    return _filtered(temperature_stage(logits, temperature), top_k, top_p, min_p)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (..., V) -> (...): each row's first maximum, taken through max(), which returns the
    same index; on the CPU torch's argmax over a few rows of a vocabulary is several times slower."""
    return x.max(-1).indices


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """first_argmax of logits (..., V), -1 for a row without a finite maximum (a NaN, +inf, or all -inf)."""
    top, at = logits.max(-1)  # (...,) each; a NaN is the maximum where there is one
    if _all_numbers(top, finite=True):
        return at
    return torch.where(torch.isfinite(top), at, -1)


def _all_numbers(values: torch.Tensor, finite: bool) -> bool | None:
    """On the CPU, where reading a tensor back waits for nothing: whether no value is NaN (nor infinite,
    if `finite`), one read instead of the few tensor operations that settle each row on a device
    without a sync (a few microseconds each: a draw's whole cost at a small vocabulary); None elsewhere."""
    if values.device.type != "cpu":
        return None
    ok = math.isfinite if finite else (lambda v: v == v)  # NaN alone differs from itself
    return all(map(ok, values.tolist()))


def draw(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None, greedy=False, generator=None) -> torch.Tensor:
    """`sample`'s tokens (B,) without its check: -1 for a row whose logits have no finite maximum, for a
    caller that reads the tokens later (check_drawn then) and must not wait for them here (no device sync).

    The exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent picks i with probability
    p_i (the smallest of E_i / p_i, each Exp(p_i), is i's with chance p_i / sum p), one random draw per
    token. A row whose quotient logits / T overflowed (its probabilities NaN here: the race's maximum
    tells) takes its argmax, as temperature_stage does for logits_to_probs (found only where a row is
    NaN: on the CPU nothing more is computed for the others).
    """
    if greedy or temperature == 0:
        return greedy_ids(logits)
    probs = _filtered(_scaled(logits, temperature), top_k, top_p, min_p)  # (B, V); NaN rows: overflow or bad logits
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)  # (B, V)
    best, token = (probs / race).max(-1)  # (B,) each
    if _all_numbers(best, finite=False):
        return token
    return torch.where(torch.isnan(best), greedy_ids(logits) if temperature < 1 else -1, token)


def check_drawn(tokens) -> None:
    """Raise NonFiniteLogits where `draw` gave -1 (tokens: a list of ids as read back, or a tensor)."""
    bad = any(t < 0 for t in tokens) if isinstance(tokens, list) else bool((tokens < 0).any())
    if bad:
        raise NonFiniteLogits()


def sample(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None, greedy=False, generator=None) -> torch.Tensor:
    """One token id per row (B,) from logits (B, V): the argmax when greedy or temperature == 0, else a
    draw from logits_to_probs' distribution (`draw`, which says how). Raises NonFiniteLogits for a row
    whose logits have no finite maximum (the model's NaN or +inf), where a token 0 would be a silent lie.
    """
    tokens = draw(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy,
                  generator=generator)
    check_drawn(tokens)
    return tokens
