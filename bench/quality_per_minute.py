"""Quality per CPU minute: held-out bits per byte on tinyshakespeare after a fixed wall time.

Side by side in one run, on the same machine and load:
  glassformer  `glassformer prepare --corpus tinyshakespeare.txt` (default BPE), then
               `glassformer train --time-budget 126` (the `small` preset and the training defaults)
  nanoGPT      its CPU quick start, replayed on this engine: byte-level (= character-level on
               this ASCII text), 4 layers, 4 heads, width 128, block 64, batch 12, 2000 iterations,
               lr 1e-3 → 1e-4, warm-up 100, LayerNorm, GELU, learned positions, no biases, tied head
               (nanoGPT's config/train_shakespeare_char.py with the README's CPU overrides)
The held-out split is the last 10% of the file for both (nanoGPT's split). Both runs are
subprocesses of the real CLI, timed from launch to exit; the curve is bits per byte against
seconds since the start of training, from each run's metrics.jsonl.

    flock /tmp/glassformer-bench.lock python bench/quality_per_minute.py [--corpus PATH] [--skip-nanogpt]
    ... --match-nanogpt   glassformer's budget = the wall time the nanoGPT replay needed in this run
                          less glassformer's import time, which the budget does not count
                          (the issue's definition; on a busy machine both slow down alike)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json  # bench/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
NANOGPT = ["--preset", "small", "--model", "dim=128,n_layers=4,n_heads=4,n_kv_heads=4,ffn_dim=512,max_seq_len=64,"
           "norm=layer,ffn=gelu,pos=learned,tie_embeddings=true",
           "--batch-size", "12", "--seq-len", "64", "--max-steps", "2000", "--lr", "1e-3", "--min-lr", "1e-4",
           "--warmup-steps", "100", "--beta2", "0.99", "--weight-decay", "0.1", "--grad-clip", "1.0",
           "--eval-every", "250", "--eval-tokens", "0"]


def cli(*args: str, log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run([sys.executable, "-m", "glassformer", *args], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"`glassformer {' '.join(args)}` failed; see {log}")
    return time.perf_counter() - t


def curve(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["time"], r["val_bpb"]) for r in rows if "val_bpb" in r]


def final_eval(run: Path, data: Path, log: Path) -> dict:
    cli("eval", "--checkpoint", str(run), "--data", str(data), log=log)
    return json.loads(log.read_text().strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--budget", type=float, default=126.0, help="seconds for glassformer's --time-budget")
    ap.add_argument("--skip-nanogpt", action="store_true", help="run glassformer alone")
    ap.add_argument("--match-nanogpt", action="store_true",
                    help="run nanoGPT first and give glassformer the wall time it needed (minus glassformer's start-up)")
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--train-args", default="", help="extra `glassformer train` flags (for tuning)")
    ap.add_argument("--prepare-args", default="", help="extra `glassformer prepare` flags (for tuning)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "quality_per_minute.json"), help="results file")
    args = ap.parse_args()
    corpus = Path(args.corpus)
    if not corpus.is_file():
        raise SystemExit(f"{corpus} not found: pass --corpus PATH to tinyshakespeare.txt")
    work = Path(args.work or tempfile.mkdtemp(prefix="gf-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"corpus": corpus.name, "budget_s": args.budget, "cpu_count": os.cpu_count(),
               "prepare_command": f"glassformer prepare --corpus {corpus.name} {args.prepare_args}".strip(), "runs": {}}

    if not args.skip_nanogpt:
        cli("prepare", "--corpus", str(corpus), "--out", str(work / "data-char"), "--vocab-size", "257",
            log=work / "prepare-char.log")
        nrun = work / "nanogpt"
        wall_n = cli("train", "--data", str(work / "data-char"), "--out", str(nrun), "--no-progress", *NANOGPT,
                     log=work / "train-nanogpt.log")
        ev_n = final_eval(nrun, work / "data-char", work / "eval-nanogpt.log")
        results["runs"]["nanogpt_quickstart"] = {"command": "glassformer train " + " ".join(NANOGPT), "wall_s": round(wall_n, 1),
                                                 "steps": 2000, "eval": ev_n, "curve": curve(nrun)}

    cli("prepare", "--corpus", str(corpus), "--out", str(work / "data"), *args.prepare_args.split(), log=work / "prepare.log")
    run = work / "run"
    budget = args.budget
    if args.match_nanogpt and "nanogpt_quickstart" in results["runs"]:
        # The budget starts once glassformer is imported: take that start-up off nanoGPT's wall time.
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import glassformer.cli, glassformer.train.loop"], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        budget = results["runs"]["nanogpt_quickstart"]["wall_s"] - (time.perf_counter() - t)
    results["budget_s"] = round(budget, 1)
    wall = cli("train", "--data", str(work / "data"), "--out", str(run), "--time-budget", str(budget),
               "--no-progress", *args.train_args.split(), log=work / "train.log")
    ev = final_eval(run, work / "data", work / "eval.log")
    state = json.loads((run / (run / "latest").read_text().strip() / "train_state.json").read_text())
    results["runs"]["glassformer"] = {"command": f"glassformer train --time-budget {budget:.0f} {args.train_args}".strip(),
                                      "wall_s": round(wall, 1), "steps": state["step"], "eval": ev,
                                      "time_budget_plan": state.get("time_budget_plan"),
                                      # the settings the run resolved, defaults included (which change between rounds)
                                      "train_config": {k: v for k, v in state["config"].items() if k not in ("data", "out")},
                                      "curve": curve(run), "model": json.loads((run / "latest").parent.joinpath(
                                          (run / "latest").read_text().strip(), "config.json").read_text())["model"]}
    print(f"\nheld-out bits per byte on {corpus.name} (last 10%), {os.cpu_count()} CPU cores")
    print(f"{'run':22} {'wall s':>7} {'steps':>6} {'bpb':>7} {'loss/token':>10}")
    for name, r in results["runs"].items():
        print(f"{name:22} {r['wall_s']:7.1f} {r['steps']:6d} {r['eval']['bpb']:7.4f} {r['eval']['loss']:10.4f}")
    plan = results["runs"]["glassformer"]["time_budget_plan"] or {}
    print(f"glassformer's plan: {plan.get('calibrated_total_steps')} steps at the calibration, "
          f"{plan.get('total_steps')} in the end ({len(plan.get('replans', []))} re-plans, decay from step {plan.get('decay_from')})")
    for name, r in results["runs"].items():
        print(f"{name} curve (s, bpb): " + ", ".join(f"({t:.0f}, {b:.3f})" for t, b in r["curve"]))
    write_json(args.out, results)


if __name__ == "__main__":
    main()
