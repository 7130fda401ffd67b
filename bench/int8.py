"""int8 weights against fp32 on a trained reference-shape model, in one run (docs/quantize.md).

1. Quality: the reference shape (15.7M weights, untied head) is trained for --budget seconds on
   the embedded corpus (`glassformer prepare --vocab-size 8192`, then `glassformer train
   --time-budget`), and `glassformer eval` scores the first --eval-bytes of a held-out work with
   fp32 and with `--quantize int8`: the bpb change (the issue's goal: at most 1%).
2. Speed: batch-1 greedy decoding of that model, fp32 and int8, each eager and with the decode
   step compiled, rounds alternating among the four and the best round counting (as in
   bench/decode.py): tokens/s, int8's speedup (compiled over compiled is the issue's goal: at
   least 2x), and the fraction of the memory-bandwidth roofline (bytes read per token over the
   highest read bandwidth probed in the run, a sum over a 512 MB tensor between the rounds).
3. Agreement: int8's eager and compiled tokens, int8's tokens against fp32's, the logits' change.

    python bench/int8.py [--budget 600] [--eval-bytes 200000] [--new-tokens 128] [--rounds 3]
    python bench/int8.py --quick            # 300 s of training at 8 x 64 tokens a step, 50 KB scored, 32 tokens
    python bench/int8.py --work DIR         # DIR keeps the data and the run: a second run reuses them
    python bench/int8.py --random-weights   # no training, no bpb: random weights (std 0.05)
    python bench/int8.py --products         # only: one product by way (int8 kernel, cast, fp32) and rows
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import add_decode_arguments, write_json  # noqa: E402  (bench/ is the script's folder)
from decode import bandwidth, timed  # noqa: E402

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.checkpoint.loading import load  # noqa: E402
from glassformer.cli import main as glassformer  # noqa: E402
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


# The reference shape as `train --model` takes it (the small preset ties its head; this one does not).
TRAIN_MODEL = ",".join(f"{k}={v}" for k, v in REFERENCE_SHAPE.items() if k != "vocab_size") + ",tie_embeddings=false"


def cli(*argv: str) -> str:
    """Run `glassformer ARGV` in this process; its standard output (the CLI's own exit checked)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = glassformer(list(argv))
    if code:
        raise SystemExit(f"`glassformer {' '.join(argv)}` failed with status {code}")
    return out.getvalue()


def held_out_text(n_bytes: int) -> tuple[str, str]:
    """(its name, the first n_bytes (whole characters)) of the embedded corpus's first held-out work."""
    from glassformer.text.corpus import default_corpus, read_text

    val = default_corpus().val[0]
    return val.name, read_text(val).encode("utf-8")[:n_bytes].decode("utf-8", errors="ignore")


def train(args, work: Path) -> dict:
    """Prepare the embedded corpus and train the reference shape for --budget s into WORK/run; a
    WORK that already holds a trained run is reused (WORK/train.json says how it was trained)."""
    done = work / "train.json"
    if (work / "run" / "latest").is_file() and done.is_file():
        return json.loads(done.read_text())
    t = time.perf_counter()
    cli("prepare", "--out", str(work / "data"), "--vocab-size", str(REFERENCE_SHAPE["vocab_size"]))
    prepare_s = time.perf_counter() - t
    run = work / "run"
    # Few calibration steps: a step of this shape takes seconds on a busy 2-core machine, and the
    # budget's step count is fixed only once they are done.
    flags = ["--model", TRAIN_MODEL, "--seq-len", str(args.train_seq), "--batch-size", str(args.train_batch),
             "--time-budget", f"{args.budget:g}", "--warmup-steps", "10", "--calibrate-steps", "3"]
    cli("train", "--data", str(work / "data"), "--out", str(run), *flags, "--eval-every", "0", "--eval-tokens", "2048",
        "--device", "cpu", "--threads", str(args.threads), "--no-progress")
    state = json.loads((run / (run / "latest").read_text().strip() / "train_state.json").read_text())
    info = {"budget_s": args.budget, "steps": state["step"], "tokens": state["step"] * args.train_batch * args.train_seq,
            "command": "glassformer train " + " ".join(flags), "prepare_s": prepare_s}
    done.write_text(json.dumps(info))
    return info


def score(args, work: Path, trained: dict) -> dict:
    """Held-out bpb of the trained run with fp32 and with int8 weights, through `glassformer eval`
    (kept in WORK/quality.json: a second run on the same WORK and --eval-bytes reuses it)."""
    kept = work / "quality.json"
    if kept.is_file() and json.loads(kept.read_text())["eval_bytes"] == args.eval_bytes:
        return json.loads(kept.read_text())
    name, text = held_out_text(args.eval_bytes)
    (work / "val.txt").write_text(text, encoding="utf-8")
    argv = ["eval", "--checkpoint", str(work / "run"), "--data", str(work / "val.txt"), "--threads", str(args.threads)]
    fp32 = json.loads(cli(*argv).strip().splitlines()[-1])
    int8 = json.loads(cli(*argv, "--quantize", "int8").strip().splitlines()[-1])
    quality = {"train": trained, "eval_bytes": args.eval_bytes,
               "held_out": {"text": f"the first bytes of {name} (held out)", "bytes": fp32["bytes"],
                            "tokens": fp32["tokens"]},
               "bpb": {"fp32": fp32["bpb"], "int8": int8["bpb"]},
               "bpb_relative_change": (int8["bpb"] - fp32["bpb"]) / fp32["bpb"]}
    kept.write_text(json.dumps(quality))
    return quality


def random_model() -> Transformer:
    torch.manual_seed(0)
    fp32 = Transformer(ModelConfig(**REFERENCE_SHAPE)).eval()
    with torch.no_grad():  # larger weights than the init, so argmax margins are not all near-ties
        for p in fp32.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    return fp32


def decode(models: dict, prompt: list[int], args) -> dict:
    """Tokens/s of each model eager (and compiled), rounds alternating; the tokens each made."""
    N, max_len = args.new_tokens, models["fp32"].config.max_seq_len
    sessions = {k: Session(m, max_len=max_len) for k, m in models.items()}
    if args.compile:
        sessions.update({k + "_compiled": Session(m, max_len=max_len, compile=True) for k, m in models.items()})

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
    return {"tokens_per_s": {k: N / min(v) for k, v in times.items()}, "rounds_s": times, "tokens": tokens,
            "read_bandwidth": max(p["read"] for p in probes)}


def agreement(models: dict, prompt: list[int], tokens: dict) -> dict:
    N = len(tokens["fp32"])
    ids = torch.tensor([prompt + tokens["fp32"]])
    with torch.no_grad():
        ref, got = models["fp32"](ids)[0], models["int8"](ids)[0]
    return {"int8_eager_equals_compiled": tokens.get("int8_compiled", tokens["int8"]) == tokens["int8"],
            "fp32_eager_equals_compiled": tokens.get("fp32_compiled", tokens["fp32"]) == tokens["fp32"],
            "int8_tokens_equal_to_fp32": sum(a == b for a, b in zip(tokens["int8"], tokens["fp32"])) / N,
            "logits_relative_change": ((got - ref).norm() / ref.norm()).item(),
            "argmax_agreement_on_fp32_text": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_arguments(ap, "also both with the decode step compiled (torch.compile), in the same rounds")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds of training (train --time-budget)")
    ap.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    ap.add_argument("--train-seq", type=int, default=256, help="tokens per training sequence")
    ap.add_argument("--eval-bytes", type=int, default=200_000, help="held-out bytes that eval scores")
    ap.add_argument("--random-weights", action="store_true", help="skip training and bpb: random weights (std 0.05)")
    ap.add_argument("--work", default=None, help="folder for the data and the run (default: a temporary one)")
    ap.add_argument("--products", action="store_true",
                    help="only: one product's time by way (int8 kernel, int8 cast, fp32) and rows")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/int8.json, "
                    "or int8_products.json with --products)")
    args = ap.parse_args()
    if args.quick:
        args.new_tokens, args.rounds, args.budget, args.eval_bytes = 32, 3, 300.0, 50_000
        args.train_batch, args.train_seq = 8, 64
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.products:
        return products(args.out or RESULTS / "int8_products.json")
    quality = None
    if args.random_weights:
        fp32 = random_model()
        prompt = torch.randint(0, fp32.config.vocab_size, (args.prompt_tokens,)).tolist()
    else:
        work = Path(args.work or tempfile.mkdtemp(prefix="gf-int8-"))
        work.mkdir(parents=True, exist_ok=True)
        quality = score(args, work, train(args, work))
        fp32, tok = load(work / "run")
        prompt = tok.encode((work / "val.txt").read_text(encoding="utf-8"))[:args.prompt_tokens]
        torch.set_num_threads(args.threads)  # eval picks its own
    models = {"fp32": fp32.float().eval(), "int8": quantize_int8(copy.deepcopy(fp32).float().eval())}
    dec = decode(models, prompt, args)
    report(args, models, prompt, dec, quality)


def report(args, models, prompt, dec, quality) -> None:
    cfg, N, tok_s, read = models["fp32"].config, args.new_tokens, dec["tokens_per_s"], dec["read_bandwidth"]
    bpt = {k: bytes_per_token(m, cfg, args.prompt_tokens + N / 2) for k, m in models.items()}
    roof = {k: read / b for k, b in bpt.items()}
    speedup = {"eager": tok_s["int8"] / tok_s["fp32"]}
    if args.compile:  # int8 compiled over fp32 compiled: the goal (>= 2x)
        speedup.update(compiled=tok_s["int8_compiled"] / tok_s["fp32_compiled"],
                       int8_eager_over_fp32_compiled=tok_s["int8"] / tok_s["fp32_compiled"])
    res = {
        "shape": {**REFERENCE_SHAPE, "weights": models["fp32"].num_params(), "tie_embeddings": cfg.tie_embeddings},
        "weights": "random (std 0.05)" if quality is None else "trained",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": args.threads,
                    "cores": os.cpu_count(), "torch": torch.__version__, "load_average": os.getloadavg()},
        "quality": quality,
        "decode": {"new_tokens": N, "prompt_tokens": len(prompt), "tokens_per_s": tok_s, "rounds_s": dec["rounds_s"],
                   "speedup": speedup},
        "roofline": {"read_bandwidth_GBps": read / 1e9, "bytes_per_token": bpt,
                     "fraction": {k: v / roof[k.split("_")[0]] for k, v in tok_s.items()}},
        "agreement": agreement(models, prompt, dec["tokens"]),
    }
    write_json(args.out or RESULTS / "int8.json", res, indent=2)
    if quality is not None:
        q = quality
        print(f"trained {q['train']['steps']} steps in {q['train']['budget_s']:g} s; held-out bpb over {q['held_out']['bytes']:,} "
              f"bytes: fp32 {q['bpb']['fp32']:.4f}, int8 {q['bpb']['int8']:.4f} ({q['bpb_relative_change']:+.3%})")
    print(f"reference shape, batch 1, greedy, {args.threads} threads, {N} new tokens, read bandwidth {read / 1e9:.1f} GB/s")
    for k, v in tok_s.items():
        m = k.split("_")[0]
        print(f"  {k:16} {v:8.1f} tokens/s   {v / roof[m]:6.1%} of roofline ({bpt[m] / 1e6:.1f} MB/token)")
    print("  speedup: " + ", ".join(f"{k} {v:.2f}x" for k, v in speedup.items()))
    print("  agreement: " + ", ".join(f"{k} {v if isinstance(v, bool) else round(v, 4)}" for k, v in res["agreement"].items()))


if __name__ == "__main__":
    main()
