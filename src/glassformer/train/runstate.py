"""The state of one training run (`RunState`, what the loop's phases pass along), and what a
run needs to stop and resume exactly: every RNG state, a flag set by SIGINT/SIGTERM, and the
step count that fits a time budget."""

from __future__ import annotations

import math
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

if TYPE_CHECKING:  # names for the annotations only
    from ..config import TrainConfig
    from ..text.data import TokenFile
    from ..text.shards import ShardSet
    from .distributed import Dist
    from .metrics import MetricsLog
    from .step import StepResult


@dataclass
class RunState:
    """Everything the phases of `train` (train/loop.py) read and change; built by `start_run`
    (train/setup.py). Times are time.perf_counter() seconds."""

    cfg: TrainConfig
    d: Dist
    device: torch.device
    data: Path  # the prepared data folder
    out: Path  # the run folder
    model: torch.nn.Module  # the Transformer
    net: torch.nn.Module  # what runs the forward: the model, or its DDP/FSDP wrapper
    optimizer: torch.optim.Optimizer
    train_tokens: TokenFile | ShardSet
    eval_ids: np.ndarray  # the held-out tokens each evaluation scores
    eval_bytes: int  # their UTF-8 bytes, for bits per byte
    seq_len: int
    micro: int  # rows per micro-batch
    accum: int  # micro-batches per step on this process
    autocast: Callable
    n_threads: int
    step: int = 0  # optimizer steps done
    total_steps: int | None = None  # None until a time budget fixes it
    elapsed0: float = 0.0  # seconds spent by the run before it was resumed
    best: dict = field(default_factory=lambda: {"name": None, "val_loss": math.inf})
    plan: dict | None = None  # the time budget's plan, once made
    peak: float | None = None  # FLOP/s for MFU (rank 0)
    flops_per_token: float = 0.0
    metrics: MetricsLog | None = None  # rank 0 alone writes
    bar: Any = None  # the tqdm progress bar
    t_start: float = 0.0
    start_step: int = 0  # the step this process began at (after a resume: the checkpoint's)
    t_calib: float | None = None  # when the time budget's timed steps began
    clock: list = field(default_factory=list)  # (step, training seconds) at each re-plan under wsd (follow_the_clock)
    eval_seconds: float = 0.0  # seconds this process spent in evaluations and their checkpoints
    t_log: float = 0.0  # when tokens/s was last measured from
    tok_log: int = 0  # tokens trained since then
    lr: float = 0.0  # the last step's learning rate
    last: StepResult | None = None  # what the last step returned
    losses: list[float] = field(default_factory=list)  # every step's training loss
    last_val: dict | None = None  # the last evaluation
    stop_reason: str | None = None  # the signal that stopped the run
    # Conversation data (docs/data.md#conversation-data): the loss masks and the window block.
    train_mask: TokenFile | None = None  # None: plain data, every target trained
    eval_mask: np.ndarray | None = None  # aligned with eval_ids
    block: int | None = None  # windows start at multiples of this (context + 1)
    grown: dict | None = None  # --init-from's embedding growth, recorded in the run
    data_fingerprint: dict | None = None  # the data folder's shards and sha256s, which --resume compares (train/loader.py)
    doc_starts: np.ndarray | None = None  # (D,) with --align-docs: where the training split's documents begin
    prefetch: Any = None  # train/loader.py Prefetch: the next step's batch, read while this step computes
    stats: dict | None = None  # this step's per-layer statistics (train/stats.py), when taken
    stats_batch: tuple | None = None  # their fixed held-out (x, y), made at the first statistics step

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.seq_len

    @property
    def done(self) -> bool:
        return self.total_steps is not None and self.step >= self.total_steps


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """(JSON part, tensor part) of every RNG: Python, NumPy, torch CPU, each CUDA device."""
    py = random.getstate()
    np_state = np.random.get_state()
    tensors = {"rng/torch_cpu": torch.get_rng_state(), "rng/numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    js = {"python": [py[0], list(py[1]), py[2]], "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return js, tensors


def set_rng_state(js: dict, tensors: dict[str, torch.Tensor]) -> None:
    random.setstate((js["python"][0], tuple(js["python"][1]), js["python"][2]))
    kind, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng/cuda/"))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


class StopFlag:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint after the current step and exits.
    A second SIGINT raises KeyboardInterrupt at once."""

    def __init__(self):
        self.signal: str | None = None
        self._old: dict = {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(f"\n{self.signal} received: finishing this step, saving a checkpoint, then stopping "
              "(press Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def plan_steps(budget_left: float, sec_per_step: float, eval_every: int, sec_per_eval: float) -> int:
    """How many more steps fit in budget_left seconds with an evaluation every eval_every steps and one at the end.

    >>> plan_steps(100.0, 1.0, 10, 5.0)  # n + (n/10 + 1)·5 ≤ 100  ->  n = 95/1.5
    63
    """
    per_step = sec_per_step + (sec_per_eval / eval_every if eval_every else 0.0)
    return max(1, int((budget_left - sec_per_eval) / per_step))


def least_total(done: int, warmup: int, decay_frac: float) -> int | None:
    """The smallest step count whose wsd decay starts no earlier than step `done` - 1, so the `done`
    steps already taken at the full rate stay at it under the new count (the inverse of
    optim.decay_start, which never falls as the count grows); None when no count can (the decay
    spans every step after the warm-up, and the warm-up is over).

    >>> least_total(60, 10, 0.4), least_total(5, 10, 0.4), least_total(30, 10, 1.0)  # decay_start(10, 100, 0.4) == 59
    (100, 1, None)
    """
    from .optim import decay_start

    if done - 1 <= warmup:
        return 1
    if decay_frac >= 1.0:
        return None
    total = max(1, int((done - 1) / (1.0 - decay_frac)) - 2)  # near it; then step to the exact count
    while decay_start(warmup, total, decay_frac) < done - 1:
        total += 1
    while total > 1 and decay_start(warmup, total - 1, decay_frac) >= done - 1:
        total -= 1
    return total
