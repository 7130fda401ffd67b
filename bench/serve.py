"""Serving: `glassformer serve` (its own process, continuous batching) under 1, 4 and 16 concurrent
streams against in-process `generate`, on the reference shape and the demo model's shape.

For each shape: a random model (weights drawn larger than the init, so greedy argmaxes are not
near-ties) with a BPE tokenizer trained on the given text is saved as a checkpoint and served with
`glassformer serve --max-batch 16`; the benchmark's client (asyncio + httpx, in this process) sends
streaming /v1/completions requests of the same prompt length, greedy, and reads them as they come.
Reported per number of streams (the best of --rounds rounds by aggregate tokens/s): aggregate
tokens/s (completion tokens of all streams / the wall time from the first request to the last
[DONE]), p50/p99 time to first token, p50/p99 gap between chunks (a chunk is a token, except where
a partial UTF-8 character or a stop string holds text back); one stream's time against in-process
`generate` of the same tokens with the same thread count (rounds alternating: the server overhead,
HTTP client included); the KV cache bytes of one row, and the server's resident memory growth per
active row at the highest number of streams. The server and the client share the machine.

    python bench/serve.py [--shapes reference,demo] [--streams 1,4,16] [--rounds 2] [--threads 2]
        [--new-tokens 128] [--prompt-tokens 64] [--text FILE] [--compile] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer, generate  # noqa: E402
from glassformer.checkpoint.folders import save_model  # noqa: E402
from glassformer.config import PRESETS, REFERENCE_SHAPE  # noqa: E402
from glassformer.kv_cache import KVCache  # noqa: E402
from glassformer.text.tokenizer import Tokenizer  # noqa: E402

import httpx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
SHAPES = {"reference": REFERENCE_SHAPE, "demo": PRESETS["small"]}


# ----------------------------------------------------------------------------- the model and its server


def build(shape: dict, text: str, folder: Path):
    """A random model of `shape` with a tokenizer trained on `text`, saved to `folder`."""
    tok = Tokenizer.train([text], vocab_size=shape["vocab_size"])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**shape, "vocab_size": tok.vocab_size})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    save_model(folder, model, tok)
    return model, tok


def prompts(tok, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` ids drawn from the tokenizer's vocabulary, end-of-turn ids left out."""
    eos = set(tok.eos_ids)
    ok = torch.tensor([i for i in range(tok.vocab_size) if i not in eos])
    return [ok[torch.randint(0, len(ok), (length,), generator=torch.Generator().manual_seed(i))].tolist()
            for i in range(n)]


class Served:
    """`glassformer serve` in its own process, with `threads` torch threads."""

    def __init__(self, folder: Path, threads: int, max_batch: int, compile: bool):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO / "src")}
        env.pop("GLASSFORMER_API_KEY", None)
        cmd = [sys.executable, "-m", "glassformer", "serve", "--checkpoint", str(folder), "--port", "0",
               "--model-name", "bench", "--max-batch", str(max_batch)] + (["--compile"] if compile else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        found = re.fullmatch(r"serving bench at (\S+)\n", line)
        if not found:
            raise SystemExit(f"the server did not start: {line!r}")
        self.url = found[1]

    def rss(self) -> int:
        """The server's resident memory now, in bytes."""
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


# ----------------------------------------------------------------------------- the client


async def one_stream(client: httpx.AsyncClient, url: str, ids: list[int], n: int) -> dict:
    """One streaming completion: its start, chunk times, end, and completion tokens (usage)."""
    body = {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, chunks, tokens = time.perf_counter(), [], None
    async with client.stream("POST", url + "/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            if obj["choices"] and obj["choices"][0]["text"]:
                chunks.append(time.perf_counter())
    return {"start": start, "chunks": chunks, "end": time.perf_counter(), "tokens": tokens}


async def streams(url: str, rows: list[list[int]], n: int) -> list[dict]:
    limits = httpx.Limits(max_connections=len(rows) + 4, max_keepalive_connections=len(rows) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, url, ids, n) for ids in rows))


def summary(runs: list[dict]) -> dict:
    """Aggregate tokens/s, TTFT and gap percentiles of one round of concurrent streams."""
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    ttft = [r["chunks"][0] - r["start"] for r in runs if r["chunks"]]
    gaps = [b - a for r in runs for a, b in zip(r["chunks"], r["chunks"][1:])]
    tokens = sum(r["tokens"] or 0 for r in runs)

    def pct(xs, q):
        return float(np.percentile(xs, q)) if xs else None

    return {"streams": len(runs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "gap_p50_s": pct(gaps, 50),
            "gap_p99_s": pct(gaps, 99)}


# ----------------------------------------------------------------------------- one shape


def in_process(model, tok, ids: list[int], n: int) -> tuple[float, int]:
    """Seconds and tokens of in-process generate, greedy, stopping where the server stops."""
    t = time.perf_counter()
    made = list(generate(model, ids, max_new_tokens=n, greedy=True, stop=list(tok.eos_ids)))
    return time.perf_counter() - t, len(made)


def sample_rss(server: Served, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.05):
        peak[0] = max(peak[0], server.rss())


def run_streams(server: Served, rows, n: int, rounds: int, measure_rss: bool) -> dict:
    """The best of `rounds` rounds of len(rows) concurrent streams; with measure_rss the peak RSS."""
    best, peak, idle = None, [0], server.rss()
    for _ in range(rounds):
        stop = threading.Event()
        watcher = threading.Thread(target=sample_rss, args=(server, stop, peak), daemon=True)
        if measure_rss:
            watcher.start()
        result = summary(asyncio.run(streams(server.url, rows, n)))
        stop.set()
        if best is None or result["tokens_per_s"] > best["tokens_per_s"]:
            best = result
    if measure_rss:
        best["rss_growth_per_row_bytes"] = (peak[0] - idle) / len(rows)
    return best


def overhead(server: Served, model, tok, ids, n: int, rounds: int) -> dict:
    """One stream through the server against in-process generate, rounds alternating, best of each."""
    inproc, served = [], []
    in_process(model, tok, ids, n)  # warm-up: first-call costs (allocator, row copies) are not generation's
    for _ in range(rounds):
        s, made = in_process(model, tok, ids, n)
        inproc.append(s)
        run = asyncio.run(streams(server.url, [ids], n))[0]
        assert run["tokens"] == made, f"the server made {run['tokens']} tokens, generate {made}"
        served.append(run["end"] - run["start"])
    return {"tokens": made, "in_process_s": min(inproc), "served_s": min(served),
            "in_process_tokens_per_s": made / min(inproc), "served_tokens_per_s": made / min(served),
            "overhead": min(served) / min(inproc) - 1}


def bench_shape(name: str, shape: dict, text: str, args) -> dict:
    S = shape["max_seq_len"]
    P, n = min(args.prompt_tokens, S // 4), min(args.new_tokens, S - min(args.prompt_tokens, S // 4))
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = build(shape, text, Path(tmp) / name)
        rows = prompts(tok, max(args.streams), P)
        server = Served(Path(tmp) / name, args.threads, max(args.streams), args.compile)
        try:
            for k in sorted(set([1, 2, 4, 8, 16] if args.compile else [1]) | {max(args.streams)}):
                asyncio.run(streams(server.url, rows[:k], 4))  # warm-up (with --compile: every batch bucket)
            res = {"shape": {**shape, "vocab_size": tok.vocab_size}, "prompt_tokens": P, "new_tokens": n,
                   "kv_bytes_per_row": KVCache.for_model(model, 1).row_bytes() if hasattr(KVCache, "row_bytes")
                   else None, "one_stream_vs_generate": overhead(server, model, tok, rows[0], n, args.rounds)}
            res["streams"] = [run_streams(server, rows[:c], n, args.rounds, c == max(args.streams))
                              for c in args.streams]
        finally:
            server.stop()
    one = res["streams"][0]["tokens_per_s"]
    for r in res["streams"]:
        r["vs_one_stream"] = r["tokens_per_s"] / one
    return res


def report(name: str, r: dict) -> None:
    o = r["one_stream_vs_generate"]
    print(f"\n{name}: prompt {r['prompt_tokens']} + {r['new_tokens']} new tokens; one stream "
          f"{o['served_tokens_per_s']:.1f} tokens/s served vs {o['in_process_tokens_per_s']:.1f} in process "
          f"(overhead {100 * o['overhead']:+.1f}%)")
    for s in r["streams"]:
        print(f"  {s['streams']:>2} streams: {s['tokens_per_s']:7.1f} tokens/s ({s['vs_one_stream']:.2f}x one), "
              f"TTFT p50 {1e3 * s['ttft_p50_s']:.0f} ms p99 {1e3 * s['ttft_p99_s']:.0f} ms, "
              f"gap p50 {1e3 * s['gap_p50_s']:.1f} ms p99 {1e3 * s['gap_p99_s']:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="reference,demo")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="text the tokenizers are trained on")
    ap.add_argument("--compile", action="store_true", help="serve with --compile (every batch bucket warmed first)")
    ap.add_argument("--quick", action="store_true", help="two rounds, 32 new tokens (a smoke run)")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/serve[_compiled].json)")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.quick:
        args.rounds, args.new_tokens = 2, 32
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_text(encoding="utf-8")
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                       "torch": torch.__version__},
           "compiled": args.compile, "quick": args.quick, "shapes": {}}
    for name in args.shapes.split(","):
        out["shapes"][name] = bench_shape(name, SHAPES[name], text, args)
        report(name, out["shapes"][name])
    write_json(args.out or RESULTS / f"serve{'_compiled' if args.compile else ''}.json", out)


if __name__ == "__main__":
    main()
