"""Training tokens/s on CPU (fp32) against Hugging Face LlamaForCausalLM, side by side in one process.

The reference shape (config.REFERENCE_SHAPE: vocabulary 8192, width 384, FFN 1024, 6 layers,
6 heads, 2 KV heads, untied), batch 8 × 256 tokens, AdamW, gradient clipping, the same
weights in both. Rounds alternate between the two models so a change in machine load hits
both alike; the best round of each is reported. glassformer's steps run as `glassformer
train` runs them, keeping freed memory for the next step (cpu_memory.keep_freed_memory);
transformers' run as it ships, with the allocator's defaults, and once more with the same
setting as ours ("transformers, freed memory kept"), the like-for-like row. MFU = model FLOPs (metrics.flops_per_token)
× tokens/s ÷ the fp32 matmul peak measured in the same run with the same threads.

    flock /tmp/glassformer-bench.lock python bench/train_throughput.py [--steps 3] [--rounds 3] [--profile]
        [--compile ours|both]   # torch.compile glassformer's model (as `train --compile` does), or both models
        [--no-keep-freed-memory]   # glassformer's steps with the allocator's defaults too
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.convert import to_transformers  # noqa: E402
from glassformer.train.cpu_memory import keep_freed_memory  # noqa: E402
from glassformer.train.metrics import cpu_matmul_peak, flops_per_token, pick_threads  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402


def timed_steps(step, n: int, keep: bool = False) -> float:
    """Seconds per step, the best of n (after one untimed warm-up step); keep: freed memory kept."""
    best = float("inf")
    with keep_freed_memory(keep):
        step()
        for _ in range(n):
            t = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="0: the faster of 1 and all (as `glassformer train` picks)")
    ap.add_argument("--compile", choices=["ours", "both"], help="compile glassformer's model, or both models")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_throughput.json"))
    ap.add_argument("--profile", action="store_true", help="also print where one of glassformer's steps goes (torch profiler)")
    ap.add_argument("--no-keep-freed-memory", dest="keep", action="store_false",
                    help="run glassformer's steps with the allocator's defaults too (as before `train` kept freed memory)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        pick_threads(torch.get_num_threads())
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    cfg = ModelConfig(**REFERENCE_SHAPE)
    ours = Transformer(cfg).train()
    hf = to_transformers(ours).train()  # LlamaForCausalLM with the same weights, via our export
    B, T = args.batch, args.seq
    x = torch.randint(0, cfg.vocab_size, (B, T))
    y = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():  # same weights, same loss: the comparison is like for like
        l_ours = float(ours(x, y)[1])
        lg = hf(input_ids=x).logits
        l_hf = float(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.size(-1)), y.reshape(-1)))
    assert abs(l_ours - l_hf) < 1e-4, (l_ours, l_hf)

    if args.compile:  # the first (untimed) step of each round compiles
        ours.compile()
        if args.compile == "both":
            hf.compile()
    opt_ours = make_optimizer(ours, 1e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    # Hugging Face's usual training set-up: torch AdamW (foreach), decay on the same tensors.
    decay = [p for p in hf.parameters() if p.dim() >= 2]
    no_decay = [p for p in hf.parameters() if p.dim() < 2]
    opt_hf = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                               lr=1e-4, betas=(0.9, 0.95))

    def step_ours():
        _, loss = ours(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_hf():
        logits = hf(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    peak = cpu_matmul_peak(seconds=1.0)
    engines = {"glassformer": (step_ours, args.keep), "transformers": (step_hf, False),
               "transformers, freed memory kept": (step_hf, True)}
    best = dict.fromkeys(engines, float("inf"))
    for _ in range(args.rounds):
        for name, (step, keep) in engines.items():
            best[name] = min(best[name], timed_steps(step, args.steps, keep))
    peak = max(peak, cpu_matmul_peak(seconds=1.0))  # the best of two measurements, before and after
    fpt = flops_per_token(cfg, T)
    rows = {}
    for name, sec in best.items():
        tok_s = B * T / sec
        rows[name] = {"sec_per_step": round(sec, 4), "tok_s": round(tok_s, 1), "mfu": round(fpt * tok_s / peak, 4)}
    ratio = rows["glassformer"]["tok_s"] / rows["transformers"]["tok_s"]
    like_for_like = rows["glassformer"]["tok_s"] / rows["transformers, freed memory kept"]["tok_s"]
    import transformers

    result = {"shape": REFERENCE_SHAPE, "batch": B, "seq": T, "dtype": "fp32", "threads": threads,
              "cpu_count": os.cpu_count(), "matmul_peak_gflops": round(peak / 1e9, 1), "flops_per_token": fpt,
              "torch": torch.__version__, "transformers": transformers.__version__, "compiled": args.compile or "none", "rows": rows,
              "keep_freed_memory": args.keep, "ratio": round(ratio, 3), "ratio_same_allocator": round(like_for_like, 3)}
    print(f"training throughput, reference shape, B {B} × T {T}, fp32, {threads} thread(s), compiled: {args.compile or 'none'}; "
          f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s")
    print(f"{'engine':32} {'s/step':>8} {'tokens/s':>10} {'MFU':>6}")
    for name, r in rows.items():
        print(f"{name:32} {r['sec_per_step']:8.3f} {r['tok_s']:10.1f} {100 * r['mfu']:5.1f}%")
    print(f"glassformer / transformers: {ratio:.2f}x (as each ships); {like_for_like:.2f}x (same allocator setting)")
    if args.profile:
        from torch.profiler import profile

        with keep_freed_memory(args.keep), profile() as prof:
            step_ours()
        ops = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in ops)
        print("one glassformer step, share of CPU time by operation (self time):")
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"  {100 * e.self_cpu_time_total / total:5.1f}%  {e.key}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
