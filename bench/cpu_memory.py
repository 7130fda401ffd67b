"""What keeping freed memory buys a CPU training step, and what it costs (cpu_memory.keep_freed_memory).

The reference shape (config.REFERENCE_SHAPE), batch 8 × 256 tokens, AdamW and gradient
clipping, eager or compiled, once with the allocator's defaults and once with freed memory
kept, as `glassformer train` runs on the CPU. Each run is a process of its own (the peak
resident memory is a process's high-water mark), the runs alternating between the two
settings. Per run: seconds per step (best of the timed steps, after warm-up steps that let
the kept heap reach its size), minor page faults per timed step (getrusage: each a 4 KB
page the kernel maps in and zeroes) and the process's peak resident memory.

    flock /tmp/glassformer-bench.lock python bench/cpu_memory.py [--threads 2] [--rounds 2] [--engines eager compiled]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import train_step, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.train.cpu_memory import keep_freed_memory  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402

SETTINGS = ("allocator's defaults", "freed memory kept")


def one_run(engine: str, keep: bool, threads: int, warm: int, steps: int) -> dict:
    """Build the model, warm up, time `steps` steps: {sec_per_step, faults_per_step, peak_rss_mb}."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).train()
    if engine == "compiled":
        model.compile()
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    x, y = (torch.randint(0, REFERENCE_SHAPE["vocab_size"], (8, 256)) for _ in range(2))
    best, faults = float("inf"), 0
    with keep_freed_memory(keep):
        for i in range(warm + steps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            train_step(model, opt, x, y)
            if i >= warm:
                best = min(best, time.perf_counter() - t)
                faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return {"sec_per_step": round(best, 4), "faults_per_step": faults // steps,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}  # KB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each engine and setting, alternating")
    ap.add_argument("--engines", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    ap.add_argument("--warm", type=int, default=3, help="untimed steps first (the first compiles)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run")
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "KEEP"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_memory.json"))
    args = ap.parse_args()
    if args.child:
        engine, keep = args.child[0], args.child[1] == "1"
        print(json.dumps(one_run(engine, keep, args.threads, args.warm, args.steps)))
        return
    runs = {e: {s: [] for s in SETTINGS} for e in args.engines}
    for _ in range(args.rounds):
        for engine in args.engines:
            for keep, setting in enumerate(SETTINGS):
                cmd = [sys.executable, __file__, "--child", engine, str(keep), "--threads", str(args.threads),
                       "--warm", str(args.warm), "--steps", str(args.steps)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs[engine][setting].append(json.loads(out.splitlines()[-1]))
    print(f"reference shape, B 8 × T 256, fp32, {args.threads} threads; per run: s/step (best), "
          "page faults per step, peak resident MB")
    res = {"threads": args.threads, "rounds": args.rounds, "warm_steps": args.warm, "timed_steps": args.steps,
           "torch": torch.__version__, "runs": runs, "speedup": {}}
    for engine, by in runs.items():
        for setting, rs in by.items():
            shown = "; ".join(f"{r['sec_per_step']:.3f} s, {r['faults_per_step']:,} faults, {r['peak_rss_mb']:,} MB"
                              for r in rs)
            print(f"  {engine:9} {setting:21} {shown}")
        best = {s: min(r["sec_per_step"] for r in rs) for s, rs in by.items()}
        res["speedup"][engine] = round(best[SETTINGS[0]] / best[SETTINGS[1]], 3)
        print(f"  {engine:9} kept / defaults: {res['speedup'][engine]:.2f}x faster (best runs)")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
