"""Batch-1 greedy decoding on the reference shape: glassformer's KV-cache generate against
Hugging Face LlamaForCausalLM.generate (with its cache) on the same weights, in one run.

Reports tokens/s of both and their ratio (tokens must be identical), the fraction of the
memory-bandwidth roofline (bytes of weights + cache read per token / bandwidth measured
here by streaming a large tensor, before every round and after the last, the highest reading), prefill tokens/s, and decode latency at context 128 vs
2048 (the best of 7 medians each). Rounds alternate between the implementations and the best round counts, so a
busy machine penalises all alike. glassformer runs eager and with its decode step compiled
(--no-compile: eager only).

    python bench/decode.py [--new-tokens 128] [--rounds 3] [--threads 2] [--no-compile] [--profile] [--quick]
    python bench/decode.py --profile-contexts     # only: a compiled step at context 128 vs 2000, kernel by kernel
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import add_decode_arguments, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer, generate  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.convert import to_transformers  # noqa: E402
from glassformer.generation.session import Session, prefill  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def bandwidth(n_bytes: int = 512 * 2**20, rounds: int = 5) -> dict:
    """Memory bandwidth in bytes/s: reading a big tensor (a sum) and copying it (read + write)."""
    a = torch.ones(n_bytes // 4)
    b = torch.empty_like(a)
    read, copy = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        a.sum()
        read.append(n_bytes / (time.perf_counter() - t))
        t = time.perf_counter()
        b.copy_(a)
        copy.append(2 * n_bytes / (time.perf_counter() - t))
    return {"read": max(read), "copy": max(copy)}


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(ap, "also glassformer with its decode step compiled (torch.compile), in the same rounds")
    ap.add_argument("--latency-rounds", type=int, default=7,
                    help="rounds of the decode latency at context 128 vs 2000 (the best median of each is kept: "
                         "on a shared machine a single slow spell otherwise decides the growth)")
    ap.add_argument("--profile", action="store_true", help="also print where a decode step's time goes (torch profiler)")
    ap.add_argument("--profile-contexts", action="store_true",
                    help="only: where a compiled step's time goes at context 128 and 2000, kernel by kernel")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/decode.json, "
                    "or decode_profile_contexts.json with --profile-contexts)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds, args.latency_rounds = 32, 1, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**REFERENCE_SHAPE)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the init, so argmax margins are not all near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    if args.profile_contexts:
        return profile_contexts(model, cfg, args.out or RESULTS / "decode_profile_contexts.json")
    hf = to_transformers(model, attn_implementation="sdpa").eval()  # the same weights, via our export
    n_weights = model.num_params()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens))
    N = args.new_tokens

    def ours():
        return list(generate(model, prompt[0], max_new_tokens=N, greedy=True))

    compiled = Session(model, max_len=cfg.max_seq_len, compile=True) if args.compile else None  # reads filled slots only

    def ours_compiled():  # one compiled session, started afresh each round (its step compiles once)
        compiled.reset()
        return list(compiled.send(prompt[0].tolist(), max_new_tokens=N, greedy=True))

    def theirs():
        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N, min_new_tokens=N,
                              do_sample=False, pad_token_id=0)
        return out[0, prompt.shape[1]:].tolist()

    runs = {"ours": ours, "hf": theirs, **({"ours_compiled": ours_compiled} if args.compile else {})}
    for fn in runs.values():  # warm up every contender (and compile)
        fn()
    times, tokens, probes = {k: [] for k in runs}, {}, []
    for _ in range(args.rounds):  # alternate, so a change in machine speed hits every contender
        probes.append(bandwidth())  # this machine's bandwidth swings between runs and within one
        for k, fn in runs.items():
            dt, tokens[k] = timed(fn)
            times[k].append(dt)
    probes.append(bandwidth())
    same = all(t == tokens["hf"] for t in tokens.values())
    t_ours, t_hf = times["ours"], times["hf"]
    bw = {k: max(p[k] for p in probes) for k in ("read", "copy")}  # the highest reading: the strictest roofline

    # Roofline: each decoded token reads every weight once, except the embedding table of which
    # it reads one row (the head is a matrix of its own here: untied), and the cache up to its position.
    bpn = next(model.parameters()).element_size()
    kv_per_pos = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bpn
    mean_ctx = args.prompt_tokens + N / 2
    weights_read = n_weights - model.embed.weight.numel() + cfg.dim
    bytes_per_token = weights_read * bpn + kv_per_pos * mean_ctx
    tok_s, hf_tok_s = N / min(t_ours), N / min(t_hf)
    comp_tok_s = N / min(times["ours_compiled"]) if args.compile else None
    roof = bw["read"] / bytes_per_token

    # Prefill as each generate runs it: one forward over a long prompt into the cache, the head
    # on the last position only (ours: generate.prefill; Hugging Face: logits_to_keep=1).
    prefill_rate = {}
    for T in (512, 2048) if not args.quick else (512,):
        ids = torch.randint(0, cfg.vocab_size, (1, T))
        best_o, best_h = float("inf"), float("inf")
        s = Session(model, max_len=T)

        def ours_prefill():
            nonlocal best_o
            with torch.inference_mode():
                dt, _ = timed(lambda: prefill(model, ids, s.cache, 0))  # what a session's prefill runs
            best_o = min(best_o, dt)

        def hf_prefill():
            nonlocal best_h
            with torch.inference_mode():
                dt, _ = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1))
            best_h = min(best_h, dt)

        # Each round in the other order: whichever runs first after the other's frees pays the
        # page faults of its fresh blocks (glibc maps large blocks anew), a bias of ~5% at 2048.
        for r in range(2 * max(1, args.rounds - 1)):
            for fn in (ours_prefill, hf_prefill) if r % 2 == 0 else (hf_prefill, ours_prefill):
                fn()
        prefill_rate[T] = {"ours_tokens_per_s": T / best_o, "hf_tokens_per_s": T / best_h}

    # Decode latency against context length: median step time after prefilling `ctx` tokens.
    def step_latency(session: Session, ctx: int) -> float:
        session.reset()
        ids = torch.randint(0, cfg.vocab_size, (ctx,)).tolist()
        steps = []
        it = session.send(ids, max_new_tokens=48, greedy=True)
        next(it)  # the prefill
        t = time.perf_counter()
        for _ in it:
            now = time.perf_counter()
            steps.append(now - t)
            t = now
        return statistics.median(steps)

    sessions = {"eager": Session(model, max_len=cfg.max_seq_len)}
    if args.compile:
        sessions["compiled"] = compiled
    latency = {k: {} for k in sessions}
    for _ in range(args.latency_rounds):  # alternate the contexts; keep each one's best median
        for ctx in (128, cfg.max_seq_len - 48) if not args.quick else (128,):
            for k, session in sessions.items():
                latency[k][ctx] = min(latency[k].get(ctx, float("inf")), step_latency(session, ctx))
    growth = {k: v[max(v)] / v[128] if len(v) > 1 else None for k, v in latency.items()}

    res = {
        "shape": {**REFERENCE_SHAPE, "weights": n_weights, "dtype": "float32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": args.threads,
                    "cores": os.cpu_count(), "torch": torch.__version__},
        "decode": {"compile": args.compile, "new_tokens": N, "prompt_tokens": args.prompt_tokens, "ours_tokens_per_s": tok_s,
                   "hf_tokens_per_s": hf_tok_s, "speedup": tok_s / hf_tok_s, "identical_tokens": same,
                   "rounds_ours_s": t_ours, "rounds_hf_s": t_hf,
                   **({"ours_compiled_tokens_per_s": comp_tok_s, "speedup_compiled": comp_tok_s / hf_tok_s,
                       "rounds_ours_compiled_s": times["ours_compiled"]} if args.compile else {})},
        "roofline": {"read_bandwidth_GBps": bw["read"] / 1e9, "copy_bandwidth_GBps": bw["copy"] / 1e9,
                     "read_bandwidth_probes_GBps": [round(p["read"] / 1e9, 1) for p in probes],
                     "bytes_per_token": bytes_per_token, "roofline_tokens_per_s": roof,
                     "ours_fraction": tok_s / roof, "hf_fraction": hf_tok_s / roof,
                     **({"ours_compiled_fraction": comp_tok_s / roof} if args.compile else {})},
        "prefill": prefill_rate,
        "decode_latency_ms": {str(k): v * 1e3 for k, v in latency["eager"].items()},
        "latency_growth_long_vs_128": growth["eager"],
        "latency_rounds": args.latency_rounds,
        **({"decode_latency_ms_compiled": {str(k): v * 1e3 for k, v in latency["compiled"].items()},
            "latency_growth_long_vs_128_compiled": growth["compiled"]} if args.compile else {}),
    }
    out = args.out or RESULTS / "decode.json"
    write_json(out, res, indent=2)

    readings = ", ".join(f"{p['read'] / 1e9:.1f}" for p in probes)
    print(f"reference shape: {n_weights / 1e6:.1f}M weights, fp32, {args.threads} threads, batch 1, greedy")
    print(f"{'':32}{'glassformer':>14}{'HF generate':>14}{'ratio':>8}")
    print(f"{'decode tokens/s':32}{tok_s:14.1f}{hf_tok_s:14.1f}{tok_s / hf_tok_s:8.2f}x   identical tokens: {same}")
    print(f"{'fraction of roofline':32}{tok_s / roof:14.1%}{hf_tok_s / roof:14.1%}"
          f"   ({bytes_per_token / 1e6:.1f} MB/token, read bandwidth {bw['read'] / 1e9:.1f} GB/s "
          f"(highest of {readings}), "
          f"copy {bw['copy'] / 1e9:.1f} GB/s, roofline {roof:.0f} tokens/s)")
    if args.compile:
        print(f"{'decode tokens/s, compiled':32}{comp_tok_s:14.1f}{hf_tok_s:14.1f}{comp_tok_s / hf_tok_s:8.2f}x")
        print(f"{'fraction of roofline, compiled':32}{comp_tok_s / roof:14.1%}")
    for T, r in prefill_rate.items():
        print(f"{f'prefill {T} tokens, tokens/s':32}{r['ours_tokens_per_s']:14.0f}{r['hf_tokens_per_s']:14.0f}"
              f"{r['ours_tokens_per_s'] / r['hf_tokens_per_s']:8.2f}x")
    for k, lat in latency.items():
        for ctx, v in lat.items():
            print(f"{f'decode step ({k}) at context {ctx}, ms':32}{v * 1e3:14.2f}")
        if growth[k] is not None:
            print(f"{f'latency growth ({k}) {max(lat)} / 128':32}{growth[k]:14.2f}x")
    if args.profile:
        profile_steps(compiled or sessions["eager"], prompt[0].tolist(), "compiled" if compiled else "eager")


def profile_steps(s: Session, prompt: list[int], label: str, n: int = 20) -> None:
    """Microseconds per decode step by operation (self time), over n steps of a warm session."""
    from torch.profiler import profile

    s.reset()
    list(s.send(prompt, max_new_tokens=n, greedy=True))  # warm
    with profile() as prof:
        list(s.send(None, max_new_tokens=n, greedy=True))
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / n
    print(f"one {label} decode step, {total:.0f} us under the profiler; "
          "self time by operation:")
    for e in ops[:10]:
        print(f"  {e.self_cpu_time_total / n:8.0f} us  {e.count / n:5.1f} calls  {e.key[:70]}")


def profile_contexts(model, cfg, out, contexts=(128, 2000), n: int = 20) -> None:
    """Microseconds per compiled decode step at each context, by operation and by generated
    kernel (inductor's kernel profiling on): what a longer cache costs, and where. The
    attention's products grow with the cache; anything else that grows is paid for by the
    cache's bytes pushing the weights out of the CPU's caches."""
    from torch._inductor import config as inductor_config
    from torch.profiler import profile

    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel shows as its own event
    s = Session(model, max_len=cfg.max_seq_len, compile=True)
    per = {}
    for ctx in contexts:
        s.reset()
        list(s.send(torch.randint(0, cfg.vocab_size, (ctx,)).tolist(), max_new_tokens=8, greedy=True))  # warm
        with profile() as prof:
            list(s.send(None, max_new_tokens=n, greedy=True))
        per[ctx] = {e.key: e.self_cpu_time_total / n for e in prof.key_averages()}
    a, b = contexts
    grow = sorted(set(per[a]) | set(per[b]), key=lambda k: per[a].get(k, 0) - per[b].get(k, 0))
    print(f"one compiled decode step under the profiler: {sum(per[a].values()):.0f} us at context {a}, "
          f"{sum(per[b].values()):.0f} us at {b}; what grows most (us):")
    for k in grow[:8]:
        print(f"  {per[a].get(k, 0):8.0f} {per[b].get(k, 0):8.0f}  {k[:90]}")
    write_json(out, {"threads": torch.get_num_threads(), "steps": n,
                     "us_per_step": {str(c): sum(per[c].values()) for c in contexts},
                     "us_per_step_by_op": {k: {str(c): per[c].get(k, 0.0) for c in contexts} for k in grow}})


if __name__ == "__main__":
    main()
