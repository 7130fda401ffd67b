"""Named transforms between a Hugging Face tensor and ours, and the Rule that applies one.

copy, conv1d, qkv_conv1d, qkv_bias, rope_q, rope_k, rope_head, qkv_fused and gate_up_fused
(what each does, and why:
docs/convert.md#the-key-map-and-its-transforms). Each transform is a pair of pure
functions (to_ours, to_hf); applied to meta tensors, to_hf also gives the shape a Hugging
Face tensor must have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import ModelConfig

def _rope_perm(head_dim: int) -> torch.Tensor:
    """Row order that takes one head from interleaved pairs (2i, 2i+1) to half pairs (i, i+H/2).

    >>> _rope_perm(4).tolist()
    [0, 2, 1, 3]
    """
    return torch.arange(head_dim).view(head_dim // 2, 2).t().reshape(-1)  # (H,)


def interleaved_to_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder the rows of a (heads·H, …) Q or K projection from Meta's pair order to Hugging Face's."""
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim, *rest)[:, _rope_perm(head_dim)].reshape(n_heads * head_dim, *rest)


def half_to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of interleaved_to_half."""
    rest = w.shape[1:]
    inv = torch.argsort(_rope_perm(head_dim))  # (H,)
    return w.reshape(n_heads, head_dim, *rest)[:, inv].reshape(n_heads * head_dim, *rest)


def _rope(heads: Callable[[ModelConfig], int]):
    def to_ours(t, cfg):
        if cfg.rope_pairs == "half":
            return (t,)
        return (half_to_interleaved(t, heads(cfg), cfg.head_dim),)

    def to_hf(ts, cfg):
        if cfg.rope_pairs == "half":
            return ts[0]
        return interleaved_to_half(ts[0], heads(cfg), cfg.head_dim)

    return to_ours, to_hf


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    return [cfg.q_dim, cfg.kv_dim, cfg.kv_dim]


_ROPE_Q, _ROPE_K = _rope(lambda cfg: cfg.n_heads), _rope(lambda cfg: cfg.n_kv_heads)


def _qkv_fused_to_ours(t, cfg):
    """Phi-3's qkv_proj: the rows of Q, K and V stacked in one matrix; Q and K rows reordered
    like rope_q/rope_k when our pairs are interleaved."""
    q, k, v = t.split(_qkv_sizes(cfg), dim=0)
    return _ROPE_Q[0](q, cfg) + _ROPE_K[0](k, cfg) + (v,)


def _qkv_fused_to_hf(ts, cfg):
    return torch.cat([_ROPE_Q[1](ts[:1], cfg), _ROPE_K[1](ts[1:2], cfg), ts[2]], dim=0)


# name -> (to_ours(hf_tensor, cfg) -> tuple of our tensors, to_hf(our tensors, cfg) -> hf tensor)
TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "copy": (lambda t, cfg: (t,), lambda ts, cfg: ts[0]),
    "conv1d": (lambda t, cfg: (t.t(),), lambda ts, cfg: ts[0].t()),  # [in, out] <-> [out, in]
    "qkv_conv1d": (
        lambda t, cfg: tuple(t.t().split(_qkv_sizes(cfg), dim=0)),  # [D, 3D] -> 3 × [D, D]
        lambda ts, cfg: torch.cat(ts, dim=0).t(),  # 3 × [D, D] -> [D, 3D]
    ),
    "qkv_bias": (
        lambda t, cfg: tuple(t.split(_qkv_sizes(cfg), dim=0)),  # (3D,) -> 3 × (D,)
        lambda ts, cfg: torch.cat(ts, dim=0),
    ),
    "rope_q": _ROPE_Q,
    "rope_k": _ROPE_K,
    # A per-head norm weight (H,) (Qwen3's, Gemma 3's q_norm/k_norm): one head's features, so one head's order.
    "rope_head": _rope(lambda cfg: 1),
    "qkv_fused": (_qkv_fused_to_ours, _qkv_fused_to_hf),
    # Phi-3's gate_up_proj: the gate's rows, then the up projection's (transformers' chunk(2)).
    "gate_up_fused": (lambda t, cfg: tuple(t.chunk(2, dim=0)), lambda ts, cfg: torch.cat(ts, dim=0)),
}


@dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor <-> one or more of ours. '{i}' stands for the layer index."""

    hf: str
    ours: tuple[str, ...]
    transform: str = "copy"

    def at(self, i: int) -> "Rule":
        return Rule(self.hf.replace("{i}", str(i)), tuple(o.replace("{i}", str(i)) for o in self.ours), self.transform)

    def to_ours(self, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
        out = TRANSFORMS[self.transform][0](t, cfg)
        assert len(out) == len(self.ours), (self, len(out))
        return dict(zip(self.ours, out))

    def to_hf(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
        return TRANSFORMS[self.transform][1](tuple(state[k] for k in self.ours), cfg)


def R(hf: str, *ours: str, transform: str = "copy") -> Rule:
    return Rule(hf, ours, transform)
