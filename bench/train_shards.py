"""A short training run from shards made on this machine: tokens/s, MFU and the loader's share.

Writes made-up documents (a JSONL corpus of pseudo-words drawn with Zipf's law, so the tokenizer
has something to learn), prepares them with `glassformer prepare --shard-tokens N` into several
llm.c-format shards, then trains `--preset` on them with `glassformer train` in this process
(bf16 autocast and --compile on CUDA). `next_batch`, the loader's whole part of a step as the loop
sees it (the wait for the batch, whose windows are drawn from (seed, step) across shard ends and
read one step ahead: train/loader.py Prefetch), is timed by a wrapper around the loop's own call;
the loader's share is its time over the run's wall time from the end of `--warm-steps`
(compilation) to the last step. tokens/s and MFU are the run's own metrics.jsonl figures, their
median after the warm steps.

    python bench/train_shards.py --out OUTDIR                 # a CUDA GPU: gpt2-124m, 16 × 1024, 300 steps
    python bench/train_shards.py --out OUTDIR --smoke         # any machine: tiny shapes, CPU, checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)


def write_corpus(path: Path, mb: float, seed: int = 0) -> int:
    """A JSONL file of about `mb` MB: documents of 50 to 2,000 pseudo-words (30,000 distinct, drawn
    with Zipf's law) in sentences. Returns the documents written."""
    rng = np.random.default_rng(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]  # 90
    lengths = rng.integers(1, 5, 30_000)
    words = np.array(["".join(rng.choice(syllables, n)) for n in lengths])
    docs, size = 0, 0
    with path.open("w", encoding="utf-8") as f:
        while size < mb * 1e6:
            ids = np.minimum(rng.zipf(1.2, int(rng.integers(50, 2001))), len(words)) - 1
            text = " ".join(words[ids])
            text = ". ".join(s.capitalize() for s in text.split(" the ")) if " the " in text else text.capitalize()
            line = json.dumps({"text": text + "."}) + "\n"
            f.write(line)
            size += len(line)
            docs += 1
    return docs


def timed_loader(loop_module) -> list[float]:
    """Wrap the training loop's next_batch so every call's seconds land in the returned list."""
    seconds: list[float] = []
    real = loop_module.next_batch

    def next_batch(*args, **kwargs):
        t = time.perf_counter()
        out = real(*args, **kwargs)
        seconds.append(time.perf_counter() - t)
        return out

    loop_module.next_batch = next_batch
    return seconds


def run(args, work: Path) -> dict:
    import torch

    from glassformer.cli import main as cli
    from glassformer.train import loop
    from glassformer.train.metrics import read_metrics

    corpus, data, out = work / "corpus.jsonl", work / "data", work / "run"
    t = time.perf_counter()
    docs = write_corpus(corpus, args.text_mb)
    t_text = time.perf_counter() - t
    t = time.perf_counter()
    rc = cli(["prepare", "--corpus", str(corpus), "--out", str(data), "--vocab-size", str(args.vocab_size),
              "--shard-tokens", str(args.shard_tokens), "--context", str(args.seq)])
    t_prepare = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"prepare exited {rc}")
    meta = json.loads((data / "meta.json").read_text())
    shards = sorted(p.name for p in data.glob("train_*.bin"))
    seconds = timed_loader(loop)
    train_args = ["train", "--data", str(data), "--out", str(out), "--preset", args.preset, "--device", args.device,
                  "--batch-size", str(args.batch), "--seq-len", str(args.seq), "--max-steps", str(args.steps),
                  "--warmup-steps", "10", "--log-every", "1", "--eval-every", "0", "--eval-tokens", str(args.seq * 8),
                  "--stats-every", "0", "--keep-last", "1", "--no-progress", "--seed", "1"]
    if args.compile:
        train_args.append("--compile")
    if args.device == "cpu":
        train_args += ["--threads", "1"]  # not measured at the start: the smoke run checks the script only
    t = time.perf_counter()
    rc = cli(train_args)
    t_train = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"train exited {rc}")
    recs = [r for r in read_metrics(out / "metrics.jsonl") if "tok_s" in r]
    after = [r for r in recs if r["step"] > args.warm_steps] or recs
    t0 = next((r["time"] for r in recs if r["step"] == args.warm_steps), recs[0]["time"])
    wall = recs[-1]["time"] - t0  # seconds from the end of the warm steps to the last step
    loader = sum(seconds[args.warm_steps:])
    mfus = [r["mfu"] for r in after if r.get("mfu") is not None]
    shutil.rmtree(out, ignore_errors=True)  # the run folder: its checkpoint is not needed
    return {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "preset": args.preset, "batch": args.batch, "seq": args.seq,
        "steps": args.steps, "warm_steps": args.warm_steps, "compile": args.compile,
        "text_mb": args.text_mb, "documents": docs, "text_seconds": round(t_text, 2),
        "prepare_seconds": round(t_prepare, 2), "prepare_mb_per_s": round(args.text_mb / t_prepare, 2),
        "vocab_size": meta.get("vocab_size"), "train_shards": shards, "shard_tokens": args.shard_tokens,
        "train_seconds": round(t_train, 2),
        "tok_s_median": statistics.median(r["tok_s"] for r in after),
        "mfu_median": statistics.median(mfus) if mfus else None,
        "loader_seconds": round(loader, 4), "timed_wall_seconds": round(wall, 3),
        "loader_share": loader / wall if wall > 0 else None,
        "loader_ms_per_step": 1000 * statistics.median(seconds[args.warm_steps:] or seconds),
        "final_loss": recs[-1]["loss"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_shards.json"),
                    help="the JSON file to write (a folder: train_shards.json in it)")
    ap.add_argument("--work", default=None, help="folder for the corpus, the shards and the run (default: a temporary one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warm-steps", type=int, default=30, help="steps left out of the figures (compilation, warm-up)")
    ap.add_argument("--text-mb", type=float, default=48)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--shard-tokens", type=int, default=2_000_000)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.preset, args.batch, args.seq, args.steps, args.warm_steps = "cpu", "tiny", 4, 64, 12, 4
        args.text_mb, args.vocab_size, args.shard_tokens, args.compile = 0.4, 512, 30_000, False
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():  # e.g. under bench/run_all.py on a CPU machine
        print("bench/train_shards.py skipped: no CUDA GPU here (--smoke checks the script on the CPU)", flush=True)
        return {"skipped": "no CUDA GPU"}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="train_shards_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args, work)
    finally:
        if args.work is None:  # the temporary corpus and shards go
            shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    write_json(out / "train_shards.json" if out.is_dir() else out, result)
    mfu = "n/a" if result["mfu_median"] is None else f"{100 * result['mfu_median']:.1f}%"
    print(f"{result['device']}: {result['tok_s_median']:,.0f} tokens/s, MFU {mfu}, loader "
          f"{100 * (result['loader_share'] or 0):.2f}% of the step ({result['loader_ms_per_step']:.2f} ms), "
          f"{len(result['train_shards'])} train shards")
    return result


if __name__ == "__main__":
    main()
