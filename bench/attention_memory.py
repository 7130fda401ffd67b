"""Attention kernels on CPU: peak extra memory and time against sequence length.

Each (kernel, T) runs in a fresh child process, which reports the growth of its peak
resident memory over what it held once the inputs existed: the memory the kernel itself
needed. The naive kernel holds the T×T score grid (quadratic); the tiled kernel holds one
tile of scores at a time (linear: its output and running statistics); PyTorch's fused
SDPA is measured beside them.

    python bench/attention_memory.py [--lengths 128 256 ... 4096] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
from glassformer.attention import get_kernel
kernel, T, N, H, tile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
q, k, v = (torch.randn(1, N, T, H) for _ in range(3))
pos = torch.arange(T)[None]
fn = get_kernel(kernel, tile)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * resource.getpagesize()
base = rss()
with torch.no_grad():
    fn(q, k, v, q_pos=pos, start=0)  # warm-up, and the peak we measure
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(5):
        t0 = time.perf_counter(); fn(q, k, v, q_pos=pos, start=0); times.append(time.perf_counter() - t0)
print(json.dumps({"extra_bytes": max(0, peak - base), "seconds": min(times)}))
"""


def run_child(kernel: str, T: int, N: int, H: int, tile: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    out = subprocess.run([sys.executable, "-c", CHILD, kernel, str(T), str(N), str(H), str(tile)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def slope(xs, ys) -> float:
    """Least-squares slope of log y against log x: 1 for linear growth, 2 for quadratic."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--json", default="bench/results/attention_memory.json")
    ap.add_argument("--plot", default="docs/img/attention_memory.png")
    args = ap.parse_args()
    kernels = ["naive", "tiled", "sdpa"]
    rows = []
    print(f"B=1, N={args.heads} heads, H={args.head_dim}, fp32, tile={args.tile}, torch threads={os.cpu_count()}")
    print(f"{'T':>6} " + " ".join(f"{k + ' MB':>10} {k + ' ms':>10}" for k in kernels) + f" {'T×T grid MB':>12}")
    for T in args.lengths:
        row = {"T": T, "grid_bytes": args.heads * T * T * 4}
        for kname in kernels:
            r = run_child(kname, T, args.heads, args.head_dim, args.tile)
            row[kname] = r
        rows.append(row)
        print(f"{T:>6} " + " ".join(f"{row[k]['extra_bytes'] / 2**20:>10.1f} {row[k]['seconds'] * 1e3:>10.1f}" for k in kernels)
              + f" {row['grid_bytes'] / 2**20:>12.1f}")
    # The smallest T's figure is mostly fixed cost (allocator arenas, thread pools): measure
    # the growth above it, over the lengths where it is well above noise.
    big = [r for r in rows if r["T"] >= 4 * rows[0]["T"]]
    slopes = {k: slope([r["T"] for r in big], [r[k]["extra_bytes"] - rows[0][k]["extra_bytes"] for r in big])
              for k in kernels}
    print(f"growth exponent of extra memory above T={rows[0]['T']} (1 = linear, 2 = quadratic): "
          + ", ".join(f"{k} {s:.2f}" for k, s in slopes.items()))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows, "slopes": slopes}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        Ts = [r["T"] for r in rows]
        for k in kernels:
            a1.loglog(Ts, [max(r[k]["extra_bytes"], 1) / 2**20 for r in rows], "o-", label=k)
            a2.loglog(Ts, [r[k]["seconds"] * 1e3 for r in rows], "o-", label=k)
        a1.loglog(Ts, [r["grid_bytes"] / 2**20 for r in rows], "k--", label="one T×T grid")
        a1.set(xlabel="sequence length T", ylabel="peak extra memory (MiB)", title="memory")
        a2.set(xlabel="sequence length T", ylabel="time per call (ms)", title="time (CPU)")
        for a in (a1, a2):
            a.set_xticks(Ts, [str(t) for t in Ts])
            a.minorticks_off()
            a.legend()
            a.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
