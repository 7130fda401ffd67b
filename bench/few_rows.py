"""A batched decode step's weight products alone, at 2 to 64 rows: the kernel library's panels
(cpu_decode.few_rows_product, what a continuous-batching step runs where the library is built)
against oneDNN's packed weights (what it runs otherwise, or with cpu_decode.products off) and the
library's plain product over the (in, out) matrix.

The reference shape's 25 products of one step (bench/matvec.py's step_matrices: Q/K/V and
gate/up joined, O, down, the head; 50.3 MB of fp32 weights, more than the caches hold, so each
step reads them from memory as a server's step does) run one after another, each way in turn,
the ways in another order each round; per row count: the best round's milliseconds a step, its
GFLOP/s and the share of the fp32 matmul peak and of the memory's read bandwidth measured in the
same run, and each way against the panels by the median of the rounds' own ratios (this machine's
speed drifts over seconds). Every way's result is checked against the plain product first.

    python bench/few_rows.py [--rows 2,4,8,16,24,32,48,64] [--rounds 12] [--threads 1]   # bench/results/few_rows.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

import glassformer.attention.cpu_decode as cpu_decode  # noqa: E402
import glassformer.model as model  # noqa: E402
from glassformer.train.metrics import cpu_matmul_peak  # noqa: E402

from decode import bandwidth  # noqa: E402  (bench/ is the script's folder)
from matvec import step_matrices  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def held(w: torch.Tensor, panels: bool) -> tuple:
    """The (in, out) matrix w held as a batched step holds a Linear's weight (model.fresh_rows, then
    model.packed): as the kernel's panels, or (panels False) as oneDNN's packed weight."""
    before, cpu_decode.products = cpu_decode.products, panels
    try:
        h = model.packed(model.fresh_rows(None, (w.t(),), (None,)))
    finally:
        cpu_decode.products = before
    assert isinstance(h[4], cpu_decode.Panels) == panels
    return h


def ways(mats: list[torch.Tensor]) -> dict:
    """name -> a function of the inputs by width (in -> (rows, in)) running the step's products once,
    each through model.packed_product as a batched step runs it (the library's: a plain product)."""
    panels, onednn = [held(w, True) for w in mats], [held(w, False) for w in mats]
    return {
        "panels": lambda xs: [model.packed_product(h, xs[h[1].shape[0]]) for h in panels],
        "onednn": lambda xs: [model.packed_product(h, xs[h[1].shape[0]]) for h in onednn],
        "library": lambda xs: [xs[w.shape[0]] @ w for w in mats],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8,16,24,32,48,64")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "few_rows.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_decode.load():
        raise SystemExit("the kernel library could not be built here (a C++ compiler is needed)")
    torch.manual_seed(0)
    mats = step_matrices()
    run = ways(mats)
    assert all(model.PACK_MIN <= w.numel() for w in mats)  # every one packed, as in a step of this shape
    weight_bytes = sum(w.numel() * 4 for w in mats)
    peak, read = cpu_matmul_peak(seconds=1.0), bandwidth()["read"]
    result = {"machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
              "weight_bytes": weight_bytes, "matmul_peak_gflops": peak / 1e9, "read_gb_s": read / 1e9, "rows": {}}
    print(f"{len(mats)} products, {weight_bytes / 1e6:.1f} MB of weights; fp32 matmul peak {peak / 1e9:.1f} GFLOP/s, "
          f"memory read {read / 1e9:.1f} GB/s ({args.threads} thread(s))")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in {w.shape[0] for w in mats}}
        want = run["library"](xs)
        for name, f in run.items():  # each way's products agree with the plain product's
            for y, ref in zip(f(xs), want):
                torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)
        times: dict[str, list[float]] = {n: [] for n in run}
        names = list(run)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                run[name](xs)
                times[name].append(time.perf_counter() - t)
        flops = 2 * m * sum(w.numel() for w in mats)
        row = {}
        for name, ts in times.items():
            best = min(ts)
            row[name] = {"ms": best * 1e3, "gflops": flops / best / 1e9, "of_peak": flops / best / peak,
                         "of_read_bandwidth": weight_bytes / best / read,
                         "vs_panels": statistics.median(a / b for a, b in zip(ts, times["panels"]))}
        result["rows"][str(m)] = row
        print(f"{m:3d} rows: " + "   ".join(
            f"{n} {v['ms']:6.2f} ms ({v['gflops']:5.1f} GFLOP/s, {v['of_peak']:.0%} of peak, "
            f"{v['of_read_bandwidth']:.0%} of read; {v['vs_panels']:.2f}x the panels)" for n, v in row.items()), flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
