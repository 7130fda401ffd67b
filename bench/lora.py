"""LoRA fine-tuning against full fine-tuning on the smollm-135m shape on the CPU (docs/lora.md).

Both train the same model (random weights, the preset's shape: 135M weights, tied embeddings)
on the same batches with glassformer's own training step (train/step.train_step: AdamW, clipping
at 1.0) under three allocator settings, since what malloc keeps resident moves the peak: freed
memory kept as `glassformer train` keeps it on a CPU (train/cpu_memory.py), glibc's defaults, and
every large block mapped on its own (the tensors' own peak; SETTINGS below). LoRA wraps every block
product (r 8, alpha 16) and trains only A and B; full fine-tuning trains every weight.

Memory: each mode and setting in a process of its own, since its peak resident memory is the
process's high-water mark; reported as that peak and as the peak less what the process held
before the model was built (the interpreter and torch). Time: both modes in one process, their
steps alternating, so a shared machine's load falls on both alike (best step after warm-up);
then the time merge_lora takes to fold every adapter of the trained LoRA model into its weight.
Ratios: LoRA's peak memory over full fine-tuning's, per setting (goal <= 0.5), and LoRA's
tokens/s over full fine-tuning's (goal >= 1.0).

    python bench/lora.py [--batch 4] [--seq 256] [--rounds 2] [--threads 2] [--settings kept defaults] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.convert.lora import LoraConfig, apply_lora, count_adapter_weights, merge_lora  # noqa: E402
from glassformer.train.cpu_memory import keep_freed_memory  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402
from glassformer.train.step import train_step  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODES = ("full", "lora")
# kept: freed memory kept (as train does on a CPU); defaults: glibc's, whose mmap threshold rises
# after a large block is freed, so later blocks come from the heap and stay resident; mapped: that
# threshold fixed at its starting 128 KB, each large block mapped and unmapped on its own, so the
# resident peak follows the tensors' own.
SETTINGS = ("kept", "defaults", "mapped")
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
SHAPE = "smollm-135m"


def rss_mb() -> float:
    """The process's resident memory now (Linux: /proc/self/statm), in MB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def build(mode: str, args):
    """(model, optimizer, batches) for one mode: the same weights, seed and batches for both."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(SHAPE)).train()
    if mode == "lora":
        apply_lora(model, LoraConfig(r=args.r, alpha=args.alpha))
    opt = make_optimizer(model, 1e-4, 0.0, (0.9, 0.95), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1), generator=g)
               for _ in range(args.warm + args.steps)]
    return model, opt, batches


def step(model, opt, batch) -> float:
    """One training step; its seconds."""
    t = time.perf_counter()
    train_step(model, opt, batch[:, :-1], batch[:, 1:], grad_clip=1.0)
    return time.perf_counter() - t


def memory_run(mode: str, setting: str, args) -> dict:
    """Peak resident memory of one mode's steps under one allocator setting, alone in this process."""
    torch.set_num_threads(args.threads)
    if setting == "mapped":
        from glassformer.train.cpu_memory import _glibc

        libc = _glibc()
        assert libc is not None, "the mapped setting needs glibc"
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    before = rss_mb()
    model, opt, batches = build(mode, args)
    with keep_freed_memory(setting == "kept"):
        for b in batches:
            step(model, opt, b)
    peak = peak_rss_mb()
    return {"mode": mode, "setting": setting, "trainable_weights": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "peak_rss_mb": round(peak), "rss_before_model_mb": round(before), "peak_over_start_mb": round(peak - before)}


def time_run(args) -> dict:
    """Both modes in this process, their steps alternating (so the machine's load falls on both
    alike), freed memory kept as train keeps it; then merge_lora on the trained LoRA model."""
    torch.set_num_threads(args.threads)
    runs = {m: build(m, args) for m in MODES}
    times = {m: [] for m in MODES}
    with keep_freed_memory(True):
        for i in range(args.warm + args.steps):
            for m, (model, opt, batches) in runs.items():
                t = step(model, opt, batches[i])
                if i >= args.warm:
                    times[m].append(round(t, 3))
    out = {m: {"sec_per_step": ts, "tokens_per_s": round(args.batch * args.seq / min(ts), 1)} for m, ts in times.items()}
    lora = runs["lora"][0]
    out["adapter_weights"] = count_adapter_weights(lora)
    t = time.perf_counter()
    merge_lora(lora)
    out["merge_s"] = round(time.perf_counter() - t, 3)
    return out


def _child(args, *what: str) -> dict:
    cmd = [sys.executable, __file__, "--child", *what, "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads), "--warm", str(args.warm), "--steps", str(args.steps),
           "--r", str(args.r), "--alpha", str(args.alpha)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def summary(memory: dict, timing: list[dict]) -> dict:
    """LoRA over full fine-tuning: peak memory per setting (lowest peak of the runs), tokens/s
    (best step of each, over all timing runs) and the fastest merge."""
    mem = {}
    for setting, by in memory.items():
        low = {m: min(r["peak_rss_mb"] for r in rs) for m, rs in by.items()}
        over = {m: min(r["peak_over_start_mb"] for r in rs) for m, rs in by.items()}
        mem[setting] = {"full_mb": low["full"], "lora_mb": low["lora"], "ratio": round(low["lora"] / low["full"], 3),
                        "ratio_over_start": round(over["lora"] / over["full"], 3)}
    tps = {m: max(t[m]["tokens_per_s"] for t in timing) for m in MODES}
    return {"peak_memory": mem, "tokens_per_s": tps, "tokens_per_s_ratio": round(tps["lora"] / tps["full"], 3),
            "merge_s_best": min(t["merge_s"] for t in timing)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", type=int, default=1, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                    help="kept: freed memory kept, as train does on a CPU; defaults: the allocator's own; "
                         "mapped: large blocks mapped and unmapped one by one (the tensors' own peak)")
    ap.add_argument("--quick", action="store_true", help="batch 2 × 128 tokens, 3 timed steps")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "SETTING"), help=argparse.SUPPRESS)  # or: time both
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/lora[_quick].json)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(time_run(args) if args.child == ["time", "both"] else memory_run(*args.child, args)))
        return
    if args.quick:
        args.batch, args.seq, args.steps = 2, 128, 3
    memory = {st: {m: [] for m in MODES} for st in args.settings}
    timing = []
    for _ in range(args.rounds):
        for setting in args.settings:
            for mode in MODES:
                memory[setting][mode].append(r := _child(args, mode, setting))
                print(f"  memory  {setting:8} {mode:4}  peak {r['peak_rss_mb']:,} MB "
                      f"({r['peak_over_start_mb']:,} MB over the start)", flush=True)
        timing.append(t := _child(args, "time", "both"))
        print(f"  time    full {t['full']['tokens_per_s']:.1f} tokens/s, lora {t['lora']['tokens_per_s']:.1f} tokens/s "
              f"(best steps, alternating); merge {t['merge_s']:.3f} s", flush=True)
    res = {"shape": SHAPE, "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "warm_steps": args.warm,
           "timed_steps": args.steps, "threads": args.threads, "lora": {"r": args.r, "alpha": args.alpha},
           "quick": args.quick, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "memory": memory, "timing": timing, **summary(memory, timing)}
    for st, sm in res["peak_memory"].items():
        print(f"{st:8} LoRA / full fine-tuning peak memory: {sm['ratio']:.2f}x ({sm['ratio_over_start']:.2f}x over "
              "the start; goal <= 0.5)")
    print(f"LoRA / full fine-tuning tokens/s: {res['tokens_per_s_ratio']:.2f}x (goal >= 1.0); merge {res['merge_s_best']:.3f} s")
    write_json(args.out or RESULTS / f"lora{'_quick' if args.quick else ''}.json", res)


if __name__ == "__main__":
    main()
