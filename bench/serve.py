"""Serving: `glassformer serve` (its own process, continuous batching) under 1, 4 and 16 concurrent
streams against in-process `generate`, on the reference shape and the demo model's shape, with each
engine side by side (`--engine process`, the default: the engine in a process of its own;
`--engine thread`: on a thread of the server's process).

For each shape: a random model (weights drawn larger than the init, so greedy argmaxes are not
near-ties) with a BPE tokenizer trained on the given text is saved as a checkpoint and served with
`glassformer serve --max-batch 16 --engine E` for each engine E; the benchmark's client (asyncio +
aiohttp, the `bench` extra, in this process; or `--client raw`, HTTP/1.1 by hand, the least a client
costs) sends streaming /v1/completions requests of the same prompt length, greedy, and reads them as
they come, each on a connection it opened before the round's clock starts (GET /health), as a client
that keeps its connection does. Rounds alternate in-process generate and each engine's (and
client's) numbers of streams, those in another order each round, so a busy machine slows all alike.
Reported per number of streams (the best round by aggregate tokens/s): aggregate tokens/s
(completion tokens of all streams / the wall time from the first request to the last [DONE]),
p50/p99 time to first token, p50/p99 gap between chunks (a chunk is a token, except where a partial
UTF-8 character or a stop string holds text back); one stream's time against in-process `generate`
of the same tokens with the same thread count, unless --server-threads gives the server another (the
best of each: the server overhead, HTTP client included); the KV cache bytes of one row, and the
server's resident memory growth per active row at the highest number of streams (the engine's
process included). The server and the client share the machine.

    python bench/serve.py [--shapes reference,demo] [--streams 1,4,16] [--rounds 3] [--threads 2] [--server-threads N]
        [--engine thread,process] [--new-tokens 128] [--prompt-tokens 64] [--text FILE] [--compile] [--quick]
        [--repeat R] [--client aiohttp|httpx|raw[,...]] [--lockstep]
    --repeat R: each measurement R times over, one after another (default: until one stream has made 256 tokens)
    --lockstep: each stream's next request waits for every stream's request before (the old default)
    --engine process@0,process@5: the process engine served with --stream-interval-ms 0 and 5, side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer, generate, load  # noqa: E402
from glassformer.checkpoint.folders import save_model  # noqa: E402
from glassformer.config import PRESETS, REFERENCE_SHAPE  # noqa: E402
from glassformer.kv_cache import KVCache  # noqa: E402
from glassformer.text.tokenizer import Tokenizer  # noqa: E402

import aiohttp  # noqa: E402  (the `bench` extra)
import httpx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
SHAPES = {"reference": REFERENCE_SHAPE, "demo": PRESETS["small"]}
REPEAT_TOKENS = 256  # --repeat 0: each measurement repeated until one stream makes at least this many tokens


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
    """`glassformer serve --engine ENGINE` in its own process, with `threads` torch threads."""

    def __init__(self, folder: Path, threads: int, max_batch: int, compile: bool, engine: str,
                 stream_interval_ms: float | None = None):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO / "src")}
        env.pop("GLASSFORMER_API_KEY", None)
        cmd = [sys.executable, "-m", "glassformer", "serve", "--checkpoint", str(folder), "--port", "0",
               "--model-name", "bench", "--max-batch", str(max_batch), "--engine", engine] + \
            (["--compile"] if compile else []) + \
            ([] if stream_interval_ms is None else ["--stream-interval-ms", str(stream_interval_ms)])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        found = re.fullmatch(r"serving bench at (\S+)\n", line)
        if not found:
            raise SystemExit(f"the server did not start: {line!r}")
        self.url = found[1]

    def rss(self) -> int:
        """The server's resident memory now, in bytes, its child processes' (the engine's) included."""
        return sum(_rss(pid) for pid in [self.proc.pid, *_children(self.proc.pid)])

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the server's own process and of its children (the engine's), from each
        thread's /proc schedstat (nanoseconds, where /proc/PID/stat counts 10 ms ticks); (0, 0) off Linux."""
        return _cpu(self.proc.pid), sum(_cpu(c) for c in _children(self.proc.pid))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _cpu(pid: int) -> float:
    try:
        return sum(int((t / "schedstat").read_text().split()[0]) for t in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError):  # gone meanwhile, or no /proc
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]
    except OSError:
        return []


def _rss(pid: int) -> int:
    try:
        rows = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(r.split()[1]) * 1024 for r in rows if r.startswith("VmRSS:")), 0)


# ----------------------------------------------------------------------------- the client


def _chunk(line: bytes, seen: dict) -> None:
    """One SSE line of a stream into `seen`: a chunk's time when it carries text, the usage's count."""
    line = line.rstrip(b"\r\n")
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return
    obj = json.loads(line[6:])
    if obj.get("usage"):
        seen["tokens"] = obj["usage"]["completion_tokens"]
    if obj["choices"] and obj["choices"][0]["text"]:
        seen["chunks"].append(time.perf_counter())


async def one_stream(client, url: str, ids: list[int], n: int) -> dict:
    """One streaming completion: its start, chunk times, end, and completion tokens (usage)."""
    body = {"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    seen = {"start": time.perf_counter(), "chunks": [], "tokens": None}
    if isinstance(client, RawClient):
        async for line in client.lines("POST", url + "/completions", json.dumps(body).encode()):
            _chunk(line, seen)
    elif isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", url + "/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                _chunk(line.encode(), seen)
    else:
        async with client.post(url + "/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:  # one SSE line at a time
                _chunk(line, seen)
    return {**seen, "end": time.perf_counter()}


class RawClient:
    """The leanest client (`--client raw`): HTTP/1.1 written and read by hand over kept-alive asyncio
    connections, one per request in flight, so what the client costs a request and a chunk is little
    more than its writes, its line reads and a JSON parse, and the figures are the server's rather
    than a client library's (the client's CPU a token beside aiohttp's: docs/benchmarks-log.md#serve)."""

    def __init__(self):
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> "RawClient":
        return self

    async def __aexit__(self, *exc) -> None:
        for _, w in self.idle:
            w.close()

    async def lines(self, method: str, url: str, body: bytes = b""):
        """The answer's body line by line as it comes (a chunked body, or one of Content-Length); the
        status must be 200. The connection is kept for the next request once the body is read."""
        u = urllib.parse.urlsplit(url)
        request = (f"{method} {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        status = b""
        while not status:  # a kept connection the server has closed meanwhile answers nothing: a new one
            kept = bool(self.idle)
            r, w = conn = self.idle.pop() if kept else await asyncio.open_connection(u.hostname, u.port)
            try:
                w.write(request)
                status = await r.readline()
            except ConnectionError:
                status = b""
            if not status:
                w.close()
                if not kept:
                    break
        if status.split(b" ")[1:2] != [b"200"]:
            raise RuntimeError(f"{method} {url}: {status!r}")
        headers = {}
        while (line := await r.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            held = b""
            while size := int((await r.readline()).split(b";")[0], 16):
                held += (await r.readexactly(size + 2))[:-2]  # the chunk, less its CRLF
                *done, held = held.split(b"\n")
                for line in done:
                    yield line + b"\n"
            await r.readline()  # the blank line after the last chunk
            if held:
                yield held
        else:
            for line in (await r.readexactly(int(headers.get("content-length", 0)))).splitlines(keepends=True):
                yield line
        if headers.get("connection", "").lower() == "close":  # llama-server closes after a few requests
            w.close()
        else:
            self.idle.append(conn)


def _session(kind: str, n: int):
    """The client `kind` (--client: aiohttp, httpx or raw) for n concurrent streams. It shares the two cores with the server: aiohttp reads a
    streamed chunk for about a third of httpx's CPU (`--client httpx` compares; docs/benchmarks-log.md#serve),
    CPU that would be charged to the server's figures; `--client raw` costs less again (RawClient)."""
    if kind == "raw":
        return RawClient()
    if kind == "httpx":
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        return httpx.AsyncClient(timeout=None, limits=limits)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 4), timeout=aiohttp.ClientTimeout(total=None))


LOCKSTEP = False  # --lockstep: each repeat waits for every stream of the one before


async def streams(url: str, rows: list[list[int]], n: int, repeat: int = 1,
                  client_kind: str = "aiohttp") -> list[dict]:
    """The rows' streams at once, read by a `client_kind` client (_session), each stream's `repeat`
    requests one after another on its connection: a client that asks again as soon as its answer is
    done, whatever the other streams are at (as concurrent clients do, and as continuous batching
    admits them). With LOCKSTEP, each repeat starts when every stream's request of the one before
    has ended instead: the batch drains and refills."""
    async with _session(client_kind, len(rows)) as client:
        # Each stream's connection opened before the clock starts, as a client keeping its connection does
        # (the openai package): a fresh client's first request costs it 15-20 ms (measured on a busy machine).
        await asyncio.gather(*(_health(client, url) for _ in rows))
        if LOCKSTEP:
            runs = []
            for _ in range(repeat):
                runs += await asyncio.gather(*(one_stream(client, url, ids, n) for ids in rows))
            return runs

        async def one_client(ids: list[int]) -> list[dict]:
            return [await one_stream(client, url, ids, n) for _ in range(repeat)]

        return [run for runs in await asyncio.gather(*(one_client(ids) for ids in rows)) for run in runs]


async def _health(client, url: str) -> None:
    if isinstance(client, RawClient):
        async for _ in client.lines("GET", url.removesuffix("/v1") + "/health"):
            pass
        return
    if isinstance(client, httpx.AsyncClient):
        await client.get(url.removesuffix("/v1") + "/health")
        return
    async with client.get(url.removesuffix("/v1") + "/health") as r:
        await r.read()


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


def in_process(model, tok, ids: list[int], n: int, repeat: int = 1) -> tuple[float, int]:
    """Seconds of `repeat` in-process generates one after another, greedy, stopping where the server
    stops, and the tokens of one."""
    t = time.perf_counter()
    for _ in range(repeat):
        made = list(generate(model, ids, max_new_tokens=n, greedy=True, stop=list(tok.eos_ids)))
    return time.perf_counter() - t, len(made)


def sample_rss(server: Served, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.05):
        peak[0] = max(peak[0], server.rss())


def one_round(url: str, rows, n: int, counts: list[int], client_kind: str, watch: Served | None = None,
              peak: list[int] | None = None, repeat: int = 1) -> dict[int, dict]:
    """Each number of concurrent streams once (`repeat` times over) read by a `client_kind` client; with
    `watch`, its peak memory at the highest."""
    out = {}
    for c in counts:
        stop = threading.Event()
        if watch is not None and c == max(counts):
            threading.Thread(target=sample_rss, args=(watch, stop, peak), daemon=True).start()
        cpu, theirs = time.process_time(), watch.cpu() if watch is not None else (0.0, 0.0)
        runs = asyncio.run(streams(url, rows[:c], n, repeat, client_kind))
        cpu = time.process_time() - cpu  # the client's own CPU (this process: nothing else runs in it meanwhile)
        server, engine = (b - a for a, b in zip(theirs, watch.cpu())) if watch is not None else (0.0, 0.0)
        stop.set()
        res = summary(runs)
        per = 1 / max(1, res["tokens"])
        out[c] = {**res, "streams": c, "client_cpu_s_per_token": cpu * per, "one_run": runs[0]}
        if watch is not None:  # the server's process (HTTP side) and its children (the engine's process)
            out[c].update(server_cpu_s_per_token=server * per, engine_cpu_s_per_token=engine * per)
    return out


def best_rounds(rounds: list[dict], counts: list[int]) -> dict[int, dict]:
    """The best round of each number of streams (by aggregate tokens/s), relative to one stream."""
    best = {c: dict(max((r[c] for r in rounds), key=lambda x: x["tokens_per_s"])) for c in counts}
    for b in best.values():
        b["vs_one_stream"] = b["tokens_per_s"] / best[min(counts)]["tokens_per_s"]
    return best


class LlamaServer:
    """llama.cpp's `llama-server --parallel P --cont-batching` on a GGUF file, `threads` threads."""

    def __init__(self, binary: str, gguf: Path, threads: int, parallel: int, slot_tokens: int):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        cmd = [binary, "-m", str(gguf), "--parallel", str(parallel), "--cont-batching", "-t", str(threads),
               "-tb", str(threads), "-c", str(parallel * slot_tokens), "--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/v1"
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("llama-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def measure(servers: dict[str, Served], clients: dict[str, str], model, tok, rows, n: int, args,
            llama: LlamaServer | None) -> dict:
    """Rounds alternating in-process generate, every contender's numbers of streams (the server
    `servers[name]` read by the client `clients[name]`: `contenders`), and llama-server's 1 and 8
    streams when given (a busy machine then slows all alike), the contenders in another order each
    round, so none is always the one right after generate; the best round of each. One stream's best
    against generate's best is the server's overhead (the same tokens: generate stops where the server
    stops)."""
    counts = sorted(set(args.streams) | ({1, 8} if llama else set()))
    # Each measurement spans at least REPEAT_TOKENS of one stream: the demo shape's 48-token answer
    # alone takes ~65 ms, where one scheduling hiccup moved the one-stream figure by a quarter.
    repeat = args.repeat or -(-REPEAT_TOKENS // n)
    in_process(model, tok, rows[0], n)  # warm-up: first-call costs (allocator, row copies) are not generation's
    inproc, theirs = [], []
    ours = {e: [] for e in servers}
    peaks, idle = {e: [0] for e in servers}, {e: s.rss() for e, s in servers.items()}
    names = list(servers)
    for r in range(args.rounds):
        inproc.append(in_process(model, tok, rows[0], n, repeat))
        for e in names[r % len(names):] + names[:r % len(names)]:
            ours[e].append(one_round(servers[e].url, rows, n, counts, clients[e], servers[e], peaks[e], repeat))
        if llama is not None:
            theirs.append(one_round(llama.url, rows, n, [1, 8], args.client[0], repeat=repeat))
    made, fastest = inproc[0][1], min(sec for sec, _ in inproc) / repeat  # one generate's seconds
    out = {"repeat": repeat, "in_process": {"tokens": made, "seconds": fastest, "tokens_per_s": made / fastest},
           "engines": {}}
    other = best_rounds(theirs, [1, 8]) if llama is not None else None
    for e in servers:
        out["engines"][e] = engine_result(ours[e], counts, made, fastest, (peaks[e][0] - idle[e]) / max(counts), other)
        out["engines"][e]["paired"] = paired(ours[e], [sec / repeat for sec, _ in inproc], counts, made)
        out["engines"][e]["cpu_s_per_token_median"] = cpu_medians(ours[e], counts)
    if other is not None:
        out["llama_server"] = {"streams": [other[1], other[8]]}
        for b in out["llama_server"]["streams"]:
            b.pop("one_run", None)
    return out


def paired(rounds: list[dict], generate_s: list[float], counts: list[int], made: int) -> dict:
    """Each round's own figures, from measurements taken next to each other, and their medians: one
    stream's overhead against that round's generate, and each number of streams against that round's one
    stream. The best rounds pair the fastest moments of the whole run; where the machine's speed drifts
    over seconds (it swung twofold on some days), a round's own pair shares its moment."""
    out: dict = {}
    if 1 in counts:
        over = [made / r[1]["tokens_per_s"] / g - 1 for r, g in zip(rounds, generate_s)]
        out["overhead"] = {"rounds": over, "median": statistics.median(over)}
        for c in counts:
            if c != 1:
                vs = [r[c]["tokens_per_s"] / r[1]["tokens_per_s"] for r in rounds]
                out[f"{c}_vs_one"] = {"rounds": vs, "median": statistics.median(vs)}
    return out


def cpu_medians(rounds: list[dict], counts: list[int]) -> dict:
    """CPU seconds a token of the client, the server's process and the engine's, medians of the rounds."""
    return {str(c): {k: statistics.median(r[c][f"{k}_cpu_s_per_token"] for r in rounds)
                     for k in ("client", "server", "engine")} for c in counts if "server_cpu_s_per_token" in rounds[0][c]}


def engine_result(rounds: list[dict], counts: list[int], made: int, fastest: float, rss_per_row: float,
                  llama: dict | None) -> dict:
    """One engine's best rounds, its one stream against in-process generate, and against llama-server's."""
    best = best_rounds(rounds, counts)
    out = {"streams": [best[c] for c in counts], "rss_growth_per_row_bytes": rss_per_row}
    one = best[1]["one_run"] if 1 in best else None
    if one is not None:
        assert one["tokens"] == made, f"the server made {one['tokens']} tokens, generate {made}"
        served = made / best[1]["tokens_per_s"]  # one request's share of the best one-stream round
        out["one_stream_vs_generate"] = {"tokens": made, "in_process_s": fastest, "served_s": served,
                                         "in_process_tokens_per_s": made / fastest,
                                         "served_tokens_per_s": made / served, "overhead": served / fastest - 1}
    if llama is not None:
        out["glassformer_over_llama"] = {str(c): best[c]["tokens_per_s"] / llama[c]["tokens_per_s"] for c in (1, 8)}
    for b in best.values():
        b.pop("one_run", None)
    return out


def bench_shape(name: str, shape: dict, text: str, args) -> dict:
    S = shape["max_seq_len"]
    P = min(args.prompt_tokens, S // 4)
    n = min(args.new_tokens, S - P)
    with tempfile.TemporaryDirectory() as tmp:
        build(shape, text, Path(tmp) / name)
        model, tok = load(Path(tmp) / name)  # in-process generate runs the checkpoint the server loads
        rows = prompts(tok, max(args.streams), P)
        llama, started, servers, clients = None, [], {}, {}
        try:
            if args.llama_server:  # its own process
                gguf = Path(tmp) / f"{name}.gguf"
                subprocess.run([sys.executable, "-m", "glassformer", "convert", "--to-gguf", str(Path(tmp) / name),
                                "--out", str(gguf), "--dtype", "f32"], cwd=REPO, check=True, capture_output=True,
                               env={**os.environ, "PYTHONPATH": str(REPO / "src")})
                llama = LlamaServer(args.llama_server, gguf, args.threads, 8, P + n + 8)
            for e in args.engine:
                kind, _, interval = e.partition("@")  # process@MS: --stream-interval-ms MS
                server = Served(Path(tmp) / name, args.server_threads, max(args.streams), args.compile, kind,
                                float(interval) if interval else None)
                started.append(server)
                for contender, client in contenders(e, args.client):
                    servers[contender], clients[contender] = server, client
                for k in sorted(set([1, 2, 4, 8, 16] if args.compile else [1]) | {max(args.streams)}):
                    asyncio.run(streams(server.url, rows[:k], 4, client_kind=args.client[0]))  # warm-up (with --compile: every batch bucket)
            res = {"shape": {**shape, "vocab_size": tok.vocab_size}, "prompt_tokens": P, "new_tokens": n,
                   "kv_bytes_per_row": KVCache.for_model(model, 1).row_bytes(),
                   **measure(servers, clients, model, tok, rows, n, args, llama)}
        finally:
            for server in started:
                server.stop()
            if llama is not None:
                llama.stop()
    return res


def contenders(engine: str, clients: list[str]) -> list[tuple[str, str]]:
    """(name, client) of each way an engine's server is measured: named as the engine, or
    "ENGINE/CLIENT" for each of several clients (the same server read by each client in turn)."""
    return [(engine if len(clients) == 1 else f"{engine}/{c}", c) for c in clients]


def report(name: str, r: dict) -> None:
    ip = r["in_process"]
    print(f"\n{name}: prompt {r['prompt_tokens']} + {r['new_tokens']} new tokens, each measurement {r['repeat']} "
          f"time(s) over; in-process generate {ip['tokens_per_s']:.1f} tokens/s")
    for e, res in r["engines"].items():
        o = res.get("one_stream_vs_generate")
        if o is not None:
            print(f"  --engine {e}: one stream {o['served_tokens_per_s']:.1f} tokens/s served "
                  f"(overhead {100 * o['overhead']:+.1f}% against in-process generate)")
        for s in res["streams"]:
            print(f"    {s['streams']:>2} streams: {s['tokens_per_s']:7.1f} tokens/s ({s['vs_one_stream']:.2f}x one), "
                  f"TTFT p50 {1e3 * s['ttft_p50_s']:.0f} ms p99 {1e3 * s['ttft_p99_s']:.0f} ms, "
                  f"gap p50 {1e3 * s['gap_p50_s']:.1f} ms p99 {1e3 * s['gap_p99_s']:.1f} ms, "
                  f"client CPU {1e6 * s['client_cpu_s_per_token']:.0f} us a token"
                  + (f", server {1e6 * s['server_cpu_s_per_token']:.0f}, engine {1e6 * s['engine_cpu_s_per_token']:.0f}"
                     if "server_cpu_s_per_token" in s else ""))
        pr = res.get("paired", {})
        if pr:
            print("    each round's own: overhead " + " ".join(f"{100 * v:+.1f}%" for v in pr["overhead"]["rounds"])
                  + f" (median {100 * pr['overhead']['median']:+.1f}%)" + "".join(
                      f"; {k.split('_')[0]} vs one " + " ".join(f"{v:.2f}x" for v in pr[k]["rounds"])
                      + f" (median {pr[k]['median']:.2f}x)" for k in pr if k != "overhead"))
        for c, cpu in res.get("cpu_s_per_token_median", {}).items():
            print(f"    {c:>2} streams, CPU a token (median of the rounds): client {1e6 * cpu['client']:.0f} us, "
                  f"server {1e6 * cpu['server']:.0f} us, engine {1e6 * cpu['engine']:.0f} us")
        if "glassformer_over_llama" in res:
            ratio = res["glassformer_over_llama"]
            print(f"    glassformer / llama.cpp: {ratio['1']:.2f}x at 1, {ratio['8']:.2f}x at 8")
        print(f"    resident growth per active row {res['rss_growth_per_row_bytes'] / 2**20:.2f} MiB")
    if "llama_server" in r:
        ls = r["llama_server"]["streams"]
        print(f"  llama-server: 1 stream {ls[0]['tokens_per_s']:.1f} tokens/s, 8 streams {ls[1]['tokens_per_s']:.1f}")
    print(f"  memory per active row: KV cache {r['kv_bytes_per_row'] / 2**20:.2f} MiB (preallocated)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="reference,demo")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=0,
                    help="the server's threads (its OMP_NUM_THREADS; 0: --threads), where in-process generate keeps "
                         "--threads: what a user of a machine of --threads cores gets from each")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--text", default=str(DEFAULT_TEXT), help="text the tokenizers are trained on")
    ap.add_argument("--llama-server", default=None, metavar="BINARY",
                    help="also llama.cpp's llama-server (--parallel 8 --cont-batching) on the same weights as GGUF f32, "
                         "at 1 and 8 streams, same prompts, lengths and threads")
    ap.add_argument("--compile", action="store_true", help="serve with --compile (every batch bucket warmed first)")
    ap.add_argument("--engine", default="thread,process",
                    help="the engines to serve with, side by side in the same rounds (glassformer serve --engine); "
                         "process@MS serves with --stream-interval-ms MS (e.g. process@0,process@5)")
    ap.add_argument("--client", default="aiohttp",
                    help="the streaming client: aiohttp (a third of httpx's CPU a chunk), httpx to compare, or raw: "
                         "HTTP/1.1 by hand, the least a client can cost (RawClient); several (raw,aiohttp): each "
                         "engine read by each in the same rounds, reported as ENGINE/CLIENT")
    ap.add_argument("--repeat", type=int, default=0,
                    help="run each number of streams (and generate) this many times over in a round, one after "
                         "another (0: until one stream has made at least 256 tokens)")
    ap.add_argument("--lockstep", action="store_true",
                    help="each repeat starts when every stream's request of the one before has ended (the batch "
                         "drains and refills), instead of each stream asking again as soon as its answer is done")
    ap.add_argument("--quick", action="store_true", help="two rounds, 32 new tokens (a smoke run)")
    ap.add_argument("--out", default=None, help="results file (default: bench/results/serve[_compiled].json)")
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.engine = args.engine.split(",")
    if not {e.partition("@")[0] for e in args.engine} <= {"thread", "process"}:
        ap.error(f"--engine: thread and/or process (process@MS: with --stream-interval-ms MS), got {','.join(args.engine)}")
    args.client = args.client.split(",")
    if not set(args.client) <= {"aiohttp", "httpx", "raw"}:
        ap.error(f"--client: aiohttp, httpx and/or raw, got {','.join(args.client)}")
    if args.quick:
        args.rounds, args.new_tokens = 2, 32
    global LOCKSTEP
    LOCKSTEP = args.lockstep
    torch.set_num_threads(args.threads)
    args.server_threads = args.server_threads or args.threads
    text = Path(args.text).read_text(encoding="utf-8")
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                       "server_threads": args.server_threads, "torch": torch.__version__},
           "compiled": args.compile, "quick": args.quick, "repeat": args.repeat, "client": args.client,
           "lockstep": args.lockstep,
           "engines": args.engine, "shapes": {}}
    for name in args.shapes.split(","):
        out["shapes"][name] = bench_shape(name, SHAPES[name], text, args)
        report(name, out["shapes"][name])
    write_json(args.out or RESULTS / f"serve{'_compiled' if args.compile else ''}.json", out)


if __name__ == "__main__":
    main()
