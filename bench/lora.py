"""LoRA fine-tuning against full fine-tuning on the smollm-135m shape on the CPU (docs/lora.md).

Both train the same model (random weights, the preset's shape: 135M weights, tied embeddings)
on the same batches with glassformer's own training step (train/step.train_step: AdamW, clipping
at 1.0), once with freed memory kept as `glassformer train` keeps it on a CPU (train/cpu_memory.py)
and once with the allocator's defaults, since kept memory raises the peak. LoRA wraps every block
product (r 8, alpha 16) and trains only A and B; full fine-tuning trains every weight. Each run
is a process of its own, since its peak resident memory is the process's high-water mark; runs
alternate between the two. Per run: seconds per step (best timed step, after warm-up), tokens/s,
the process's peak resident memory and that peak less the memory the process held before the
model was built (the interpreter and torch); for LoRA also the time merge_lora takes to fold
every adapter into its weight. Ratios, per allocator setting: LoRA's peak memory over full
fine-tuning's (goal <= 0.5) and LoRA's tokens/s over full fine-tuning's (goal >= 1.0).

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
SETTINGS = {"kept": True, "defaults": False}  # freed memory kept (as train does on a CPU), the allocator's defaults
SHAPE = "smollm-135m"


def rss_mb() -> float:
    """The process's resident memory now (Linux: /proc/self/statm), in MB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def build(mode: str, r: int, alpha: float) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(SHAPE)).train()
    if mode == "lora":
        apply_lora(model, LoraConfig(r=r, alpha=alpha))
    return model


def one_run(mode: str, setting: str, args) -> dict:
    """Build, warm up, time the steps (and for LoRA the merge) in this process."""
    torch.set_num_threads(args.threads)
    before = rss_mb()
    model = build(mode, args.r, args.alpha)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = make_optimizer(model, 1e-4, 0.0, (0.9, 0.95), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.warm + args.steps)]
    times, losses = [], []
    with keep_freed_memory(SETTINGS[setting]):
        for i, b in enumerate(batches):
            t = time.perf_counter()
            res = train_step(model, opt, b[:, :-1], b[:, 1:], grad_clip=1.0)
            if i >= args.warm:
                times.append(time.perf_counter() - t)
            losses.append(round(res.loss, 4))
    peak = peak_rss_mb()
    out = {"mode": mode, "setting": setting, "trainable_weights": trainable, "sec_per_step_best": round(min(times), 3),
           "sec_per_step_median": round(sorted(times)[len(times) // 2], 3),
           "tokens_per_s": round(args.batch * args.seq / min(times), 1), "losses": losses,
           "peak_rss_mb": round(peak), "rss_before_model_mb": round(before), "peak_over_start_mb": round(peak - before)}
    if mode == "lora":
        out["adapter_weights"] = count_adapter_weights(model)
        t = time.perf_counter()
        merge_lora(model)
        out["merge_s"] = round(time.perf_counter() - t, 3)
    return out


def _child(mode: str, setting: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, setting, "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads), "--warm", str(args.warm), "--steps", str(args.steps),
           "--r", str(args.r), "--alpha", str(args.alpha)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def summary(runs: dict[str, list[dict]]) -> dict:
    """LoRA over full fine-tuning, from each mode's best run (lowest peak, highest tokens/s)."""
    best = {m: {"peak_rss_mb": min(r["peak_rss_mb"] for r in rs),
                "peak_over_start_mb": min(r["peak_over_start_mb"] for r in rs),
                "tokens_per_s": max(r["tokens_per_s"] for r in rs)} for m, rs in runs.items()}
    full, lora = best["full"], best["lora"]
    return {"best": best,
            "peak_rss_ratio": round(lora["peak_rss_mb"] / full["peak_rss_mb"], 3),
            "peak_over_start_ratio": round(lora["peak_over_start_mb"] / full["peak_over_start_mb"], 3),
            "tokens_per_s_ratio": round(lora["tokens_per_s"] / full["tokens_per_s"], 3),
            "merge_s_best": min(r["merge_s"] for r in runs["lora"])}


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
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                    help="kept: freed memory kept, as train does on a CPU; defaults: the allocator's own")
    ap.add_argument("--quick", action="store_true", help="batch 2 × 128 tokens, 3 timed steps")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/lora[_quick].json)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(*args.child, args)))
        return
    if args.quick:
        args.batch, args.seq, args.steps = 2, 128, 3
    runs = {st: {m: [] for m in MODES} for st in args.settings}
    for _ in range(args.rounds):
        for setting in args.settings:
            for mode in MODES:
                runs[setting][mode].append(r := _child(mode, setting, args))
                print(f"  {setting:8} {mode:4}  {r['sec_per_step_best']:.2f} s/step  {r['tokens_per_s']:7.1f} tokens/s  "
                      f"peak {r['peak_rss_mb']:,} MB ({r['peak_over_start_mb']:,} MB over the start)"
                      + (f"  merge {r['merge_s']:.3f} s" if mode == "lora" else ""), flush=True)
    res = {"shape": SHAPE, "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "warm_steps": args.warm,
           "timed_steps": args.steps, "threads": args.threads, "lora": {"r": args.r, "alpha": args.alpha},
           "quick": args.quick, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "runs": runs, "ratios": {st: summary(by) for st, by in runs.items()}}
    for st, sm in res["ratios"].items():
        print(f"{st:8} LoRA / full fine-tuning: peak memory {sm['peak_rss_ratio']:.2f}x ({sm['peak_over_start_ratio']:.2f}x "
              f"over the start; goal <= 0.5), tokens/s {sm['tokens_per_s_ratio']:.2f}x (goal >= 1.0); "
              f"merge {sm['merge_s_best']:.3f} s")
    write_json(args.out or RESULTS / f"lora{'_quick' if args.quick else ''}.json", res)


if __name__ == "__main__":
    main()
