"""How long the explorer's sampling view takes to answer: POST /api/sample at a 50,257-token vocabulary.

The `small` preset with GPT-2's vocabulary (50,257 ids), a sentence of --tokens tokens, CPU.
Side by side in one process:
  generate     next(generate(...)): the first token alone, the peer the view's `chosen` equals
  stages       sampling_stages on one position's logits: every stage listed, the seeded draw
  moved        POST /api/sample after a control moved: the same position, new settings (its
               logits kept by the server), answer parsed
  new          POST /api/sample for a position not asked before: its prefill, then the stages
Each is the median of --repeats runs; the settings change every run (all filters on).
The target is under 100 ms for `moved` and `new`.

    python bench/sample_latency.py [--tokens 32] [--repeats 20] [--threads 2] [--quick]
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

from _common import median_ms, write_json
from glassformer import ModelConfig, Transformer
from glassformer.generation import generate
from glassformer.generation.sampling_stages import sampling_stages
from glassformer.viewer import source
from glassformer.viewer.server import make_server

VOCAB = 50257


class NumberTokenizer:
    """Text '17 4 99 …' <-> ids: the benchmark needs token ids, not a trained vocabulary."""

    def encode(self, text):
        return [int(w) for w in text.split()]

    def id_to_piece(self, i):
        return f"t{i}"


def settings(r: int) -> dict:
    """Every filter on, a little different each run (as a dragged slider gives)."""
    return dict(temperature=0.6 + 0.05 * (r % 10), top_k=40 + r, top_p=0.8 + 0.01 * (r % 10), min_p=0.02,
                repetition_penalty=1.2, seed=r)


def post(server, body: dict) -> bytes:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", "/api/sample", body=json.dumps(body), headers={"Content-Type": "application/json"})
    res = conn.getresponse()
    data = res.read()
    conn.close()
    assert res.status == 200, data[:200]
    json.loads(data)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="5 repeats (a quick check)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sample_latency.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats = 5
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(args.preset, vocab_size=VOCAB)).eval()
    ids = torch.randint(0, VOCAB, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    text = " ".join(map(str, ids))
    ex = source.explorer(model, NumberTokenizer(), text, model_name=args.preset)
    server = make_server(ex, port=0)
    server.start_in_thread()
    last = args.tokens - 1
    sizes = [len(post(server, {"text": text, "position": last, **settings(0)}))]  # warm-up; keeps its logits
    logits = ex.sampler._logits(ids)  # the kept logits of the last position

    def gen(r):
        next(generate(model, ids, max_new_tokens=1, **settings(r)))

    def stages(r):
        sampling_stages(logits, ids, **settings(r))

    def moved(r):
        sizes.append(len(post(server, {"text": text, "position": last, **settings(r)})))

    def new(r):  # a fresh position each run (runs beyond the sentence's length reuse none: they cycle)
        post(server, {"text": text, "position": r % last, **settings(r)})

    rows = {name: median_ms(fn, args.repeats) for name, fn in
            (("generate", gen), ("stages", stages), ("moved", moved), ("new", new))}
    server.stop()
    print(f"sampling view, preset {args.preset} with {VOCAB:,} ids ({model.num_params():,} weights), "
          f"{args.tokens} tokens, {args.threads} CPU threads, median of {args.repeats}")
    print(f"{'step':<10}{'ms':>10}{'x generate':>12}{'of 100 ms':>11}")
    for name, ms in rows.items():
        print(f"{name:<10}{ms:>10.1f}{ms / rows['generate']:>12.2f}{ms / 100:>11.0%}")
    print(f"answer size: {statistics.median(sizes) / 1e3:.1f} kB of JSON")
    write_json(args.out, {
        "preset": args.preset, "vocab_size": VOCAB, "tokens": args.tokens, "threads": args.threads,
        "repeats": args.repeats, "weights": model.num_params(), "ms": rows,
        "ratio_to_generate": {k: v / rows["generate"] for k, v in rows.items()}, "budget_ms": 100,
        "within_budget": {k: rows[k] < 100 for k in ("moved", "new")}, "answer_bytes": int(statistics.median(sizes)),
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__}})


if __name__ == "__main__":
    main()
