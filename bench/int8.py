"""Batch-1 greedy decoding on the reference shape with int8 weights against fp32, eager and with
the decode step compiled, in one run (docs/quantize.md).

Reports tokens/s of each, int8's speedup over fp32 (eager over eager, compiled over compiled, and
int8 compiled over fp32 compiled: the issue's goal), the fraction of the memory-bandwidth roofline
(bytes read per token / the read bandwidth measured here, the highest reading), whether int8's
eager and compiled tokens agree and how many of fp32's tokens int8 keeps, and the logits' change.
Rounds alternate between the contenders and the best round counts, as in bench/decode.py. The
weights are random (std 0.05), so the bpb change on a trained model is not measured here.

    python bench/int8.py [--new-tokens 128] [--rounds 3] [--threads 2] [--no-compile] [--quick]
    python bench/int8.py --products     # only: one product by way (int8 kernel, cast, fp32) and rows
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import add_decode_arguments, write_json  # noqa: E402  (bench/ is the script's folder)
from decode import bandwidth, timed  # noqa: E402

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.convert.quantize import Int8Linear, quantize_int8  # noqa: E402
from glassformer.generation.session import Session  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def bytes_per_token(model, cfg, mean_ctx: float) -> int:
    """What one decode step reads: every projection's weight (int8: a byte each plus a scale per
    row), one embedding row, the norms, and the cache up to its position (fp32)."""
    n = cfg.dim * 4  # one embedding row
    for m in model.modules():
        if isinstance(m, Int8Linear):
            n += m.weight.numel() + m.weight_scale.numel() * 4
        elif isinstance(m, torch.nn.Linear):
            n += m.weight.numel() * m.weight.element_size()
        elif not list(m.children()) and not isinstance(m, torch.nn.Embedding):
            n += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return int(n + 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4 * mean_ctx)


def products(out, rows=(1, 2, 4, 16, 64), n: int = 200) -> None:
    """Microseconds of one FFN-shaped product (1024, 384) by way and rows: torch's int8 kernel, a
    cast copy of q then a library product, and fp32 (what quantize.KERNEL_MAX_ROWS rests on)."""
    import torch.nn.functional as F

    O, In = REFERENCE_SHAPE["ffn_dim"], REFERENCE_SHAPE["dim"]
    q = torch.randint(-127, 128, (O, In), dtype=torch.int8)
    s, w = torch.rand(O), torch.randn(O, In)
    ways = {"int8_kernel": lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s),
            "int8_cast": lambda x: F.linear(x, q.to(x.dtype)) * s, "fp32": lambda x: F.linear(x, w)}
    res = {}
    with torch.no_grad():
        for r in rows:
            x = torch.randn(r, In)
            for k, f in ways.items():
                best = float("inf")
                for _ in range(3):  # best of 3 batches of n
                    for _ in range(10):
                        f(x)
                    t = time.perf_counter()
                    for _ in range(n):
                        f(x)
                    best = min(best, (time.perf_counter() - t) / n)
                res.setdefault(str(r), {})[k] = best * 1e6
            print(f"  rows {r:3}: " + ", ".join(f"{k} {v:.0f} us" for k, v in res[str(r)].items()))
    write_json(out, {"shape": [O, In], "threads": torch.get_num_threads(), "us": res}, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(ap, "also both with the decode step compiled (torch.compile), in the same rounds")
    ap.add_argument("--products", action="store_true",
                    help="only: one product's time by way (int8 kernel, int8 cast, fp32) and rows")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/int8.json, "
                    "or int8_products.json with --products)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    torch.set_num_threads(args.threads)
    if args.products:
        return products(args.out or RESULTS / "int8_products.json")
    torch.manual_seed(0)
    cfg = ModelConfig(**REFERENCE_SHAPE)
    fp32 = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so argmax margins are not all near-ties
        for p in fp32.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    int8 = quantize_int8(copy.deepcopy(fp32))
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,)).tolist()
    N = args.new_tokens
    models = {"fp32": fp32, "int8": int8}
    sessions = {k: Session(m, max_len=cfg.max_seq_len) for k, m in models.items()}
    if args.compile:
        sessions.update({k + "_compiled": Session(m, max_len=cfg.max_seq_len, compile=True) for k, m in models.items()})

    def run(s: Session):
        s.reset()
        return list(s.send(prompt, max_new_tokens=N, greedy=True))

    for s in sessions.values():  # warm up every contender (and compile)
        run(s)
    times, tokens, probes = {k: [] for k in sessions}, {}, []
    for _ in range(args.rounds):  # alternate, so a change in machine speed hits every contender
        probes.append(bandwidth())
        for k, s in sessions.items():
            dt, tokens[k] = timed(lambda: run(s))
            times[k].append(dt)
    probes.append(bandwidth())
    read = max(p["read"] for p in probes)
    tok_s = {k: N / min(v) for k, v in times.items()}
    mean_ctx = args.prompt_tokens + N / 2
    bpt = {k: bytes_per_token(m, cfg, mean_ctx) for k, m in models.items()}
    roof = {k: read / b for k, b in bpt.items()}
    ids = torch.tensor([prompt + tokens["fp32"]])
    with torch.no_grad():
        ref, got = fp32(ids)[0], int8(ids)[0]
    speedup = {"eager": tok_s["int8"] / tok_s["fp32"]}
    if args.compile:  # int8 compiled over fp32 compiled: the goal (>= 2x)
        speedup.update(compiled=tok_s["int8_compiled"] / tok_s["fp32_compiled"],
                       int8_eager_over_fp32_compiled=tok_s["int8"] / tok_s["fp32_compiled"])
    res = {
        "shape": {**REFERENCE_SHAPE, "weights": fp32.num_params()},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": args.threads,
                    "cores": os.cpu_count(), "torch": torch.__version__},
        "decode": {"new_tokens": N, "prompt_tokens": args.prompt_tokens, "tokens_per_s": tok_s, "rounds_s": times,
                   "speedup": speedup},
        "roofline": {"read_bandwidth_GBps": read / 1e9, "bytes_per_token": bpt,
                     "fraction": {k: v / roof[k.split("_")[0]] for k, v in tok_s.items()}},
        "agreement": {"int8_eager_equals_compiled": tokens.get("int8_compiled", tokens["int8"]) == tokens["int8"],
                      "fp32_eager_equals_compiled": tokens.get("fp32_compiled", tokens["fp32"]) == tokens["fp32"],
                      "int8_tokens_equal_to_fp32": sum(a == b for a, b in zip(tokens["int8"], tokens["fp32"])) / N,
                      "logits_relative_change": ((got - ref).norm() / ref.norm()).item(),
                      "argmax_agreement_on_fp32_text": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()},
    }
    write_json(args.out or RESULTS / "int8.json", res, indent=2)
    print(f"reference shape, batch 1, greedy, {args.threads} threads, {N} new tokens, read bandwidth {read / 1e9:.1f} GB/s")
    for k, v in tok_s.items():
        m = k.split("_")[0]
        print(f"  {k:16} {v:8.1f} tokens/s   {v / roof[m]:6.1%} of roofline ({bpt[m] / 1e6:.1f} MB/token)")
    print("  speedup: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items()))
    print("  agreement: " + ", ".join(f"{k} {v if isinstance(v, bool) else round(v, 4)}" for k, v in res["agreement"].items()))


if __name__ == "__main__":
    main()
