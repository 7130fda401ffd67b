"""Speedrun switches, ablated: the `small` preset's recipe with each switch on vs off, at a fixed step count.

One run per row, one after another (never in parallel), each a subprocess of the real CLI:
  `glassformer prepare --corpus tinyshakespeare.txt` (the defaults: byte-level BPE of 2048 tokens,
  the last 10% held out), then for each row
  `glassformer train --max-steps N --eval-every 0 --threads T --model SWITCH` (the training defaults
  otherwise) and `glassformer eval` over the whole validation split.
A fixed number of optimizer steps, not a wall-time budget: on a busy machine the clock says more
about the neighbours than about the model. Time per step is reported beside it, both the train
process's CPU time (resource.getrusage of the child: user + system) and its wall time, each over
the whole process (start-up, the final evaluation and checkpoint included) divided by the steps,
and the wall time between the first and last logged steps (the loop alone).

    flock /tmp/glassformer-bench.lock python bench/ablations.py [--steps 1000] [--threads 1] [--rows qk_norm,relu2]
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

# Each row: the --model overrides of the small preset (and other train flags). relu2 gets ffn_dim
# 576 so that its two matrices hold the weights SwiGLU's three hold at 384 (a comparison at equal
# size); nanochat's softcap is 15. The _seed2/_seed3 rows draw other weights and batches: the
# spread between the baselines is what a difference must clear to count.
SWITCHES = {
    "baseline": "",
    "qk_norm": "qk_norm=true",
    "relu2": "ffn=relu2,ffn_dim=576",
    "logit_softcap": "logit_softcap=15.0",
    "value_embeddings": "value_embeddings=true",
}
SEEDS = {"": None, "_seed2": 1338, "_seed3": 1339}  # row-name suffix -> --seed (None: the default, 1337)
ROWS = {k + suffix: (v, [] if seed is None else ["--seed", str(seed)]) for suffix, seed in SEEDS.items()
        for k, v in SWITCHES.items()}


def cli(args: list[str], log: Path) -> dict:
    """Run `glassformer ARGS` to completion; its wall time and its CPU time (seconds)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-m", "glassformer", *args], env=env, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"`glassformer {' '.join(args)}` failed; see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def loop_wall_per_step(run: Path) -> float | None:
    """Seconds per step between the first and last logged training steps (metrics.jsonl's time)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "time" in r and "step" in r and "loss" in r]
    if len(rows) < 2 or rows[-1]["step"] == rows[0]["step"]:
        return None
    return (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"])


def one_row(name: str, row, data: Path, work: Path, steps: int, threads: int) -> dict:
    model, extra = row if isinstance(row, tuple) else (row, [])
    run = work / f"run-{name}"
    train = ["train", "--data", str(data), "--out", str(run), "--max-steps", str(steps), "--eval-every", "0",
             "--threads", str(threads), "--no-progress"] + (["--model", model] if model else []) + extra
    t = cli(train, work / f"train-{name}.log")
    log = work / f"eval-{name}.log"
    cli(["eval", "--checkpoint", str(run), "--data", str(data)], log)
    ev = json.loads(log.read_text().strip().splitlines()[-1])
    cfg = json.loads((run / (run / "latest").read_text().strip() / "config.json").read_text())["model"]
    from glassformer.config import ModelConfig
    from glassformer.cost.params import num_weights
    return {"model": model, "command": "glassformer " + " ".join(train[:1] + train[5:]), "steps": steps,
            "bpb": ev["bpb"], "loss": ev["loss"], "weights": num_weights(ModelConfig.from_dict(cfg)),
            "cpu_s_per_step": t["cpu_s"] / steps, "wall_s_per_step": t["wall_s"] / steps,
            "loop_wall_s_per_step": loop_wall_per_step(run), "cpu_s": round(t["cpu_s"], 1), "wall_s": round(t["wall_s"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--steps", type=int, default=1000, help="optimizer steps of every run")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of every run")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, among: {', '.join(ROWS)} (default: all)")
    ap.add_argument("--work", default=None, help="folder for the data and the runs (default: a temporary one; "
                    "a prepared data/ there is reused)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "ablations.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose among {', '.join(ROWS)}")
    corpus = Path(args.corpus)
    if not corpus.is_file():
        raise SystemExit(f"{corpus} not found: pass --corpus PATH to tinyshakespeare.txt")
    work = Path(args.work or tempfile.mkdtemp(prefix="gf-ablations-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "meta.json").is_file():
        cli(["prepare", "--corpus", str(corpus), "--out", str(data)], work / "prepare.log")
    results = {"corpus": corpus.name, "steps": args.steps, "threads": args.threads, "cpu_count": os.cpu_count(),
               "note": "measured on a busy machine (other processes running): times are indicative only",
               "rows": {}}
    out = Path(args.out)
    if out.is_file():  # rows of an earlier invocation with the same steps are kept (one row at a time is fine)
        old = json.loads(out.read_text())
        if old.get("steps") == args.steps and old.get("threads") == args.threads:
            results["rows"] = old.get("rows", {})
    for name in rows:
        r = one_row(name, ROWS[name], data, work, args.steps, args.threads)
        results["rows"][name] = r
        print(f"{name:18} bpb {r['bpb']:.4f}  cpu {1000 * r['cpu_s_per_step']:.1f} ms/step  "
              f"wall {1000 * r['wall_s_per_step']:.1f} ms/step", flush=True)
        write_json(out, results)
    results["summary"] = summary(results["rows"])
    write_json(out, results)


def summary(rows: dict) -> dict:
    """Each switch against the baseline of the same seed, and the mean of those differences over seeds;
    the spread of the two baselines beside them."""
    out = {}
    for name in SWITCHES:
        diffs = []
        for suffix in SEEDS:
            r, base = rows.get(name + suffix), rows.get("baseline" + suffix)
            if r and base:
                r["bpb_vs_baseline"] = round(r["bpb"] - base["bpb"], 4)
                r["cpu_per_step_vs_baseline"] = round(r["cpu_s_per_step"] / base["cpu_s_per_step"], 3)
                diffs.append(r["bpb_vs_baseline"])
        if diffs and name != "baseline":
            out[name] = {"bpb_vs_baseline_by_seed": diffs, "mean": round(sum(diffs) / len(diffs), 4)}
    bases = [rows["baseline" + suffix]["bpb"] for suffix in SEEDS if "baseline" + suffix in rows]
    if len(bases) > 1:
        out["baseline_seed_spread"] = round(max(bases) - min(bases), 4)
    return out


if __name__ == "__main__":
    main()
