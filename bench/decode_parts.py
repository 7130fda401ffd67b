"""What each piece of the fast decode step buys: variants of it timed side by side in one process.

Batch-1 greedy decoding on the reference shape (fp32, CPU), rounds alternating between the
variants of each comparison, so a change in the machine's speed hits every variant alike;
median and best tokens/s of each over the rounds. Every variant runs the model's own forward
(`Transformer.forward`); they differ in how a module reads its weights or how the step compiles:

  eager      Session(model), glassformer.speed installed: eagerly every product is F.linear and
             every norm the RMSNorm formula, the plain model's steps (speed changes compiled steps
             only), so one eager row, the baseline the compiled step is set against. Installed,
             Session(speed=False) and speed.remove used to race here while eager one-row products
             read row-block copies of the weights (0.83x the plain model at 2 threads on torch 2.13,
             equal at 1) and the norms ran F.rms_norm (1.00x); both were removed, and the three
             now run the same code
  compiled   the compiled step as a session builds it (compile_step with the CPU options:
             one-row products as speed's RowsLinear row sums over its (out, in) weight, inductor's
             realize_reads_threshold 1, TorchDynamo's guards on the model and cache left out by
             _step_guards) against the same step with inductor's default
             realize_reads_threshold, with inductor's C++ wrapper (cpp_wrapper), and with every
             guard TorchDynamo makes
  hook check what the session checks itself before every compiled step instead of those guards
             (compiled.step_key: the modules and their classes, their hooks, the kernels, dtype,
             device, threads, compared with the key of the step before): microseconds a step
             (timeit over many calls) and the fraction of one compiled step that is

Column blocks (each matrix as one block of columns per thread) were an experiment of the packed
forward that generation used to run; with one forward they have no place to go, and are gone.

    flock /tmp/glassformer-bench.lock python bench/decode_parts.py [--rounds 8] [--threads 2]
    python bench/decode_parts.py --quick                  # a check that it runs: 2 rounds of 16 tokens
    python bench/decode_parts.py --pair "C++ wrapper" [--second-first] --out /tmp/pair.json
    python bench/decode_parts.py --pair "C++ wrapper" --context 1900     # the timed steps over a long cache
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.generation.compiled import CPU_STEP_OPTIONS, compile_step, step_key  # noqa: E402
from glassformer.generation.session import Session  # noqa: E402

SHIPPED = "as shipped"
COMPILED_VARIANTS = (SHIPPED, "inductor's default realize_reads_threshold", "C++ wrapper", "every guard")
EAGER = "eager (the plain products)"


def rate(session: Session, n: int, context: int = 16) -> float:
    """Tokens/s of n greedy steps after a fresh prompt of `context` tokens and one untimed step (a
    warm-up: the first decode step after the prefill)."""
    session.reset()
    list(session.send([t % 8192 for t in range(context)], max_new_tokens=1, greedy=True))
    list(session.send(None, max_new_tokens=1, greedy=True))
    t = time.perf_counter()
    list(session.send(None, max_new_tokens=n, greedy=True))
    return n / (time.perf_counter() - t)


def race(variants: dict, rounds: int, n: int) -> dict:
    """name -> {median, best, rounds} tokens/s, the variants alternating round by round."""
    out = {k: [] for k in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            out[name].append(run(n))
    return {k: {"median": statistics.median(v), "best": max(v), "rounds": v} for k, v in out.items()}


def eager_run(model, S: int, context: int):
    """A run(n) for race(): eager steps of a Session(model) (speed installed, the plain products)."""
    s = Session(model, max_len=S)
    return lambda n: rate(s, n, context)


def compiled_variant(model, S: int, context: int, options: dict):
    """A compiled session whose step is compiled with `options` (on first use), warmed up; -> its
    session and a run(n) for race(). A session recompiles with the default options when its
    step_key changes, so report() checks that none of them did."""
    s = Session(model, max_len=S, compile=True)
    s._compiled = compile_step(s.device, options)
    rate(s, 2, context)
    return s, lambda n: rate(s, n, context)


def build_compiled(name: str, model, S: int, context: int):
    """(session, run) of one of COMPILED_VARIANTS."""
    options = {
        SHIPPED: CPU_STEP_OPTIONS,
        "inductor's default realize_reads_threshold":
            {k: v for k, v in CPU_STEP_OPTIONS.items() if k != "realize_reads_threshold"},
        "C++ wrapper": {**CPU_STEP_OPTIONS, "cpp_wrapper": True},
        "every guard": {k: v for k, v in CPU_STEP_OPTIONS.items() if k != "guard_filter_fn"},
    }[name]
    return compiled_variant(model, S, context, options)


def hook_check(model, step_seconds: float, calls: int) -> dict:
    """Microseconds of the check a compiled session makes before each step (step_key(model), compared
    with the key it kept: Session._model), the best of 5 timeit repeats of `calls` calls each, and
    its fraction of one compiled step."""
    kept = step_key(model)
    check = min(timeit.repeat(lambda: step_key(model) == kept, number=calls, repeat=5)) / calls * 1e6
    return {"calls": calls, "modules": sum(1 for _ in model.modules()), "check_us": check,
            "compiled_step_us": step_seconds * 1e6, "fraction_of_compiled_step": check / (step_seconds * 1e6)}


def report(res: dict, args) -> None:
    print(f"reference shape, fp32, {args.threads} threads, batch 1, greedy, {args.context}-token prompt; "
          f"tokens/s over {args.rounds} alternating rounds")
    for name, r in res["compiled"].items():  # each against the step as shipped
        print(f"  {'compiled':9} {name:44} median {r['median']:6.1f}  best {r['best']:6.1f}  "
              f"{res['compiled'][SHIPPED]['median'] / r['median']:5.2f}x")
    if "eager" in res:  # a race of its own, before the compiled one: the compiled step as shipped against it
        r = res["eager"][EAGER]
        print(f"  {'eager':9} {EAGER:44} median {r['median']:6.1f}  best {r['best']:6.1f}  "
              f"{res['compiled'][SHIPPED]['median'] / r['median']:5.2f}x (compiled as shipped / eager)")
    h = res["hook_check"]
    print(f"  hook check (step_key, {h['modules']} modules): {h['check_us']:.1f} us a step, "
          f"{100 * h['fraction_of_compiled_step']:.2f}% of a compiled step ({h['compiled_step_us']:.0f} us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=16,
                    help="prompt tokens before the timed steps (e.g. 1900: steps that read a long cache)")
    ap.add_argument("--pair", default=None, choices=COMPILED_VARIANTS[1:],
                    help="race only the compiled step as shipped against this one variant "
                    "(a process of its own for each comparison: the variants of one process can sway each other)")
    ap.add_argument("--second-first", action="store_true", help="with --pair: compile and run the variant first")
    ap.add_argument("--hook-calls", type=int, default=2000, help="step_key calls per timeit repeat")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 16 tokens: a check that it runs, not a measurement")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_parts.json"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.hook_calls = 2, 16, 200
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).eval()
    S = args.context + args.tokens + 32
    if S > REFERENCE_SHAPE["max_seq_len"]:
        raise SystemExit(f"--context + --tokens + 32 must fit the model's context ({REFERENCE_SHAPE['max_seq_len']})")

    res = {"threads": args.threads, "tokens": args.tokens, "context": args.context}
    if not args.pair:
        res["eager"] = race({EAGER: eager_run(model, S, args.context)}, args.rounds, args.tokens)
    names = list(COMPILED_VARIANTS) if not args.pair else [SHIPPED, args.pair][:: -1 if args.second_first else 1]
    built = {k: build_compiled(k, model, S, args.context) for k in names}
    res["compiled"] = race({k: run for k, (_, run) in built.items()}, args.rounds, args.tokens)
    res["recompiles"] = {k: s.recompiles for k, (s, _) in built.items()}
    if any(res["recompiles"].values()):  # a session that recompiled ran the default options, not its variant's
        raise SystemExit(f"a compiled variant recompiled mid-race: {res['recompiles']}")
    res["hook_check"] = hook_check(model, 1 / res["compiled"][SHIPPED]["median"], args.hook_calls)
    report(res, args)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
