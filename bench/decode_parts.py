"""What each piece of the fast decode step buys: variants of it timed side by side in one process.

Batch-1 greedy decoding on the reference shape (fp32, CPU), rounds alternating between the
variants of each comparison, so a change in the machine's speed hits every variant alike;
median and best tokens/s of each over the rounds:

  layout     eager steps with each matrix cut into one block of rows per thread (packed.py)
             against one block of columns per thread (P, in, out/P), the layout before it
  compiled   the compiled step (Session(compile=True)) as a session builds it (one-row
             products as generated row sums over (out, in) weights, inductor's
             realize_reads_threshold 1, without the guards on the model, packed weights and
             cache that the session holds fixed) against the same step over the eager path's
             (in, out) row blocks (library products), with inductor's default
             realize_reads_threshold, with inductor's C++ wrapper (cpp_wrapper), with
             every guard TorchDynamo makes, and with the attention as the library products
             (two batched products per KV head and a softmax) in place of the C++ kernel of
             attention/cpu_decode.py

    flock /tmp/glassformer-bench.lock python bench/decode_parts.py [--rounds 8] [--threads 2]
    python bench/decode_parts.py --pair "C++ wrapper" [--second-first] --out /tmp/pair.json
    python bench/decode_parts.py --pair "C++ wrapper" --context 1900     # the timed steps over a long cache
    python bench/decode_parts.py --pair "the attention as library products" --context 1900
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer, packed  # noqa: E402
from glassformer.attention import cpu_decode  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.generation.session import Session  # noqa: E402
from glassformer.generation.compiled import CPU_STEP_OPTIONS, _compile_step  # noqa: E402


ROWS = (packed._t, packed._lin)  # what packed.py does: row blocks


def column_blocks(w: torch.Tensor, P: int, layout: str = "rows"):
    """packed._t with blocks of columns: (in, out) and its view (P, in, out/P)."""
    w = w.detach().t().contiguous()  # (in, out)
    n_in, n_out = w.shape
    if P == 1 or n_out % P:
        return w, None, False
    return w, w.view(n_in, P, n_out // P).transpose(0, 1), False  # (P, in, out/P)


def column_lin(x, w, b, add=None):
    """packed._lin for column blocks: the blocks' outputs end to end are the output row."""
    io, blocks, _ = w
    x2 = x.reshape(-1, io.shape[0])  # (M, in)
    if blocks is None or x2.shape[0] != 1:
        return ROWS[1](x, w, b, add)
    P = blocks.shape[0]
    y = torch.bmm(x2.expand(P, 1, io.shape[0]), blocks).view(1, io.shape[1])  # (P, 1, out/P) end to end
    y = y if b is None else y + b
    y = y.view(*x.shape[:-1], io.shape[1])
    return y if add is None else add + y


def rate(session: Session, n: int, context: int = 16) -> float:
    """Tokens/s of n greedy steps after a fresh prompt of `context` tokens."""
    session.reset()
    list(session.send([t % 8192 for t in range(context)], max_new_tokens=1, greedy=True))
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=16,
                    help="prompt tokens before the timed steps (e.g. 1900: steps that read a long cache)")
    ap.add_argument("--pair", default=None, help="race only the compiled step as shipped against this one variant "
                    "(a process of its own for each comparison: the variants of one process can sway each other)")
    ap.add_argument("--second-first", action="store_true", help="with --pair: compile and run the variant first")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_parts.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).eval()
    S = args.context + args.tokens + 32
    if S > REFERENCE_SHAPE["max_seq_len"]:
        raise SystemExit(f"--context + --tokens + 32 must fit the model's context ({REFERENCE_SHAPE['max_seq_len']})")

    eager = Session(model, max_len=S)

    def layout(t_lin):
        def run(n):
            packed._t, packed._lin = t_lin
            packed._PACKS.clear()  # repack in this layout
            return rate(eager, n, args.context)
        return run

    res = {"threads": args.threads, "tokens": args.tokens, "context": args.context}
    if not args.pair:
        res["layout"] = race({"row blocks": layout(ROWS), "column blocks": layout((column_blocks, column_lin))},
                             args.rounds, args.tokens)
        packed._t, packed._lin = ROWS
        packed._PACKS.clear()

    def compiled(options: dict, layout: str = "out_in"):
        s = Session(model, max_len=S, compile=True, layout=layout)  # the packed weights this variant's step reads
        s._compiled = _compile_step(s.device, options)  # this variant's step, compiled on first use
        rate(s, 2, args.context)
        return lambda n: rate(s, n, args.context)

    def library_attention():
        """The step with its attention traced as the library products: the switch is read when the
        step is traced, and guarded, so it must also be off whenever this variant runs."""
        def off(fn, *a):
            cpu_decode.enabled = False
            try:
                return fn(*a)
            finally:
                cpu_decode.enabled = True
        run = off(compiled, CPU_STEP_OPTIONS)
        return lambda n: off(run, n)

    default_reads = {k: v for k, v in CPU_STEP_OPTIONS.items() if k != "realize_reads_threshold"}

    builds = {
        "as shipped": lambda: compiled(CPU_STEP_OPTIONS),
        "the same over (in, out) row blocks": lambda: compiled(CPU_STEP_OPTIONS, "rows"),
        "inductor's default realize_reads_threshold": lambda: compiled(default_reads),
        "C++ wrapper": lambda: compiled({**CPU_STEP_OPTIONS, "cpp_wrapper": True}),
        "every guard": lambda: compiled({k: v for k, v in CPU_STEP_OPTIONS.items() if k != "guard_filter_fn"}),
        "the attention as library products": library_attention,
    }
    names = list(builds) if not args.pair else ["as shipped", args.pair][:: -1 if args.second_first else 1]
    res["compiled"] = race({k: builds[k]() for k in names}, args.rounds, args.tokens)

    print(f"reference shape, fp32, {args.threads} threads, batch 1, greedy, {args.context}-token prompt; "
          f"tokens/s over {args.rounds} alternating rounds")
    for part in [p for p in ("layout", "compiled") if p in res]:
        first = res[part]["row blocks" if part == "layout" else "as shipped"]["median"]
        for name, r in res[part].items():
            print(f"  {part:9} {name:44} median {r['median']:6.1f}  best {r['best']:6.1f}  {first / r['median']:5.2f}x")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
