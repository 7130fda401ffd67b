"""What the benchmark scripts share (a helper module: bench/run_all.py skips names starting with _)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def write_json(path, result, indent: int = 1) -> None:
    """Write a benchmark's result as JSON (its folder made if need be) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    print(f"wrote {path}")


def add_decode_arguments(ap, compile_help: str) -> None:
    """The flags every batch-1 decode benchmark takes (bench/decode.py, bench/int8.py)."""
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help=compile_help)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds (a smoke run)")


def timed(fn) -> float:
    """Seconds one call of fn takes (wall clock)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_ms(fn, repeats: int) -> float:
    """Median wall-clock milliseconds over `repeats` calls fn(r), r = 0, 1, ..."""
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def train_step(model, opt, x, y) -> None:
    """One plain training step as the benchmarks time it: forward, backward, clip at 1.0, the update."""
    import torch

    model(x, y)[1].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
