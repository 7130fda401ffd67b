"""Where one served stream's time goes: the same greedy answer timed at each layer between in-process
`generate` and a streamed HTTP request, in the same rounds, on one thread.

    generate      in-process `generate` (the baseline of bench/serve.py's overhead)
    stepped       the continuous-batching Engine stepped in this thread (bench/batching.py's way)
    thread        the Engine on its background thread, this thread blocking on the ticket's events
    process       the Engine in a process of its own (serve/worker.py's ProcessEngine), the same consumer
    http          `glassformer serve` (its own process, engine in a child), one streamed /v1/completions
                  request read with aiohttp in this process (bench/serve.py's client)

Each contender answers the same prompt `--repeat` times over per measurement; rounds alternate all
contenders; reported: the best round of each and, per round, each against that round's `generate`
(the median of those paired ratios: this machine's speed drifts over seconds). The step from one
layer to the next is what that layer costs.

    python bench/serve_overhead.py [--shape demo|reference] [--rounds 7] [--repeat 6] [--new-tokens 48]
        [--prompt-tokens 16] [--stream-interval MS[,MS...]] [--client aiohttp|httpx|raw]

--stream-interval 0,5 runs the process and http layers twice, as process@0 / http@0 (the engine's
process sends a message every step) and process@5 / http@5 (at most every 5 ms; the default is the
server's, 20).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as served  # noqa: E402  (bench/serve.py: the model, prompts, server and client it uses)
from _common import write_json  # noqa: E402

from glassformer import generate, load  # noqa: E402
from glassformer.generation.batching import Engine, Request  # noqa: E402
from glassformer.serve.worker import STREAM_INTERVAL, ProcessEngine  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def contenders(model, tok, folder: Path, ids: list[int], n: int, intervals: list[float]):
    """name -> a callable answering once (greedy, n tokens, stopping where the server stops), and the
    things to stop afterwards. With more than one stream interval (ms), the process and http layers
    once for each, named process@MS and http@MS."""
    stop = list(tok.eos_ids)
    stepped, thread = Engine(model, max_batch=16), Engine(model, max_batch=16).start()
    tag = (lambda name, ms: f"{name}@{ms:g}") if len(intervals) > 1 else (lambda name, ms: name)
    processes = {tag("process", ms): ProcessEngine(functools.partial(load, folder), max_batch=16, threads=1,
                                                   stream_interval=ms / 1e3).start().wait_ready()
                 for ms in intervals}
    servers = {tag("http", ms): served.Served(folder, 1, 16, False, "process", ms) for ms in intervals}

    def by_events(engine) -> list[int]:
        return [e.token for e in engine.submit(Request(ids, n, temperature=0, stop_ids=stop)).events()
                if e.token is not None]

    def by_steps() -> list[int]:
        ticket = stepped.submit(Request(ids, n, temperature=0, stop_ids=stop))
        while stepped.step():
            pass
        return [e.token for e in ticket._events if e.token is not None]

    async def http_once(url: str, client) -> int:
        return (await served.one_stream(client, url, ids, n))["tokens"]

    fns = {"generate": lambda: list(generate(model, ids, max_new_tokens=n, greedy=True, stop=stop)),
           "stepped": by_steps, "thread": functools.partial(by_events, thread),
           **{k: functools.partial(by_events, p) for k, p in processes.items()},
           **{k: functools.partial(http_once, server.url) for k, server in servers.items()}}
    urls = {k: server.url for k, server in servers.items()}
    return fns, (thread.stop, *(p.stop for p in processes.values()), *(v.stop for v in servers.values())), urls


def timed(fn, repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


async def http_tokens(fn, url: str, client_kind: str) -> int:
    async with served._session(client_kind, 1) as client:
        return await fn(client)


async def timed_http(fn, url: str, repeat: int, client_kind: str) -> float:
    async with served._session(client_kind, 1) as client:
        await served._health(client, url)  # the connection opened before the clock, as bench/serve.py does
        t = time.perf_counter()
        for _ in range(repeat):
            await fn(client)
        return (time.perf_counter() - t) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(served.SHAPES), default="demo")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=6, help="answers per measurement")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--text", default=str(served.DEFAULT_TEXT))
    ap.add_argument("--stream-interval", default=f"{STREAM_INTERVAL * 1e3:g}", metavar="MS[,MS...]",
                    help="the process engine's and the server's stream interval in ms (--stream-interval-ms); "
                         "several: each layer once for each, side by side")
    ap.add_argument("--client", choices=("aiohttp", "httpx", "raw"), default="aiohttp",
                    help="the http layer's client (bench/serve.py's --client)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the children (engine process, server) start with one thread too
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.shape
        served.build(served.SHAPES[args.shape], Path(args.text).read_text(encoding="utf-8"), folder)
        model, tok = load(folder)
        ids = served.prompts(tok, 1, args.prompt_tokens)[0]
        intervals = [float(v) for v in args.stream_interval.split(",")]
        fns, stops, urls = contenders(model, tok, folder, ids, args.new_tokens, intervals)
        order = list(fns)
        try:
            want = fns["generate"]()  # warm-up, and every layer's answer checked against generate's
            for name in order[1:]:
                if name in urls:
                    assert asyncio.run(http_tokens(fns[name], urls[name], args.client)) == len(want), f"{name}: another token count"
                else:
                    assert fns[name]() == want, f"{name}: other tokens than generate's"
            for name in order:
                asyncio.run(timed_http(fns[name], urls[name], 2, args.client)) if name in urls else timed(fns[name], 2)
            rounds = []
            for r in range(args.rounds):
                got = {name: asyncio.run(timed_http(fns[name], urls[name], args.repeat, args.client)) if name in urls
                       else timed(fns[name], args.repeat) for name in order}
                rounds.append(got)
                print(f"round {r + 1}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in got.items()) + " ms an answer",
                      flush=True)
        finally:
            for s in stops:
                s()
    best = {k: min(r[k] for r in rounds) for k in order}
    paired = {k: statistics.median(r[k] / r["generate"] - 1 for r in rounds) for k in order}
    print(f"\n{args.shape}: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, one thread, "
          f"{args.rounds} rounds of {args.repeat} answers")
    for k in order:
        print(f"  {k:>10}: best {best[k] * 1e3:7.2f} ms an answer ({best[k] / best['generate'] - 1:+.1%} against generate's best); "
              f"median of each round's own {paired[k]:+.1%}")
    write_json(args.out or RESULTS / f"serve_overhead_{args.shape}.json", {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "shape": args.shape, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "repeat": args.repeat, "client": args.client, "stream_interval_ms": intervals, "rounds": rounds, "best_s": best, "paired_median_overhead": paired})


if __name__ == "__main__":
    main()
