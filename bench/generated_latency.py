"""How long the explorer's Generate button takes to answer: POST /api/generate at a 50,257-token vocabulary.

The `small` preset with GPT-2's vocabulary (50,257 ids), a prompt of --tokens tokens, CPU, for
8, 24 and 48 new tokens (the preset's context is 64). Side by side in one process:
  generate     list(generate(...)): the same tokens alone, the peer the answer's tokens equal
  part         viewer/generated.py's part alone: one full forward, then each token's probabilities,
               alternatives, sampler's stages and calculations
  answer       POST /api/generate: generate, the trace of the whole text, the page's data and the
               part, as JSON, parsed
Each is the median of --repeats runs (the seed changes every run).

    python bench/generated_latency.py [--tokens 16] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from pathlib import Path

import torch

from _common import median_ms, write_json
from glassformer import ModelConfig, Transformer
from glassformer.generation import generate
from glassformer.viewer import source
from glassformer.viewer.generated import full_logits, generated_part
from glassformer.viewer.server import make_server

VOCAB = 50257
NEW = (8, 24, 48)


class NumberTokenizer:
    """Text '17 4 99 …' <-> ids: the benchmark needs token ids, not a trained vocabulary."""

    eot_id = None

    def encode(self, text):
        return [int(w) for w in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def id_to_piece(self, i):
        return f"t{i}"


def settings(r: int) -> dict:
    return dict(temperature=0.9, top_k=50, top_p=0.95, min_p=None, repetition_penalty=1.1, seed=r)


def post(server, body: dict) -> bytes:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
    conn.request("POST", "/api/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    res = conn.getresponse()
    data = res.read()
    conn.close()
    assert res.status == 200, data[:200]
    json.loads(data)
    return data


def measure(model, server, ids, text, n, repeats) -> dict:
    """The three timings (ms) and the answer's size (kB) for n new tokens."""
    sizes = []

    def gen(r):
        list(generate(model, ids, max_new_tokens=n, **settings(r)))

    def part(r):
        new = list(generate(model, ids, max_new_tokens=n, **settings(r)))
        generated_part(full_logits(model, ids + new), ids, new, settings(r), str)

    def answer(r):
        sizes.append(len(post(server, {"text": text, "max_tokens": n, **settings(r)})))

    out = {name: median_ms(fn, repeats) for name, fn in (("generate", gen), ("part", part), ("answer", answer))}
    out["part"] -= out["generate"]  # the part's own cost, beyond the generation it reads
    return {**out, "kB": statistics.median(sizes) / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generated_latency.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset(args.preset, vocab_size=VOCAB)).eval()
    ids = torch.randint(0, VOCAB, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    text = " ".join(map(str, ids))
    server = make_server(source.explorer(model, NumberTokenizer(), text, model_name=args.preset), port=0)
    server.start_in_thread()
    post(server, {"text": text, "max_tokens": 4})  # warm-up
    rows = {n: measure(model, server, ids, text, n, args.repeats) for n in NEW}
    server.stop()
    print(f"Generate in the explorer, preset {args.preset} with {VOCAB:,} ids ({model.num_params():,} weights), "
          f"a {args.tokens}-token prompt, {args.threads} CPU threads, median of {args.repeats}")
    print(f"{'new':>4}{'generate ms':>13}{'part ms':>10}{'answer ms':>11}{'answer kB':>11}")
    for n, r in rows.items():
        print(f"{n:>4}{r['generate']:>13.0f}{r['part']:>10.0f}{r['answer']:>11.0f}{r['kB']:>11.0f}")
    write_json(args.out, {"preset": args.preset, "vocab_size": VOCAB, "tokens": args.tokens, "threads": args.threads,
                          "repeats": args.repeats, "rows": {str(n): r for n, r in rows.items()}})


if __name__ == "__main__":
    main()
