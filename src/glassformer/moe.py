"""A mixture of experts in place of a block's feed-forward (Shazeer et al., 2017; Switch Transformer,
Fedus et al., 2021; Mixtral, Jiang et al., 2024): a router scores every expert for each token, the
token goes through its top k, and their outputs are summed weighted by those scores.

    router_logits = x·W_r (+ b)                          (B, T, E)
    router_probs  = softmax(logits) or sigmoid(logits)   (B, T, E)
    expert_ids, expert_weights = top-k of router_probs   (B, T, k), rescaled to sum 1 if router_renorm
    out = Σ_j expert_weights[j] · expert_{ids[j]}(x)  (+ shared(x))

Each expert is the model's own FeedForward module (`experts.{e}`), called on its tokens only, so
hooks, adapters and quantized weights apply to it as to a dense feed-forward. Imports torch alone;
model.py hands in the expert class. docs/model.md#mixtures-of-experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import ModelConfig
from .probes import tap


class MoE(nn.Module):
    name = "ffn"  # its path in the model (probe prefix), set by Transformer from the module tree

    def __init__(self, cfg: ModelConfig, expert: type):
        super().__init__()
        self.cfg = cfg
        E, F = cfg.n_experts, cfg.expert_width
        self.router = nn.Linear(cfg.dim, E, bias=cfg.ffn_bias)
        self.experts = nn.ModuleList(expert(cfg, F) for _ in range(E))
        self.shared = expert(cfg, cfg.n_shared_experts * F) if cfg.n_shared_experts else None
        self.aux_loss: torch.Tensor | None = None  # the last forward's load-balancing loss (training reads it)
        self.load: torch.Tensor | None = None  # (E,) the last forward's share of routed slots per expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, n = self.cfg, self.name
        B, T, D = x.shape
        k = cfg.n_active_experts
        logits = tap(n + ".router_logits", self.router(x))  # (B, T, E)
        # Scores in fp32 whatever the weights' dtype, as the families compute them.
        probs = torch.softmax(logits.float(), -1) if cfg.router == "softmax" else torch.sigmoid(logits.float())
        probs = tap(n + ".router_probs", probs)  # (B, T, E)
        weights, ids = probs.topk(k, dim=-1)  # (B, T, k) each, best first
        if cfg.router_renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        ids = tap(n + ".expert_ids", ids)
        weights = tap(n + ".expert_weights", weights.to(x.dtype))  # (B, T, k)
        flat, slots = x.reshape(B * T, D), ids.reshape(B * T, k)  # (B·T, D), (B·T, k)
        outs = x.new_zeros(B * T, k, D)  # each token's k experts' outputs
        for e, expert in enumerate(self.experts):
            rows, slot = (slots == e).nonzero(as_tuple=True)  # the tokens routed to expert e, and in which slot
            if len(rows):
                outs[rows, slot] = expert(flat[rows][None])[0]  # (n_e, D)
        outs = tap(n + ".expert_out", outs.view(B, T, k, D))  # (B, T, k, D)
        y = (weights[..., None] * outs).sum(2)  # (B, T, D)
        if self.shared is not None:
            y = y + tap(n + ".shared", self.shared(x))
        self.aux_loss, self.load = balance(probs, slots, cfg.n_experts)
        return tap(n + ".down", y)  # (B, T, D): the feed-forward's output, under a dense one's name


def balance(probs: torch.Tensor, slots: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The load-balancing loss E·Σ_e f_e·P_e (Switch Transformer, eq. 4, in Mixtral's form: f_e is the
    share of tokens that picked expert e in any of their k slots, P_e the mean router probability of e),
    k when the load is even; and the load, each expert's share of the routed slots (sums to 1)."""
    counts = torch.bincount(slots.reshape(-1), minlength=E).to(probs.dtype)  # (E,)
    tokens = slots.shape[0]
    P = probs.reshape(-1, E).mean(0)  # (E,)
    return E * ((counts / tokens) * P).sum(), (counts / counts.sum()).detach()


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of every mixture layer's load-balancing loss from the model's last forward (None if dense)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def expert_load(model: nn.Module) -> list[list[float]]:
    """Per mixture layer, each expert's share of the routed slots in the model's last forward."""
    return [m.load.tolist() for m in model.modules() if isinstance(m, MoE) and m.load is not None]
