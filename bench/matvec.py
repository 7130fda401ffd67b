"""The matrix-vector products of one decode step, alone: how fast each way of doing them streams weights.

A batch-1 decode step on the reference shape is 43 products of one row by a weight matrix
(per layer: Q, K, V, O, gate, up, down, each its own nn.Linear; then the LM head), 50.3 MB of
fp32 weights in all. This times the 43 in a row, over and over, for each way a module could read
its weight (`--joined`: 25 products, Q/K/V and gate/up side by side as one matrix each, the layout
the model ran before it made them three and two products, and the layout of bench/results/matvec.json):

  linear        F.linear(x, W) with nn.Linear's (out, in) weight (what every eager projection runs,
                speed installed or not: a session's eager decode step)
  x @ W         the (in, out) matrix, one product (runs on one thread whatever the thread count)
  blocks P      the (in, out) matrix seen as P column blocks (a strided view), one batched product
  copied P      the same blocks copied to their own memory
  rows P        the matrix cut along its inputs into P row blocks (contiguous), one batched
                product, then the P partial outputs summed: an experiment the library does not
                run. glassformer.speed used to hold such copies (P = threads) for eager one-row
                products; end to end they decoded at 0.83x the plain model's speed at 2 threads on
                torch 2.13 (equal at 1), so they were removed and eager steps run `linear`

and other kernels torch offers for the job: `torch.mv` on either layout, oneDNN's linear
(plain, and with its weights reordered to oneDNN's own layout), MKL's packed sgemm, and the
product written as a multiply-and-sum that torch.compile turns into a loop, over the (in, out)
matrix's columns or over the (out, in) weight's rows: the row sums are what speed's RowsLinear
runs when a compiled session's step traces it on the CPU; and, for scale, a plain sum over a
512 MB tensor (what the memory gives one reader). The oneDNN and MKL rows call private torch ops
(torch.ops.mkldnn._linear_pointwise, _reorder_linear_weight, torch.ops.mkl._mkl_linear): they are
here as reference points only; the library uses none of them.

    python bench/matvec.py [--threads 1 2] [--blocks 2 4 8] [--no-compiled] [--joined]   # bench/results/matvec.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402

from decode import bandwidth  # noqa: E402  (bench/ is the script's folder)


def step_matrices(joined: bool = False) -> list[torch.Tensor]:
    """The (in, out) matrices one decode step multiplies by, in order (the layout `x @ W` and the
    row blocks read; `linear` reads their (out, in) transposes): one per projection, or with `joined`
    Q/K/V and gate/up each one matrix side by side."""
    c = ModelConfig(**REFERENCE_SHAPE)
    if joined:
        per_layer = [(c.dim, c.q_dim + 2 * c.kv_dim), (c.q_dim, c.dim), (c.dim, 2 * c.ffn_dim), (c.ffn_dim, c.dim)]
    else:  # wq, wk, wv, wo, w_gate, w_up, w_down
        per_layer = [(c.dim, c.q_dim), (c.dim, c.kv_dim), (c.dim, c.kv_dim), (c.q_dim, c.dim),
                     (c.dim, c.ffn_dim), (c.dim, c.ffn_dim), (c.ffn_dim, c.dim)]
    shapes = per_layer * c.n_layers + [(c.dim, c.vocab_size)]
    return [torch.randn(i, o) for i, o in shapes]


def other_kernels(mats, out_in, xs, compiled: bool) -> dict:
    """One-row products by other kernels: name -> a function running all of them once."""
    vecs = {n: x[0] for n, x in xs.items()}  # (in,) each
    ways = {"mv, (in, out) read as its transpose": lambda: [torch.mv(w.t(), vecs[w.shape[0]]) for w in mats],
            "mv, (out, in)": lambda: [torch.mv(w, vecs[w.shape[1]]) for w in out_in]}
    if torch.backends.mkldnn.is_available():
        lp = torch.ops.mkldnn._linear_pointwise
        ways["oneDNN linear"] = lambda: [lp(xs[w.shape[1]], w, None, "none", [], "") for w in out_in]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in out_in]
        ways["oneDNN linear, weights reordered"] = lambda: [
            lp(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(out_in, packed)]
    if torch.backends.mkl.is_available():
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in out_in]
        ways["MKL packed sgemm"] = lambda: [
            torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, 1) for w, p in zip(out_in, mkl)]
    if compiled:  # compiled afresh for each thread count (inductor splits its loops for the count it sees)
        torch._dynamo.reset()
        cols = torch.compile(lambda ws: [(xs[w.shape[0]][0, :, None] * w).sum(0, keepdim=True) for w in ws])
        rowsum = torch.compile(lambda ws: [(w * xs[w.shape[1]]).sum(-1) for w in ws])
        cols(mats), rowsum(out_in)  # compile
        ways["compiled multiply-and-sum, (in, out) columns"] = lambda: cols(mats)
        ways["compiled row sums, (out, in) (a compiled session)"] = lambda: rowsum(out_in)
    return ways


def timed(fn, reps: int = 50, warmup: int = 5) -> float:
    """Median seconds of fn() over reps calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                    help="also the torch.compile'd multiply-and-sum loops (compiling takes ~20 s)")
    ap.add_argument("--joined", action="store_true",
                    help="Q/K/V and gate/up as one matrix each (25 products) instead of the model's own (43)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "matvec.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    mats = step_matrices(args.joined)  # (in, out) each
    n_bytes = sum(w.numel() for w in mats) * 4
    xs = {w.shape[0]: torch.randn(1, w.shape[0]) for w in mats}
    res = {"bytes": n_bytes, "matrices": len(mats), "joined": args.joined, "runs": {}}
    for th in args.threads:
        torch.set_num_threads(th)
        out_in = [w.t().contiguous() for w in mats]
        ways = {"linear": lambda: [F.linear(xs[w.shape[1]], w) for w in out_in],
                "x @ W": lambda: [xs[w.shape[0]] @ w for w in mats]}
        ways.update(other_kernels(mats, out_in, xs, args.compiled))
        for P in args.blocks:
            rows = [w.view(P, w.shape[0] // P, w.shape[1]) for w in mats]  # (P, in/P, out), contiguous
            ways[f"rows {P}"] = lambda rows=rows, P=P: [torch.bmm(xs[w.shape[1] * P].view(P, 1, -1), w).sum(0) for w in rows]
            views = [w.view(w.shape[0], P, -1).transpose(0, 1) for w in mats]  # (P, in, out/P)
            copies = [v.contiguous() for v in views]
            for name, ws in ((f"blocks {P}", views), (f"copied {P}", copies)):
                ways[name] = lambda ws=ws: [torch.bmm(xs[w.shape[1]].expand(w.shape[0], 1, -1), w) for w in ws]
        row = {name: n_bytes / timed(fn) / 1e9 for name, fn in ways.items()}
        row["sum of a 512 MB tensor"] = bandwidth()["read"] / 1e9
        res["runs"][str(th)] = row
        print(f"{th} thread(s), {len(mats)} products, {n_bytes / 1e6:.1f} MB of weights; GB/s:")
        for name, gbs in row.items():
            print(f"  {name:52}{gbs:8.1f}")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
