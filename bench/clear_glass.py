"""Before and after "clear glass" (model.py the architecture alone, speed put on from outside by
glassformer.speed, no native code built at run time), in one run, on the reference shape.

The code before is a git revision checked out into a temporary worktree; the code after is this
tree. Each runs its own copy of the three benchmark scripts below, in a fresh process, and each
script measures its peer in the same process (transformers' generate and training step), so every
figure is also a ratio to the peer measured beside it. The versions alternate round by round, so a
change in the machine's speed touches both alike.

    bench/decode.py            batch-1 greedy decode, eager and compiled, and prefill, vs transformers
    bench/batching.py          the serve engine in-process at 1 / 4 / 16 streams (eager)
    bench/train_throughput.py  training tokens/s vs transformers

    python bench/clear_glass.py [--before 9bc628e] [--rounds 1] [--threads 2]   # bench/results/clear_glass.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BEFORE = "9bc628e"  # the last revision with the speed machinery inside model.py and the C++ kernel


def scripts(threads: int) -> dict[str, list[str]]:
    """Each measurement: the script and its flags (the same for both versions)."""
    return {
        "decode": ["bench/decode.py", "--rounds", "3", "--latency-rounds", "1", "--threads", str(threads)],
        "serve": ["bench/batching.py", "--shape", "reference", "--streams", "1,4,16", "--rounds", "3",
                  "--threads", str(threads)],
        "train": ["bench/train_throughput.py", "--steps", "3", "--rounds", "2", "--threads", str(threads)],
    }


def run(tree: Path, argv: list[str], out: Path) -> dict:
    """One script of one version, in a fresh process in that version's tree: its JSON result."""
    cmd = [sys.executable, *argv, "--out", str(out)]
    print(f"[{tree.name}] {' '.join(argv)}", flush=True)
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def figures(name: str, r: dict) -> dict[str, float]:
    """The headline numbers of one script's result."""
    if name == "decode":
        d = r["decode"]
        return {"eager_tok_s": d["ours_tokens_per_s"], "eager_vs_hf": d["speedup"],
                "compiled_tok_s": d.get("ours_compiled_tokens_per_s"), "compiled_vs_hf": d.get("speedup_compiled"),
                "hf_tok_s": d["hf_tokens_per_s"], "identical_tokens": d["identical_tokens"],
                "prefill_512_tok_s": r["prefill"]["512"]["ours_tokens_per_s"],
                "prefill_512_vs_hf": r["prefill"]["512"]["ours_tokens_per_s"] / r["prefill"]["512"]["hf_tokens_per_s"],
                "read_GBps": r["roofline"]["read_bandwidth_GBps"], "eager_roofline": r["roofline"]["ours_fraction"]}
    if name == "serve":
        runs = r["runs"]
        out = {f"streams_{n}_tok_s": runs[f"eager/{n}"]["tokens_per_s"] for n in (1, 4, 16)}
        out["16_vs_1"] = out["streams_16_tok_s"] / out["streams_1_tok_s"]
        out["4_vs_1"] = out["streams_4_tok_s"] / out["streams_1_tok_s"]
        out["generate_tok_s"] = r["generate_tokens_per_s"]
        return out
    rows = r["rows"]
    return {"tok_s": rows["glassformer"]["tok_s"], "hf_tok_s": rows["transformers"]["tok_s"],
            "vs_hf": rows["glassformer"]["tok_s"] / rows["transformers"]["tok_s"], "mfu": rows["glassformer"]["mfu"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help="the git revision measured as 'before'")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the whole set, the versions alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="decode,serve,train", help="which measurements, comma-separated")
    ap.add_argument("--out", default=str(RESULTS / "clear_glass.json"))
    args = ap.parse_args()
    wanted = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(before), args.before], cwd=REPO, check=True)
        try:
            trees = {"before": before, "after": REPO}
            got: dict = {v: {n: [] for n in wanted} for v in trees}
            for rnd in range(args.rounds):
                for name, argv in scripts(args.threads).items():
                    if name not in wanted:
                        continue
                    order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
                    for v in order:
                        got[v][name].append(figures(name, run(trees[v], argv, Path(tmp) / f"{v}-{name}.json")))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=False)
    result = {"before": args.before, "after": "this tree", "threads": args.threads, "rounds": args.rounds,
              "runs": got, "median": {}, "after_vs_before": {}}
    for v in got:
        result["median"][v] = {n: {k: statistics.median(x[k] for x in runs) if not isinstance(runs[0][k], bool)
                                   else all(x[k] for x in runs) for k in runs[0] if runs[0][k] is not None}
                               for n, runs in got[v].items()}
    for n in wanted:
        a, b = result["median"]["after"][n], result["median"]["before"][n]
        result["after_vs_before"][n] = {k: a[k] / b[k] for k in a if k in b and not isinstance(a[k], bool) and b[k]}
    write_json(args.out, result)
    for n in wanted:
        print(n, json.dumps({k: round(v, 3) for k, v in result["after_vs_before"][n].items()}))


if __name__ == "__main__":
    main()
