"""Pieces of one training layer on the reference shape, forward + backward, each timed alone.

The choices behind the training step (docs/benchmarks.md, "Training tokens/s"): the fused
attention kernel against two matrix-product forms, Q/K/V and gate/up as the model's own three
and two products (Attention's wq, wk, wv; FeedForward's w_gate, w_up) against one product over
their weights joined (a measurement of what joining would buy, its concatenation paid each
call; the model does not join them), RMSNorm as written against torch's F.rms_norm (a
measurement: the model runs the formula; glassformer.speed no longer swaps it in, as at 1.00x
it bought decoding nothing), RoPE as model.apply_rope against the roll-and-multiply-add form.
Batch 8 × 256 tokens, fp32, median of 10 runs each.

    python bench/train_parts.py [--threads 2]          # bench/results/train_parts.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.model import RMSNorm, apply_rope  # noqa: E402

from matvec import timed  # noqa: E402  (bench/ is the script's folder)


def ms(fn, n: int = 10) -> float:
    """Median milliseconds of fn() over n calls, after two untimed ones."""
    return 1e3 * timed(fn, reps=n, warmup=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_parts.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = ModelConfig(**REFERENCE_SHAPE)
    B, T, N, K, H, D, Fd = 8, 256, c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.ffn_dim
    G = N // K
    q = torch.randn(B, N, T, H, requires_grad=True)
    k = torch.randn(B, K, T, H, requires_grad=True)
    v = torch.randn(B, K, T, H, requires_grad=True)
    g = torch.randn(B, N, T, H)
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def naive():  # keys repeated per query head, full T×T scores, masked
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = (q @ kr.transpose(-1, -2)) * H ** -0.5
        (torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ vr).backward(g)

    def grouped():  # each KV head's group of queries in one product
        s = (q.reshape(B, K, G * T, H) @ k.transpose(-1, -2)) * H ** -0.5  # (B, K, G·T, T)
        s = s.view(B, K, G, T, T).masked_fill(~causal, float("-inf"))
        (torch.softmax(s, -1).view(B, K, G * T, T) @ v).view(B, N, T, H).backward(g)

    x = torch.randn(B * T, D, requires_grad=True)
    wq, wk, wv = (torch.randn(o, D, requires_grad=True) for o in (c.q_dim, c.kv_dim, c.kv_dim))
    gq, gk = torch.randn(B * T, c.q_dim), torch.randn(B * T, c.kv_dim)
    wg, wu = (torch.randn(Fd, D, requires_grad=True) for _ in range(2))
    gf = torch.randn(B * T, Fd)
    xn = torch.randn(B, T, D, requires_grad=True)
    gn = torch.randn(B, T, D)
    norm = RMSNorm(D, c.norm_eps)
    qk = torch.randn(B, T, N + K, H, requires_grad=True)
    gqk = torch.randn(B, T, N + K, H)
    angles = torch.arange(T).float()[:, None] * (c.rope_theta ** (-torch.arange(0, H, 2).float() / H))
    cos, sin = angles.cos()[None], angles.sin()[None]  # (1, T, H/2)
    cos2, sin2 = torch.cat([cos, cos], -1)[:, :, None], torch.cat([-sin, sin], -1)[:, :, None]  # (1, T, 1, H)

    parts = {
        "attention: fused sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g),
        "attention: naive products": naive,
        "attention: grouped products": grouped,
        "Q, K, V: three products": lambda: torch.autograd.backward(
            [F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)], [gq, gk, gk]),
        "Q, K, V: one product": lambda: F.linear(x, torch.cat([wq, wk, wv])).backward(torch.cat([gq, gk, gk], 1)),
        "gate, up: two products": lambda: torch.autograd.backward([F.linear(x, wg), F.linear(x, wu)], [gf, gf]),
        "gate, up: one product": lambda: F.linear(x, torch.cat([wg, wu])).backward(torch.cat([gf, gf], 1)),
        "RMSNorm: model's": lambda: norm(xn).backward(gn),
        "RMSNorm: F.rms_norm": lambda: F.rms_norm(xn, (D,), norm.weight, c.norm_eps).backward(gn),
        "RoPE: apply_rope": lambda: apply_rope(qk, cos, sin).backward(gqk),
        "RoPE: roll + multiply-add": lambda: torch.addcmul(qk * cos2, qk.roll(H // 2, -1), sin2).backward(gqk),
    }
    res = {"threads": args.threads, "batch": B, "seq": T, "ms_forward_backward": {}}
    print(f"one layer's pieces, forward + backward, B {B} × T {T}, fp32, {args.threads} thread(s); ms:")
    for name, fn in parts.items():
        res["ms_forward_backward"][name] = t = ms(fn)
        print(f"  {name:30}{t:8.2f}")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
