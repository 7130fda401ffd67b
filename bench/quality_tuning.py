"""Tuning the quality-per-CPU-minute recipe on a busy machine: fixed steps, one thread, CPU seconds.

Wall time means nothing on a shared machine, but CPU time per step hardly moves with the load,
and the held-out bits per byte after a fixed number of steps with one thread do not move at all.
So each recipe is compared at the step count it would get in the budget: a recipe whose
CPU s/step is r times today's gets about 3300 / r steps in a quiet 126 s with two threads.

    python bench/quality_tuning.py                      # CPU s/step of each recipe (rounds alternating)
    python bench/quality_tuning.py --run NAME STEPS --data DATA -- [train flags]
        # train NAME at STEPS steps, one thread, no evaluations on the way; then `glassformer eval`
        # over the whole held-out split; appends {name, steps, flags, cpu_s, bpb} to --out
    python bench/quality_tuning.py --coverage STEPS --data DATA
        # how often each training token is read over STEPS steps of 8 windows of 64, for each sampling
    python bench/quality_tuning.py --gap STEPS --data DATA [--every 330] -- [train flags]
        # train at STEPS steps, one thread, the whole held-out split evaluated every --every steps;
        # each evaluation beside the mean training loss of the steps since the one before (--out)

DATA is `glassformer prepare --corpus tinyshakespeare.txt` (the defaults). docs/benchmarks.md,
"What bought what", records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
# Step-cost recipes: (ModelConfig overrides of the small preset, optimizer, batch, context, Newton–Schulz steps,
# bf16 autocast).
RECIPES = {
    "defaults": {}, "--optimizer muon": {"opt": "muon"}, "muon, 3 Newton–Schulz steps": {"opt": "muon", "ns": 3},
    "muon, batch 16": {"opt": "muon", "batch": 16}, "batch 16": {"batch": 16}, "batch 4": {"batch": 4},
    "batch 4, context 128": {"batch": 4, "T": 128, "model": {"max_seq_len": 128}},
    "untied": {"model": {"tie_embeddings": False}}, "dropout 0.1": {"model": {"dropout": 0.1}},
    "3 layers": {"model": {"n_layers": 3}}, "5 layers": {"model": {"n_layers": 5}},
    "ffn 256": {"model": {"ffn_dim": 256}}, "ffn 512": {"model": {"ffn_dim": 512}},
    "vocab 1024": {"model": {"vocab_size": 1024}}, "naive attention": {"model": {"attention": "naive"}},
    "vocab 4096": {"model": {"vocab_size": 4096}}, "vocab 512": {"model": {"vocab_size": 512}},
    "vocab 1536": {"model": {"vocab_size": 1536}}, "vocab 768": {"model": {"vocab_size": 768}},
    "vocab 1024 + 5 layers": {"model": {"vocab_size": 1024, "n_layers": 5}},
    "vocab 1024 + 6 layers": {"model": {"vocab_size": 1024, "n_layers": 6}},
    "vocab 1024 + ffn 512": {"model": {"vocab_size": 1024, "ffn_dim": 512}},
    "vocab 1024 + dim 160": {"model": {"vocab_size": 1024, "dim": 160, "n_heads": 5, "n_kv_heads": 5, "ffn_dim": 480}},
    "vocab 1024 + context 96": {"batch": 8, "T": 96, "model": {"vocab_size": 1024, "max_seq_len": 96}},
    "--dtype bf16": {"bf16": True},
    "--dtype bf16 with bf16 attention": {"bf16": True, "bf16_attention": True},
}


def build(recipe: dict):
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.train.optim import make_muon, make_optimizer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("small", **recipe.get("model", {}))).train()
    cpu = torch.device("cpu")
    if recipe.get("opt") == "muon":
        opt = make_muon(model, 2e-3, 0.02, 0.95, 0.1, (0.9, 0.99), cpu)
        opt.optimizers[0].param_groups[0]["ns_steps"] = recipe.get("ns", 5)
    else:
        opt = make_optimizer(model, 2e-3, 0.1, (0.9, 0.99), cpu)
    return model, opt


def step_costs(rounds: int, steps: int, names: list[str] | None = None) -> dict:
    """Least CPU seconds per step over `rounds` rounds of `steps` steps, the recipes alternating in
    each round (the defaults and `names`, or every recipe)."""
    import torch

    from glassformer.attention import sdpa
    from glassformer.train.step import train_step

    torch.set_num_threads(1)
    recipes = {k: r for k, r in RECIPES.items() if names is None or k == "defaults" or k in names}
    built = {k: build(r) for k, r in recipes.items()}
    times = {k: [] for k in recipes}
    for _ in range(rounds):
        for k, r in recipes.items():
            model, opt = built[k]
            shape = (r.get("batch", 8), r.get("T", 64))  # (B, T)
            x, y = (torch.randint(0, model.config.vocab_size, shape) for _ in range(2))
            kw = {"autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)} if r.get("bf16") else {}
            sdpa.CPU_BF16_IN_FLOAT32 = not r.get("bf16_attention")
            train_step(model, opt, x, y, grad_clip=1.0, **kw)  # untimed: first-call costs
            t = time.process_time()
            for _ in range(steps):
                train_step(model, opt, x, y, grad_clip=1.0, **kw)
            times[k].append((time.process_time() - t) / steps)
            sdpa.CPU_BF16_IN_FLOAT32 = True
    best = {k: min(v) for k, v in times.items()}
    return {k: {"cpu_s_per_step": round(v, 5), "ratio": round(v / best["defaults"], 3)} for k, v in best.items()}


def run_recipe(name: str, steps: int, data: Path, flags: list[str]) -> dict:
    """One training at fixed steps with one thread (CPU seconds of the process), then the whole-split eval."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="gf-tune-") as tmp:
        out = Path(tmp) / name.replace(" ", "_")
        cmd = [sys.executable, "-m", "glassformer", "train", "--data", str(data), "--out", str(out), "--max-steps",
               str(steps), "--threads", "1", "--eval-every", "0", "--no-progress", *flags]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        ev = subprocess.run([sys.executable, "-m", "glassformer", "eval", "--checkpoint", str(out), "--data", str(data)],
                            env=env, check=True, capture_output=True, text=True)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    bpb = json.loads(ev.stdout.strip().splitlines()[-1])["bpb"]
    return {"name": name, "steps": steps, "flags": flags, "train_cpu_s": round(cpu, 1), "bpb": round(bpb, 4)}


def gap(steps: int, every: int, data: Path, flags: list[str]) -> dict:
    """Training loss against held-out loss as the passes over the training split add up: one run at fixed
    steps with one thread, the whole held-out split scored every `every` steps."""
    meta = json.loads((data / "meta.json").read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory(prefix="gf-gap-") as tmp:
        cmd = [sys.executable, "-m", "glassformer", "train", "--data", str(data), "--out", tmp, "--max-steps",
               str(steps), "--threads", "1", "--eval-every", str(every), "--eval-tokens", str(meta["val_tokens"]),
               "--no-progress", *flags]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r]
    batch_tokens = train[0]["tokens"] // train[0]["step"]  # tokens a step (the log's running count)
    out = []
    for r in rows:
        if "val_loss" in r:
            seen = [t["loss"] for t in train if r["step"] - every < t["step"] <= r["step"]]
            out.append({"step": r["step"], "epochs": round(r["step"] * batch_tokens / meta["train_tokens"], 2),
                        "train_loss_mean_since_last": round(sum(seen) / len(seen), 4),
                        "val_loss": r["val_loss"], "val_bpb": r["val_bpb"]})
    return {"steps": steps, "every": every, "flags": flags, "train_tokens": meta["train_tokens"],
            "tokens_per_step": batch_tokens, "intervals": out}


def coverage(steps: int, data: Path, batch: int = 8, seq_len: int = 64, seed: int = 1337) -> dict:
    """How often each training token is read (as a window's input) over `steps` steps of `batch` windows,
    for each way of drawing them (`get_batch`'s sampling): text/data.py's own draws, no training."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from glassformer.config import SAMPLINGS
    from glassformer.text.data import batch_starts

    n = json.loads((data / "meta.json").read_text())["train_tokens"]
    out = {}
    for sampling in SAMPLINGS:
        starts = torch.cat([batch_starts(n, batch, seq_len, seed, s, sampling) for s in range(steps)])  # (steps*B,)
        edges = torch.zeros(n + 1)
        edges.index_add_(0, starts, torch.ones(len(starts)))
        edges.index_add_(0, starts + seq_len, -torch.ones(len(starts)))
        reads = edges.cumsum(0)[:n - 1]  # (n-1,) windows covering each token as an input
        q = torch.quantile(reads[:min(len(reads), 1 << 24)], torch.tensor([0.01, 0.5, 0.99])).tolist()
        out[sampling] = {"mean": round(float(reads.mean()), 2), "min": int(reads.min()), "max": int(reads.max()),
                         "p01_p50_p99": q, "never_read": int((reads == 0).sum())}
    return {"steps": steps, "batch": batch, "seq_len": seq_len, "seed": seed, "train_tokens": n, "reads": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per recipe and round")
    ap.add_argument("--run", nargs=2, metavar=("NAME", "STEPS"), help="train one recipe instead (flags after --)")
    ap.add_argument("--gap", type=int, metavar="STEPS", help="the training/held-out gap of one run instead")
    ap.add_argument("--coverage", type=int, metavar="STEPS",
                    help="how often each training token is read over STEPS steps, for each sampling, instead")
    ap.add_argument("--every", type=int, default=330, help="steps between evaluations (with --gap)")
    ap.add_argument("--data", default="data", help="prepared tinyshakespeare (with --run, --gap)")
    ap.add_argument("--out", default=None, help="results file")
    ap.add_argument("--recipes", default=None, help="price these recipes only (comma-separated names), beside the defaults")
    args, flags = ap.parse_known_args()
    flags = [f for f in flags if f != "--"]
    if args.coverage:
        res = coverage(args.coverage, Path(args.data))
        for k, v in res["reads"].items():
            print(f"{k:>7}: {v['mean']} reads a token on average, 1st/50th/99th percentile {v['p01_p50_p99']}, "
                  f"{v['min']}-{v['max']}, {v['never_read']} tokens never read")
        write_json(args.out or REPO / "bench" / "results" / "sampling_coverage.json", res)
        return
    if args.gap:
        res = gap(args.gap, args.every, Path(args.data), flags)
        for i in res["intervals"]:
            print(f"step {i['step']:5d} ({i['epochs']:.2f} passes): training {i['train_loss_mean_since_last']:.3f}, "
                  f"held-out {i['val_loss']:.3f} ({i['val_bpb']:.3f} bpb)")
        write_json(args.out or REPO / "bench" / "results" / "quality_gap.json", res)
        return
    if args.run:
        out = Path(args.out or REPO / "bench" / "results" / "quality_tuning_runs.json")
        rows = json.loads(out.read_text()) if out.exists() else []
        rows.append(run_recipe(args.run[0], int(args.run[1]), Path(args.data), flags))
        print(json.dumps(rows[-1]))
        write_json(out, rows)
        return
    costs = step_costs(args.rounds, args.steps, args.recipes.split(",") if args.recipes else None)
    for k, v in costs.items():
        print(f"{k:32} {v['cpu_s_per_step'] * 1000:7.1f} ms  {v['ratio']:.2f}x")
    write_json(args.out or REPO / "bench" / "results" / "quality_tuning_cost.json", {"threads": 1, "costs": costs})


if __name__ == "__main__":
    main()
