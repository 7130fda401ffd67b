"""The loader's share of a training step on the reference shape, reading from shards.

Writes a sharded split of made-up documents (uint16 ids, an end-of-text every 3 to 2,000 ids) in
llm.c's shard format, maps it as `glassformer train` does (text/data.py load_split: a ShardSet),
and times what one_step asks of the loader, `get_batch` for step s (windows drawn from
(seed, s), read across shard ends, int64 x and y), with and without --align-docs. Beside it, in
the same process, a training step of the reference shape (config.REFERENCE_SHAPE, AdamW and
gradient clipping, fp32, eager) on the same batch shape; share = loader / (loader + step).

A GPU takes a step of this shape far faster than the CPU here, so the loader's time for a larger
per-process batch is also set against the step time an H100 would take at a stated MFU from the
FLOP count (cost/flops.py): an estimate, labelled so, until a GPU run measures it; and the loop's
wait for a batch read one step ahead (train/loader.py Prefetch, as train reads) while a sleep of
that step's length stands in for the device. One-off costs
at a run's start are timed too: the ids' check against the vocabulary and --align-docs's scan
for document starts.

    flock /tmp/glassformer-bench.lock python bench/loader.py [--tokens 64e6] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import train_step, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.cost.flops import train_flops_per_token  # noqa: E402
from glassformer.cost.hardware import get_hardware  # noqa: E402
from glassformer.text.data import check_ids, document_starts, get_batch  # noqa: E402
from glassformer.text.shards import ShardSet, shard_name, write_shard  # noqa: E402
from glassformer.train.loader import Prefetch  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402

EOT = 0


def write_shards(folder: Path, n_tokens: int, per_shard: int, vocab: int) -> ShardSet:
    """Shards of n_tokens made-up ids, per_shard ids each (the last shorter)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, n_tokens, dtype=np.uint16)  # (n,)
    ends = np.cumsum(rng.integers(3, 2001, n_tokens // 500 + 1))  # documents' ends, 1,001 ids apart on average
    ids[ends[ends < n_tokens]] = EOT
    ids[ids.size - 1] = EOT
    paths = []
    for i, a in enumerate(range(0, n_tokens, per_shard)):
        paths.append(folder / shard_name("train", i))
        write_shard(paths[-1], ids[a:a + per_shard], "uint16")
    return ShardSet(paths)


def loader_ms(tokens, B: int, T: int, steps: int, doc_starts=None) -> float:
    """Median milliseconds of get_batch for steps 0 … steps-1 (one process: the whole global batch)."""
    times = []
    for step in range(steps):
        t = time.perf_counter()
        get_batch(tokens, B, T, 1337, step, 0, 1, doc_starts=doc_starts)
        times.append(time.perf_counter() - t)
    return 1000 * float(np.median(times))


def exposed_ms(tokens, B: int, T: int, steps: int, step_s: float, doc_starts=None) -> float:
    """Median milliseconds the loop waits for a batch when the loader reads one step ahead (train/loader.py
    Prefetch) while a device step of step_s seconds runs: a sleep, as the CPU waits on a GPU (GIL released)."""
    ahead = Prefetch(lambda step: get_batch(tokens, B, T, 1337, step, 0, 1, doc_starts=doc_starts))
    waits = []
    for step in range(steps):
        t = time.perf_counter()
        ahead.get(step)
        waits.append(time.perf_counter() - t)
        time.sleep(step_s)
    return 1000 * float(np.median(waits))


def step_ms(B: int, T: int, warm: int, steps: int) -> float:
    """Best milliseconds of a reference-shape training step (forward, backward, clip, AdamW) on the CPU."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).train()
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    x, y = (torch.randint(0, REFERENCE_SHAPE["vocab_size"], (B, T)) for _ in range(2))
    best = float("inf")
    for i in range(warm + steps):
        t = time.perf_counter()
        train_step(model, opt, x, y)
        if i >= warm:
            best = min(best, time.perf_counter() - t)
    return 1000 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=64e6, help="ids in the sharded split")
    ap.add_argument("--shard-tokens", type=float, default=16e6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-batch", default="8x256", help="B x T of the CPU step timed beside the loader")
    ap.add_argument("--gpu-batch", default="64x1024", help="B x T per process of the H100 estimate")
    ap.add_argument("--mfu", type=float, default=0.4, help="the H100's assumed MFU (bf16) for the estimate")
    ap.add_argument("--loader-steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps (0: no CPU step)")
    ap.add_argument("--ahead-steps", type=int, default=100, help="simulated device steps with the loader reading ahead")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "loader.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    (cb, ct), (gb, gt) = ([int(v) for v in s.split("x")] for s in (args.cpu_batch, args.gpu_batch))
    with tempfile.TemporaryDirectory() as tmp:
        tokens = write_shards(Path(tmp), int(args.tokens), int(args.shard_tokens), REFERENCE_SHAPE["vocab_size"])
        t = time.perf_counter()
        check_ids(tokens, REFERENCE_SHAPE["vocab_size"])  # also reads every page in: the timings below are warm
        check_s = time.perf_counter() - t
        t = time.perf_counter()
        starts = document_starts(tokens, EOT)
        scan_s = time.perf_counter() - t
        res = {"tokens": len(tokens), "shards": len(tokens.paths), "documents": len(starts), "threads": args.threads,
               "torch": torch.__version__, "check_ids_s_per_1e9": check_s / len(tokens) * 1e9,
               "doc_scan_s_per_1e9": scan_s / len(tokens) * 1e9}
        for name, (B, T) in (("cpu", (cb, ct)), ("gpu", (gb, gt))):
            res[f"{name}_batch"] = [B, T]
            res[f"{name}_loader_ms"] = loader_ms(tokens, B, T, args.loader_steps)
            res[f"{name}_loader_align_docs_ms"] = loader_ms(tokens, B, T, args.loader_steps, starts)
        cfg = ModelConfig(**REFERENCE_SHAPE)
        res["h100_step_ms_estimate"] = (1000 * train_flops_per_token(cfg, gt) * gb * gt
                                        / (get_hardware("h100").peak("bf16") * args.mfu))
        res["h100_mfu_assumed"] = args.mfu
        for kind, docs in (("loader", None), ("loader_align_docs", starts)):
            res[f"gpu_{kind}_read_ahead_ms"] = exposed_ms(tokens, gb, gt, args.ahead_steps,
                                                          res["h100_step_ms_estimate"] / 1000, docs)
    res["cpu_step_ms"] = step_ms(cb, ct, args.warm, args.steps) if args.steps else None
    for name, step in (("cpu", res["cpu_step_ms"]), ("gpu", res["h100_step_ms_estimate"])):
        for kind in ("loader", "loader_align_docs") + (("loader_read_ahead", "loader_align_docs_read_ahead")
                                                        if name == "gpu" else ()):
            ms = res[f"{name}_{kind}_ms"]
            res[f"{name}_{kind}_share"] = None if step is None else ms / (ms + step)
    print(f"{res['tokens']:,} ids in {res['shards']} shards, {res['documents']:,} documents; "
          f"check_ids {res['check_ids_s_per_1e9']:.2f} s and the document scan {res['doc_scan_s_per_1e9']:.2f} s per 1e9 ids")
    if args.steps:
        print(f"CPU, B {cb} x T {ct}: step {res['cpu_step_ms']:.0f} ms; loader {res['cpu_loader_ms']:.3f} ms "
              f"({100 * res['cpu_loader_share']:.3f}%), with --align-docs {res['cpu_loader_align_docs_ms']:.3f} ms "
              f"({100 * res['cpu_loader_align_docs_share']:.3f}%)")
    print(f"H100 estimate, B {gb} x T {gt} a process at MFU {args.mfu}: step {res['h100_step_ms_estimate']:.1f} ms; "
          f"loader {res['gpu_loader_ms']:.3f} ms ({100 * res['gpu_loader_share']:.2f}%), with --align-docs "
          f"{res['gpu_loader_align_docs_ms']:.3f} ms ({100 * res['gpu_loader_align_docs_share']:.2f}%); read one step "
          f"ahead, the wait {res['gpu_loader_read_ahead_ms']:.3f} ms ({100 * res['gpu_loader_read_ahead_share']:.3f}%), "
          f"with --align-docs {res['gpu_loader_align_docs_read_ahead_ms']:.3f} ms "
          f"({100 * res['gpu_loader_align_docs_read_ahead_share']:.3f}%)")
    write_json(args.out, res)


if __name__ == "__main__":
    main()
