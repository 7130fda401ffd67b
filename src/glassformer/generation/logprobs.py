"""Log-probabilities of tokens: what the model gave each chosen token and its most likely rivals.

Always of the raw distribution, log_softmax of the logits in float32, before temperature, top-k,
top-p, min-p or a repetition penalty (OpenAI's and vLLM's convention): a token's log-probability
then says what the model thinks, whatever the sampling did with it. docs/generation.md#log-probabilities.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..probes import set_recorder

__all__ = ["TokenLogprob", "logprobs_of", "prompt_logprobs", "raw_logprobs", "LogitsTap"]


@dataclass
class TokenLogprob:
    """One token's log-probability and the k most likely (id, logprob) at its position, most likely first."""

    id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary in float32 (whatever the logits' dtype): (..., V).

    >>> raw_logprobs(torch.tensor([[0.0, 0.0]]))
    tensor([[-0.6931, -0.6931]])
    """
    return torch.log_softmax(logits.float(), dim=-1)


def _entries(lp: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """TokenLogprobs of rows lp (B, V) of log-probabilities for the ids chosen (B,)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    chosen = chosen.to(lp.device).long()
    picked = lp.gather(-1, chosen[:, None])[:, 0].tolist()  # (B,)
    if k == 0:
        tops = [[] for _ in picked]
    else:
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (B, k) each, most likely first
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(c), p, t) for c, p, t in zip(chosen.tolist(), picked, tops)]


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each row's chosen token (B,) scored by its logits (B, V), with its k most likely tokens.

    >>> [i for i, _ in logprobs_of(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([0]), 2)[0].top]
    [2, 1]
    """
    return _entries(raw_logprobs(logits), chosen, k)  # (B, V) -> B entries


def prompt_logprobs(logits: torch.Tensor, ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """A prompt scored by its own forward: logits (T, V), where position t predicts ids[t + 1];
    len(ids) - 1 entries (the first token has nothing before it). ids may run one past the logits'
    last position (a chunk of a longer prompt, the next chunk's first token scored by this one's last).

    >>> [e.id for e in prompt_logprobs(torch.zeros(3, 4), [3, 1, 2], 0)]
    [1, 2]
    """
    ids = list(ids)
    n = len(ids) - 1
    if n <= 0:
        return []
    if logits.shape[0] < n:
        raise ValueError(f"{len(ids)} ids need logits at {n} positions, got {logits.shape[0]}")
    chosen = torch.tensor(ids[1:], device=logits.device)  # (n,)
    return _entries(raw_logprobs(logits[:n]), chosen, k)  # (n, V) -> n entries


class LogitsTap:
    """A probe recorder that keeps the logits of each forward's last position (the "logits" probe),
    so the tokens a Session yields can be scored without touching its loop: one entry a forward, in
    order, each (B, V) float32. While it listens a Session runs the model eagerly (probes).

    >>> from glassformer import ModelConfig, Transformer, generate
    >>> model = Transformer(ModelConfig.from_preset("tiny"))
    >>> with LogitsTap() as tap:
    ...     ids = list(generate(model, [1, 2, 3], max_new_tokens=4, greedy=True))
    >>> len(tap.logits), tuple(tap.logits[0].shape)
    (4, (1, 512))
    """

    def __init__(self):
        self.logits: collections.deque[torch.Tensor] = collections.deque()
        self._before = None

    def wants(self, name: str) -> bool:
        return name == "logits"

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "logits":
            self.logits.append(x[:, -1].detach().float())  # (B, T, V) -> (B, V)
        return x

    def __enter__(self) -> "LogitsTap":
        self._before = set_recorder(self)
        return self

    def __exit__(self, *exc) -> None:
        set_recorder(self._before)
