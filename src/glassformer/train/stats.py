"""Per-layer statistics of a training run (`--stats-every N`, docs/training.md#per-layer-statistics).

At a statistics step, after the optimizer step: the update's size against each weight's, and
one forward and backward of a fixed held-out batch (at most 8 rows of T tokens, the first
windows of the evaluation tokens) through the model's own modules, with a probes recorder
reading the residual stream and the attention weights on the way. The pass runs in eval mode
(no dropout) and draws no random numbers and no training batch, so the run's losses are the
same with statistics on or off; the gradients it makes are dropped before the next step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..probes import set_recorder, stream_points
from ..tracing.stream import stream_rms
from .step import masked_nll_sum

STATS_ROWS = 8  # rows of the held-out batch: 8 × T tokens at most


def interval(cfg) -> int:
    """The statistics interval in steps: --stats-every, its default the evaluation interval (0: off)."""
    return cfg.eval_every if cfg.stats_every == -1 else cfg.stats_every


def due(run, step: int) -> bool:
    """Whether the statistics are taken after optimizer step `step` (1-based): every interval, and
    at the last step; never under FSDP (its shards are not whole weights, docs/training.md)."""
    cfg = run.cfg
    if cfg.stats_every == 0 or not run.d.main or (cfg.fsdp and run.d.enabled):
        return False
    every = interval(cfg)
    return bool(every and step % every == 0) or step == run.total_steps


def held_out_batch(eval_ids: np.ndarray, seq_len: int, mask: np.ndarray | None = None,
                   rows: int = STATS_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (R, T) with R ≤ rows: the first non-overlapping windows of the held-out ids,
    y the next tokens (-1 where a conversation's mask says no loss).

    >>> x, y = held_out_batch(np.arange(10), 3)
    >>> x.tolist(), y.tolist()
    ([[0, 1, 2], [4, 5, 6]], [[1, 2, 3], [5, 6, 7]])
    """
    n = max(1, min(rows, (len(eval_ids) - 1) // (seq_len + 1)))
    T = min(seq_len, len(eval_ids) - 1)
    win = np.stack([np.asarray(eval_ids[i * (seq_len + 1): i * (seq_len + 1) + T + 1], dtype=np.int64)
                    for i in range(n)])  # (R, T+1)
    x, y = torch.from_numpy(win[:, :-1].copy()), torch.from_numpy(win[:, 1:].copy())  # (R, T) each
    if mask is not None:
        keep = np.stack([np.asarray(mask[i * (seq_len + 1) + 1: i * (seq_len + 1) + T + 1]) for i in range(n)])
        y = y.masked_fill(torch.from_numpy(keep == 0), -1)
    return x, y


def attention_entropy(weights: torch.Tensor) -> list[float]:
    """Mean entropy in nats, per head, of attention weights (B, T, N, Tk): -Σ p log p over the keys,
    averaged over rows and query positions (p = 0 adds nothing).

    >>> attention_entropy(torch.tensor([[[[0.5, 0.5], [1.0, 0.0]]]]))  # head 0 even over 2 keys, head 1 on one
    [0.6931471805599453, 0.0]
    """
    p = weights.double()
    h = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)  # (B, T, N)
    return h.mean((0, 1)).tolist()


class StatsRecorder:
    """A probes.Recorder that keeps, instead of tensors, the stream's mean RMS at each stream
    point and each attention layer's per-head entropy."""

    def __init__(self, n_layers: int, norm_placement: str, ffn: str = "swiglu"):
        self.streams = set(stream_points(n_layers, norm_placement, ffn))
        self.weights = {f"blocks.{i}.attn.weights" for i in range(n_layers)}
        self.stream_rms: dict[str, float] = {}
        self.attn_entropy: dict[str, list[float]] = {}

    def wants(self, name: str) -> bool:
        return name in self.streams or name in self.weights

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if name in self.streams:
                self.stream_rms[name] = float(stream_rms(x.detach()).mean())  # x (B, T, D)
            elif name in self.weights:
                self.attn_entropy[name.removesuffix(".weights")] = attention_entropy(x.detach())
        return x


def rms_ratio(after: torch.Tensor, before: torch.Tensor) -> float | None:
    """RMS(after − before) / RMS(before): the update's size against the weight's (None for a zero weight).

    >>> rms_ratio(torch.tensor([1.5, -3.0]), torch.tensor([1.0, -2.0]))
    0.5
    """
    den = stream_rms(before.reshape(1, -1))[0]  # the RMS over every element: the weight as one row
    if den == 0:
        return None
    return round(float(stream_rms((after.double() - before.double()).reshape(1, -1))[0] / den), 12)


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def weights_before(model) -> dict[str, torch.Tensor]:
    """A copy of every trainable weight, taken before a statistics step's optimizer step."""
    return {n: p.detach().clone() for n, p in trainable(model)}


def layer_stats(model, x: torch.Tensor, y: torch.Tensor, before: dict[str, torch.Tensor] | None = None,
                autocast=None) -> dict:
    """The statistics of `model` (a Transformer) on the batch x, y (R, T), and of the step that
    moved its weights from `before`: {"grad_norm", "update_rms_ratio", "stream_rms", "attn_entropy"}."""
    import contextlib

    params = trainable(model)
    rec = StatsRecorder(model.config.n_layers, model.config.norm_placement, model.config.ffn)
    was_training, old = model.training, set_recorder(rec)
    model.eval()
    try:
        # Eager even under --compile: the recorder's Python would break the graph (and recompile).
        with torch.compiler.set_stance("force_eager"), (autocast or contextlib.nullcontext)():
            logits, _ = model(x)  # (R, T, V)
            count = (y >= 0).sum().clamp(min=1)
            loss = masked_nll_sum(logits, y) / count
        loss.backward()
    finally:
        set_recorder(old)
        model.train(was_training)
    grad_norm = {n: float(p.grad.double().norm()) if p.grad is not None else 0.0 for n, p in params}
    for _, p in params:
        p.grad = None  # the next training step starts from no gradient, as without statistics
    update = {n: rms_ratio(p.detach(), before[n]) for n, p in params} if before is not None else {}
    return {"grad_norm": grad_norm, "update_rms_ratio": update, "stream_rms": rec.stream_rms,
            "attn_entropy": rec.attn_entropy}


# ----------------------------------------------------------------------------- the loop's phases


def weights_if_due(run) -> dict | None:
    """Before a step: the weights, when the statistics will be taken after it."""
    return weights_before(run.model) if due(run, run.step + 1) else None


def measure_if_due(run, before: dict | None) -> None:
    """After a step: run.stats, the statistics when due (else None), for log_step to write."""
    run.stats = None
    if before is None and not due(run, run.step):
        return
    if run.stats_batch is None:
        mask = run.eval_mask
        x, y = held_out_batch(run.eval_ids, run.seq_len, mask)
        run.stats_batch = (x.to(run.device), y.to(run.device))
    stats = layer_stats(run.model, *run.stats_batch, before, run.autocast)
    run.stats = {k: {n: _finite(v) for n, v in d.items()} for k, d in stats.items()}


def _finite(v):
    """A JSON-safe value: None for a non-finite number (metrics.jsonl stays strict JSON)."""
    if isinstance(v, list):
        return [_finite(e) for e in v]
    return v if v is None or math.isfinite(v) else None
