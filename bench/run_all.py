"""Run every benchmark in bench/, one after another (they time things: never in parallel).

    python bench/run_all.py [--only decode train_throughput ...] [--skip quality_per_minute]

Each script prints its own table and writes bench/results/<name>.json; docs/benchmarks.md
records the results with the command that produced them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    names = sorted(p.stem for p in HERE.glob("*.py") if p.stem != "run_all" and not p.stem.startswith("_"))  # _: helpers
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=names, default=None)
    ap.add_argument("--skip", nargs="+", choices=names, default=[])
    args = ap.parse_args()
    chosen = [n for n in (args.only or names) if n not in args.skip]
    if "gpu" in chosen and not args.only:
        import torch

        if not torch.cuda.is_available():  # it measures GPU goals; say so rather than fail
            chosen.remove("gpu")
            print("bench/gpu.py skipped: no CUDA GPU here", flush=True)
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    failed = []
    for name in chosen:
        print(f"\n=== bench/{name}.py", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py")], cwd=HERE.parent, env=env)
        print(f"=== bench/{name}.py: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
