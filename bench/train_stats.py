"""What the per-layer statistics (train --stats-every, train/stats.py) cost a training run.

Side by side in one process, alternating: training steps as `glassformer train` takes them
(train_step: forward, backward, clipping, AdamW) and statistics passes (the weights copied before
the step, then stats.layer_stats: the update ratios, and one forward and backward of the fixed
held-out batch of 8 × T tokens with the probes recording the stream and attention weights).
The overhead at an interval of N steps is (one statistics pass) / (N steps); the default
interval is the evaluation interval (TrainConfig.eval_every).

    python bench/train_stats.py [--preset small] [--seq-len 64] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import timed, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import TrainConfig  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402
from glassformer.train.stats import STATS_ROWS, layer_stats, weights_before  # noqa: E402
from glassformer.train.step import train_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=TrainConfig.preset)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--seq-len", type=int, default=0, help="0: the preset's context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20, help="step and statistics pairs timed")
    ap.add_argument("--quick", action="store_true", help="5 rounds (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_stats.json"))
    args = ap.parse_args()
    rounds = 5 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(args.preset)
    T = args.seq_len or cfg.max_seq_len
    model = Transformer(cfg).train()
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.99), torch.device("cpu"))
    x, y = (torch.randint(0, cfg.vocab_size, (args.batch_size, T)) for _ in range(2))
    hx, hy = (torch.randint(0, cfg.vocab_size, (STATS_ROWS, T)) for _ in range(2))
    step = lambda: train_step(model, opt, x, y, lr=1e-3, grad_clip=1.0)  # noqa: E731
    stats = lambda: layer_stats(model, hx, hy, weights_before(model))  # noqa: E731
    step(), stats()  # warm-up: thread pool, allocator
    steps, passes = [], []
    for _ in range(rounds):
        steps.append(timed(step))
        passes.append(timed(stats))
    sec_step, sec_stats = statistics.median(steps), statistics.median(passes)
    every = {"default (eval_every)": TrainConfig.eval_every, "100": 100, "10": 10}
    res = {"preset": args.preset, "batch": [args.batch_size, T], "stats_batch": [STATS_ROWS, T],
           "threads": args.threads, "rounds": rounds, "sec_per_step": round(sec_step, 5),
           "sec_per_stats_pass": round(sec_stats, 5), "stats_pass_over_step": round(sec_stats / sec_step, 3),
           "overhead": {k: round(sec_stats / (n * sec_step), 5) for k, n in every.items()},
           "torch": torch.__version__}
    print(res)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
