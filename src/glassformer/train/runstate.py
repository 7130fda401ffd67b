"""What a run needs to stop and resume exactly: every RNG state, a flag set by SIGINT/SIGTERM,
and the step count that fits a time budget."""

from __future__ import annotations

import random
import signal
import sys

import numpy as np
import torch


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
