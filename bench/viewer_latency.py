"""How long the explorer takes to recompute a sentence: the `small` preset at 32 tokens, CPU.

Side by side in one process, for the same ids:
  forward      the model's plain forward pass (no recorder): the floor
  trace        glassformer.tracing.trace of every probe (tiled kernel, its tile log, top logits)
  payload      everything /api/trace computes: the trace, the pre-norm/post-norm twin's
               trace, the costs, the next-token table (what the page draws)
  http         a POST /api/trace to a running server, answer parsed: payload + JSON both ways
  later        what a click on another token waits for: the parts the page asks /api/explain
               for (that row's FlashAttention walks at the page's tile, its RMS calculations)
Each is the median of --repeats runs on fresh sentences (the server's cache never hits).
The target is under 1 s for `http`.

    python bench/viewer_latency.py [--tokens 32] [--repeats 5] [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from glassformer import ModelConfig, Transformer
from glassformer.viewer import source
from glassformer.viewer.server import make_server


class NumberTokenizer:
    """Text '17 4 99 …' <-> ids: the benchmark needs token ids, not a trained vocabulary."""

    def encode(self, text):
        return [int(w) for w in text.split()]

    def id_to_piece(self, i):
        return f"t{i}"


def median_time(fn, repeats):
    """Median wall-clock and CPU seconds (this process, all threads) over `repeats` calls."""
    wall, cpu = [], []
    for r in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(r)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 repeats (a quick check)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "viewer_latency.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats = 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset(args.preset)
    model = Transformer(cfg).eval()
    tok = NumberTokenizer()
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(str(i) for i in torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g).tolist())
             for _ in range(4 * args.repeats + 2)]
    ex = source.explorer(model, tok, texts[-1], model_name=args.preset)
    ex.payload(texts[-2])  # warm-up: first-call costs (imports, allocator) are not what a user waits for

    def ids(r):
        return tok.encode(texts[r])

    def forward(r):
        with torch.no_grad():
            model(torch.tensor([ids(r)]))

    def trace(r):
        source.trace_for_page(model, ids(r), [f"t{i}" for i in ids(r)])

    def payload(r):
        ex.payload(texts[args.repeats + r])

    def later(r):
        text = texts[args.repeats + r]  # a sentence `payload` has just answered: still in the cache
        ex.calculation(text, "flash.walks", [0, source.flash_tile(args.tokens)])
        ex.calculation(text, "norm.calc", [0])

    server = make_server(ex, port=0)
    server.start_in_thread()
    sizes = []

    def http_post(r):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
        body = json.dumps({"text": texts[2 * args.repeats + r]})
        conn.request("POST", "/api/trace", body=body, headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        data = res.read()
        assert res.status == 200, data[:200]
        json.loads(data)
        sizes.append(len(data))
        conn.close()

    rows = {}
    for name, fn in (("forward", forward), ("trace", trace), ("payload", payload), ("later", later), ("http", http_post)):
        rows[name] = median_time(fn, args.repeats)
    server.stop()

    base = rows["forward"][0]
    print(f"explorer recompute, preset {args.preset} ({model.num_params():,} weights), {args.tokens} tokens, "
          f"{args.threads} CPU threads, median of {args.repeats}")
    print(f"{'step':<10}{'wall s':>10}{'CPU s':>10}{'x forward':>12}{'of 1 s budget':>15}")
    for name, (t, c) in rows.items():
        print(f"{name:<10}{t:>10.4f}{c:>10.4f}{t / base:>12.1f}{t:>14.0%}")
    print(f"answer size: {statistics.median(sizes) / 1e6:.2f} MB of JSON")
    out = {"preset": args.preset, "tokens": args.tokens, "threads": args.threads, "repeats": args.repeats,
           "weights": model.num_params(), "seconds": {k: v[0] for k, v in rows.items()},
           "cpu_seconds": {k: v[1] for k, v in rows.items()},
           "ratio_to_forward": {k: v[0] / base for k, v in rows.items()},
           "budget_seconds": 1.0, "within_budget": rows["http"][0] < 1.0, "answer_bytes": int(statistics.median(sizes)),
           "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
