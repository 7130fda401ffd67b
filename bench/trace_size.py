"""Trace files of a 100M-weight model over 64 tokens: size and time for each set of options.

One process, one model (12 blocks of width 768, FFN 3072, 12 heads, vocabulary 16384:
110M weights, random), one 64-token text. For each option set: the numbers stored, the
file size, bytes per number, and the time to trace and to write JSON, each as a ratio to
one plain forward pass (run alternately with the trace, best of --repeats, so both see the
same machine load), and the JSON writer's throughput in numbers per second.

    python bench/trace_size.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

import glassformer  # noqa: E402
from glassformer.model import rope_inv_freq  # noqa: E402
from glassformer.tracing.trace import trace  # noqa: E402

OPTIONS = {
    "everything (7 digits)": dict(),
    "everything, --digits 4": dict(digits=4),
    "--top-k 20": dict(top_k=20),
    "--layers 0,6,11 --top-k 20": dict(layers=[0, 6, 11], top_k=20),
    "--layers 0,6,11 --heads 0-3 --top-k 20 --digits 6": dict(layers=[0, 6, 11], heads=[0, 1, 2, 3], top_k=20, digits=6),
    "--layers 11 --heads 0 --top-k 10 --digits 4": dict(layers=[11], heads=[0], top_k=10, digits=4),
    "--layers 0,6,11 --top-k 20 --with-weights": dict(layers=[0, 6, 11], top_k=20, with_weights=True),
    "--layers 11 --heads 0 --top-k 10 --digits 4 --with-weights": dict(layers=[11], heads=[0], top_k=10, digits=4,
                                                                        with_weights=True),
}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def paired(fn, peer, repeats: int) -> tuple[float, float]:
    """Best times of fn and of its peer, run alternately so that both see the same machine load."""
    a, b = [], []
    for _ in range(repeats):
        b.append(best(peer, 1))
        a.append(best(fn, 1))
    return min(a), min(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trace_size.json"))
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = glassformer.ModelConfig(vocab_size=16384, dim=768, n_layers=12, n_heads=12, ffn_dim=3072,
                                  max_seq_len=max(64, args.tokens), ffn="gelu", attention="naive")
    with torch.device("meta"):
        model = glassformer.Transformer(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.rope_inv_freq.copy_(rope_inv_freq(cfg))
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,)).tolist()
    x = torch.tensor([ids])

    def forward():
        with torch.no_grad():
            model(x)

    t_fwd = best(forward, args.repeats)
    rows = []
    print(f"model: {model.num_params() / 1e6:.1f}M weights, {args.tokens} tokens; one forward {t_fwd * 1e3:.0f} ms "
          f"(torch threads: {torch.get_num_threads()})")
    print(f"{'options':60s} {'numbers':>10s} {'MB':>8s} {'B/num':>6s} {'trace/fwd':>9s} {'json/fwd':>8s} {'Mnum/s':>7s}")
    for name, opt in OPTIONS.items():
        opt = dict(opt)
        digits = opt.pop("digits", 7)
        holder = {}
        t_trace, t_fwd = paired(lambda: holder.update(t=trace(model, ids, **opt)), forward, args.repeats)
        tr = holder["t"]
        t_json = best(lambda: holder.update(s=tr.to_json(digits=digits)), 1)
        size = len(holder["s"].encode())
        n = sum(p.data.numel() for p in tr.probes.values()) + sum(p.data.numel() for p in tr.weights.values())
        row = {"options": name, "numbers": n, "bytes": size, "bytes_per_number": size / n,
               "trace_seconds": t_trace, "forward_seconds": t_fwd, "json_seconds": t_json, "trace_over_forward": t_trace / t_fwd,
               "json_over_forward": t_json / t_fwd, "numbers_per_second_json": n / t_json, "under_50_mb": size < 50e6}
        rows.append(row)
        print(f"{name:60s} {n:10,d} {size / 1e6:8.1f} {size / n:6.1f} {t_trace / t_fwd:9.2f} {t_json / t_fwd:8.1f} "
              f"{n / t_json / 1e6:7.2f}")
    out = {"model_weights": model.num_params(), "tokens": args.tokens, "forward_seconds": t_fwd,
           "torch_threads": torch.get_num_threads(), "rows": rows}
    write_json(args.out, out, indent=2)


if __name__ == "__main__":
    main()
