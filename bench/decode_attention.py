"""One decode step's attention alone: how fast each way of writing it reads the cached keys and values.

At one query per row, attention reads every cached key and value of every layer once (the
reference shape: 6 layers, 2 KV heads of 64 features, 3 query heads per KV head; 12 MB at
2000 positions). This times the six layers' attention at 128 and at 2000 cached positions,
the caches evicted from the CPU's caches before every call (as the 50 MB of weights of a
real step evict them), and reports the marginal rate: the extra bytes over the extra time.
A step whose attention streams slower than its weight products grows with the context
(the 1.3x goal of bench/decode.py). The forms, each eager and torch.compile'd:

  products     two batched products per KV head, its group of queries at once (what the
               sdpa kernel does at one query on the CPU: attention/sdpa.py)
  fused        torch's fused scaled_dot_product_attention (GQA)
  sums         scores and outputs as multiply-and-sums (one generated loop each when compiled)
  sums, V^T    the same with the values stored transposed (each output a row sum over the
               positions)
  K @ q        the scores as keys times queries (positions as rows), outputs as V^T @ p
  chunks       the outputs' product split into 2 chunks of positions per head (more batches)
  C++ kernel   attention/cpu_decode.py, what a compiled session's step calls (one pass over
               the keys and one over the values per KV head, each row read once for the group)

--halves also times each half alone, compiled: the scores from the keys (a batched product,
or multiply-and-sums with the query heads outer or inner) and the outputs from the values
(a batched product, multiply-and-sums over V or over V^T), to show which half holds it back.

    flock /tmp/glassformer-bench.lock python bench/decode_attention.py [--threads 1 2] [--halves]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig  # noqa: E402
from glassformer.attention import cpu_decode  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402

CFG = ModelConfig(**REFERENCE_SHAPE)
L, K, H = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim
G = CFG.n_heads // K  # query heads per KV head
SCALE = H ** -0.5


def products(q, ks, vs, T):
    return [torch.bmm(torch.softmax(torch.bmm(q, k[:, :T].transpose(1, 2)) * SCALE, -1), v[:, :T])  # (K, G, H)
            for k, v in zip(ks, vs)]


def fused(q, ks, vs, T):
    return [F.scaled_dot_product_attention(q.reshape(1, K * G, 1, H), k[None, :, :T], v[None, :, :T], enable_gqa=True)
            for k, v in zip(ks, vs)]


def sums(q, ks, vs, T):
    out = []
    for k, v in zip(ks, vs):
        p = torch.softmax((q[:, :, None, :] * k[:, None, :T]).sum(-1) * SCALE, -1)  # (K, G, T)
        out.append((p[..., None] * v[:, None, :T]).sum(2))  # (K, G, H)
    return out


def sums_vt(q, ks, vts, T):
    out = []
    for k, vt in zip(ks, vts):
        p = torch.softmax(torch.bmm(q, k[:, :T].transpose(1, 2)) * SCALE, -1)  # (K, G, T)
        out.append((vt[:, :, None, :T] * p[:, None]).sum(-1).transpose(1, 2))  # (K, H, G) -> (K, G, H)
    return out


def k_at_q(q, ks, vs, T):
    out = []
    for k, v in zip(ks, vs):
        p = torch.softmax(torch.bmm(k[:, :T], q.transpose(1, 2)) * SCALE, 1)  # (K, T, G)
        out.append(torch.bmm(v[:, :T].transpose(1, 2), p).transpose(1, 2))  # (K, H, G) -> (K, G, H)
    return out


def chunks(q, ks, vs, T, C: int = 2):
    out = []
    for k, v in zip(ks, vs):
        p = torch.softmax(torch.bmm(q, k[:, :T].transpose(1, 2)) * SCALE, -1)  # (K, G, T)
        n = (T + C - 1) // C
        pp = F.pad(p, (0, n * C - T)).view(K, G, C, n).transpose(1, 2).reshape(K * C, G, n)
        out.append(torch.bmm(pp, v[:, :n * C].reshape(K * C, n, H)).view(K, C, G, H).sum(1))
    return out


def kernel(q, ks, vs, T):
    return [cpu_decode.attention(q.reshape(1, K * G, 1, H), k[None, :, :T], v[None, :, :T], SCALE).view(K, G, H)
            for k, v in zip(ks, vs)]


# --halves: each half of the attention alone, compiled: the scores (keys) or the outputs (values),
# probabilities given; a form name, its function of (q or p, the layer tensors, T), and whether
# it reads the values transposed.
HALVES = {
    "scores, batched product": (lambda q, ks, T: [torch.bmm(q, k[:, :T].transpose(1, 2)) for k in ks], False),
    "scores, sums (G, T) order": (lambda q, ks, T: [(q[:, :, None] * k[:, None, :T]).sum(-1) for k in ks], False),
    "scores, sums (T, G) order": (lambda q, ks, T: [(q[:, None] * k[:, :T, None]).sum(-1) for k in ks], False),
    "outputs, batched product": (lambda p, vs, T: [torch.bmm(p[:, :, :T], v[:, :T]) for v in vs], False),
    "outputs, sums over V": (lambda p, vs, T: [(p[:, :, :T, None] * v[:, None, :T]).sum(2) for v in vs], False),
    "outputs, sums over V^T": (lambda p, vts, T: [(p[:, :, None, :T] * vt[:, None, :, :T]).sum(-1) for vt in vts], True),
}

FORMS = {"products": (products, False), "fused": (fused, False), "sums": (sums, False),
         "sums, V^T": (sums_vt, True), "K @ q": (k_at_q, False), "chunks": (chunks, False)}
if cpu_decode.load():
    FORMS["C++ kernel"] = (kernel, False)


def timed_cold(fn, flush: torch.Tensor, reps: int = 60) -> float:
    """Median seconds of fn(), the CPU's caches flushed (a 64 MB sum) before each call."""
    ts = []
    for i in range(reps + 5):
        flush.sum()
        t = time.perf_counter()
        fn()
        if i >= 5:
            ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def halves(q, ks, vs, vts, flush, long: int) -> dict:
    """Marginal GB/s of each half of the attention alone (compiled), over the half of the bytes it reads."""
    p = torch.softmax(torch.randn(K, G, CFG.max_seq_len), -1)  # probabilities over every position
    half = L * K * (long - 128) * H * 4
    row = {}
    for name, (fn, transposed) in HALVES.items():
        first = q if name.startswith("scores") else p
        tensors = vts if transposed else (ks if name.startswith("scores") else vs)
        f = torch.compile(fn, dynamic=True)
        f(first, tensors, 777)
        short = timed_cold(lambda: f(first, tensors, 128), flush)
        long_ = timed_cold(lambda: f(first, tensors, long), flush)
        row[name] = {"ms_128": short * 1e3, f"ms_{long}": long_ * 1e3, "marginal_GBps": half / (long_ - short) / 1e9}
    return row


def show(rows: dict, long: int, width: int) -> None:
    """One line a form: ms at 128 and at `long` positions, marginal GB/s."""
    for name, r in rows.items():
        print(f"  {name:{width}}{r['ms_128']:8.3f} ms {r[f'ms_{long}']:8.3f} ms  {r['marginal_GBps']:6.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--halves", action="store_true",
                    help="also time each half (scores from keys, outputs from values) alone, compiled")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_attention.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    S = CFG.max_seq_len
    ks = [torch.randn(K, S, H) for _ in range(L)]
    vs = [torch.randn(K, S, H) for _ in range(L)]
    vts = [v.transpose(1, 2).contiguous() for v in vs]  # (K, H, S)
    q = torch.randn(K, G, H)
    flush = torch.randn(16 * 2**20)
    extra = L * 2 * K * (args.long - 128) * H * 4  # bytes the long context adds
    ref = products(q, ks, vs, 777)
    res = {"layers": L, "kv_heads": K, "group": G, "head_dim": H, "long": args.long, "runs": {}}
    for th in args.threads:
        torch.set_num_threads(th)
        torch._dynamo.reset()  # compile afresh for this thread count
        row = {}
        for name, (fn, transposed) in FORMS.items():
            vals = vts if transposed else vs
            for mode in ("eager", "compiled"):
                f = torch.compile(fn, dynamic=True) if mode == "compiled" else fn
                got = f(q, ks, vals, 777)
                err = max((a - b.reshape(a.shape)).abs().max().item() for a, b in zip(ref, got))
                assert err < 1e-4, f"{name} ({mode}) differs from the products by {err}"
                short = timed_cold(lambda: f(q, ks, vals, 128), flush)
                long = timed_cold(lambda: f(q, ks, vals, args.long), flush)
                row[f"{name}, {mode}"] = {"ms_128": short * 1e3, f"ms_{args.long}": long * 1e3,
                                          "marginal_GBps": extra / (long - short) / 1e9}
        res["runs"][str(th)] = row
        print(f"{th} thread(s): six layers' attention at one query, caches cold; "
              f"{extra / 1e6:.1f} MB more at {args.long} positions than at 128")
        show(row, args.long, 22)
        if args.halves:
            res.setdefault("halves", {})[str(th)] = got = halves(q, ks, vs, vts, flush, args.long)
            print(f"  each half alone, compiled ({extra / 2e6:.1f} MB more):")
            show(got, args.long, 28)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
