"""The continuous-batching engine in-process (no server): aggregate tokens/s, time to first token and gap
between tokens at 1, 4 and 16 concurrent requests on the reference shape (or the demo model's: --shape demo),
against in-process `generate` of one prompt, and where a step's time goes (the batched forward alone, at the
same rows and positions).
`--fused-mask` also runs the engine and the forward with the step's attention through the fused kernel and a
boolean mask instead of two batched products (attention/sdpa.py MASKED_DECODE), in the same rounds;
`--length-step 64` with a batched step's cache read rounded up to a multiple of 64 slots instead of
batching.EAGER_LENGTH_STEP. (A batched step's products are torch's own F.linear whatever runs beside
them: glassformer.speed changes only one-row products, so there is no product variant to race here.)

Every round runs each contender once, in another order each round (a busy machine slows all alike); the best round
counts. Requests are submitted together and the engine is stepped in this thread; an event's time is
when the step that made it returned. The engine's tokens for request j equal `generate` of prompt j
(checked each round, greedy and seeded). bench/serve.py measures the same through the HTTP server.

    python bench/batching.py [--shape reference|demo] [--streams 1,4,16] [--rounds 3] [--threads 2] [--new-tokens 128]
        [--prompt-tokens 64] [--temperature 0] [--compile] [--fused-mask] [--length-step N] [--quick]

Each variant is also reported against eager by the median of the rounds' own ratios (each round's pair
taken next to each other: this machine's speed drifts over seconds), its tokens/s and its forward alone's time.
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

import glassformer.attention.sdpa as sdpa_module  # noqa: E402
import glassformer.generation.batching as batching_module  # noqa: E402
from glassformer import ModelConfig, Transformer, generate  # noqa: E402
from glassformer.config import PRESETS, REFERENCE_SHAPE  # noqa: E402
from glassformer.generation.batching import Engine, Request, slots_to_read  # noqa: E402
from glassformer.kv_cache import KVCache  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# The eager engine's switches run beside it (each its own flag): what each swaps in, as printed
VARIANTS = {"fused_mask": "fused kernel with a mask", "length_step": "read rounded to {} slots"}
SHAPES = {"reference": REFERENCE_SHAPE, "demo": PRESETS["small"]}  # as bench/serve.py's


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_engine(engine: Engine, prompts, n: int, kw: dict) -> dict:
    """All requests at once; (wall, per-request first-token times and gaps, tokens)."""
    t0 = time.perf_counter()
    tickets = [engine.submit(Request(p, n, seed=j, **kw)) for j, p in enumerate(prompts)]
    stamps: list[list[float]] = [[] for _ in tickets]
    tokens: list[list[int]] = [[] for _ in tickets]
    while engine.step():
        now = time.perf_counter() - t0
        for j, t in enumerate(tickets):
            while (e := t._pop()) is not None:
                if e.token is not None:
                    stamps[j].append(now)
                    tokens[j].append(e.token)
    wall = time.perf_counter() - t0
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    ttft = [s[0] for s in stamps]
    total = sum(map(len, tokens))
    return {"streams": len(prompts), "tokens": total, "wall_s": wall, "tokens_per_s": total / wall,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "gap_p50_s": pct(gaps, 0.5), "gap_p99_s": pct(gaps, 0.99), "_tokens": tokens}


@torch.inference_mode()
def forward_only(model, rows: int, context: int, steps: int) -> float:
    """Seconds per batched decode forward of `rows` rows at per-row positions near `context` (no sampling),
    reading the slots an engine step reads there (up to the furthest row's, rounded up)."""
    cache = KVCache.for_model(model, rows).view(0, rows, slots_to_read(context + rows, model.config.max_seq_len, False, False))
    pos = torch.arange(rows) + context if rows > 1 else context  # one row: an int position, as the engine steps it
    tok = torch.zeros(rows, 1, dtype=torch.long)
    model(tok, cache=cache, pos=pos)
    t = time.perf_counter()
    for _ in range(steps):
        model(tok, cache=cache, pos=pos)
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="reference",
                    help="the model's shape (demo: the small preset; its context caps the prompt at a quarter of it)")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling with top-k 50")
    ap.add_argument("--compile", action="store_true", help="also the engine with compile=True (slow to compile on a CPU)")
    ap.add_argument("--fused-mask", action="store_true",
                    help="also eager with a step's attention through the fused kernel and a boolean mask, side by side")
    ap.add_argument("--length-step", type=int, default=None,
                    help="also eager with a batched step's cache read rounded up to a multiple of this many slots")
    ap.add_argument("--quick", action="store_true", help="32 new tokens, one round")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 32, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    cfg = ModelConfig(**shape)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so greedy argmaxes are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    counts = [int(s) for s in args.streams.split(",")]
    P = min(args.prompt_tokens, cfg.max_seq_len // 4)
    N = min(args.new_tokens, cfg.max_seq_len - P)
    prompts = [torch.randint(0, cfg.vocab_size, (P,)).tolist() for _ in range(max(counts))]
    kw = {"temperature": args.temperature} if args.temperature == 0 else {"temperature": args.temperature, "top_k": 50}
    gkw = {"greedy": True} if args.temperature == 0 else kw
    refs = [list(generate(model, p, max_new_tokens=N, seed=j, **gkw)) for j, p in enumerate(prompts)]
    variants = [m for m in VARIANTS if getattr(args, m) not in (None, False)]  # switches of the eager engine
    modes = ["eager"] + variants + (["compiled"] * args.compile)

    engines = {m: Engine(model, max_batch=max(counts), compile=m == "compiled") for m in modes}
    if args.compile:  # compile every bucket before timing (one warm-up run per count)
        for c in counts:
            run_engine(engines["compiled"], prompts[:c], 4, kw)
    best: dict = {}
    default_step, masked_decode = batching_module.EAGER_LENGTH_STEP, sdpa_module.MASKED_DECODE
    per_round: dict[str, list[float]] = {}  # "mode/count" -> each round's tokens/s
    fsteps: dict[str, dict[int, float]] = {m: {} for m in ["eager"] + variants}  # mode -> rows -> s a forward
    fround: dict[str, list[float]] = {}  # "mode/rows" -> each round's s a forward

    def use(m: str) -> None:  # the switches of mode m (eager, compiled: all at their defaults)
        sdpa_module.MASKED_DECODE = masked_decode and m != "fused_mask"
        batching_module.EAGER_LENGTH_STEP = args.length_step if m == "length_step" else default_step

    for r in range(args.rounds):
        t = time.perf_counter()
        list(generate(model, prompts[0], max_new_tokens=N, seed=0, **gkw))
        gen = N / (time.perf_counter() - t)
        best["generate_tokens_per_s"] = max(best.get("generate_tokens_per_s", 0), gen)
        for m in modes[r % len(modes):] + modes[:r % len(modes)]:  # another order each round: none always runs first
            for c in counts:
                use(m)
                res = run_engine(engines[m], prompts[:c], N, kw)
                use("eager")
                assert res.pop("_tokens") == refs[:c], "the engine's tokens differ from generate's"
                key = f"{m}/{c}"
                per_round.setdefault(key, []).append(res["tokens_per_s"])
                if key not in best or res["tokens_per_s"] > best[key]["tokens_per_s"]:
                    best[key] = res
        for c in counts:  # the batched forward alone, in the same round (its best too), each variant's too
            for m, mine in fsteps.items():
                use(m)
                s = forward_only(model, c, P + N // 2, 8 if args.quick else 20)
                use("eager")
                mine[c] = min(mine.get(c, s), s)
                fround.setdefault(f"{m}/{c}", []).append(s)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['tokens_per_s']:.1f}" for k, v in best.items() if k != "generate_tokens_per_s"),
              f"generate {best['generate_tokens_per_s']:.1f} tokens/s", flush=True)
    steps = fsteps["eager"]
    labels = {m: v.format(args.length_step) for m, v in VARIANTS.items()}
    result = {
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "shape": shape, "prompt_tokens": P, "new_tokens": N, "rounds": args.rounds,
        "temperature": args.temperature, "quick": args.quick,
        "kv_bytes_per_row": engines["eager"].stats["kv_bytes_per_row"],
        "generate_tokens_per_s": best.pop("generate_tokens_per_s"),
        "runs": best,
        "forward_only_s_per_step": {str(c): s for c, s in steps.items()},
        **{f"forward_only_{m}_s_per_step": {str(c): s for c, s in fsteps.get(m, {}).items()} for m in labels},
        "masked_decode": masked_decode, "eager_length_step": default_step, "length_step": args.length_step,
        "paired_vs_eager": {k: statistics.median(a / b for a, b in zip(v, per_round["eager/" + k.split("/")[1]]))
                            for k, v in per_round.items() if not k.startswith(("eager/", "compiled/"))},
        # the forward alone likewise: a variant's time over eager's in the same round (above 1: slower)
        "forward_paired_vs_eager": {k: statistics.median(a / b for a, b in zip(v, fround["eager/" + k.split("/")[1]]))
                                    for k, v in fround.items() if not k.startswith("eager/")},
    }
    one = best.get("eager/1")
    for k, v in best.items():
        v["vs_one_stream"] = v["tokens_per_s"] / one["tokens_per_s"] if one else None
        v["vs_generate"] = v["tokens_per_s"] / result["generate_tokens_per_s"]
        c = v["streams"]
        v["decode_forwards_share"] = steps[c] * (N - 1) / v["wall_s"] if k.startswith("eager/") else None  # of the wall time
    for k, v in best.items():
        print(f"{k:>12}: {v['tokens_per_s']:7.1f} tokens/s ({v['vs_one_stream']:.2f}x one stream, "
              f"{v['vs_generate']:.2f}x generate), ttft p50 {v['ttft_p50_s'] * 1e3:.1f} ms p99 "
              f"{v['ttft_p99_s'] * 1e3:.1f} ms, gap p50 {v['gap_p50_s'] * 1e3:.1f} ms p99 {v['gap_p99_s'] * 1e3:.1f} ms")
    for m in variants:
        print(f"forward alone, {labels[m]}, ms a step:", {c: round(s * 1e3, 2) for c, s in fsteps[m].items()})
    for k, v in result["paired_vs_eager"].items():
        print(f"{k} against eager, median of the rounds' own ratios: {v:.3f}x")
    for k, v in result["forward_paired_vs_eager"].items():
        print(f"forward alone, {k} over eager's time, median of the rounds' own ratios: {v:.3f}")
    print("forward alone, ms a step:", {c: round(s * 1e3, 2) for c, s in steps.items()},
          f"generate {result['generate_tokens_per_s']:.1f} tokens/s; KV per row {result['kv_bytes_per_row'] / 2**20:.1f} MiB")
    write_json(args.out or RESULTS / "batching.json", result)


if __name__ == "__main__":
    main()
