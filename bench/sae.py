"""SAE training tokens/s on the reference shape: a TopK SAE on blocks.3.hook_resid_pre (width 384),
timed three ways: the whole `sae train` loop (the model's forwards up to the site, then the SAE's
steps), the harvest alone (forwards stopped at the site) and the SAE's optimizer steps alone on
activations already in memory. The model has random weights and reads random tokens: speed only.
--induction instead trains one on a trained model, the induction-heads demo (tests/data/induction_demo),
over 14-letter random strings each written twice, and reports what it learnt (explained variance, L0,
dead features) and what its most frequent features promote.

    python bench/sae.py [--threads 2] [--features 3072] [--k 32] [--tokens 131072] [--device cpu]
    # bench/results/sae.json
    python bench/sae.py --induction   # bench/results/sae_induction.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SITE = "blocks.3.hook_resid_pre"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--features", type=int, default=3072, help="the SAE's width (8 x 384 by default)")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=131072, help="training tokens of the timed run")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--induction", action="store_true", help="the trained demo model's SAE instead (see above)")
    ap.add_argument("--out", default=None, help="default bench/results/sae.json (sae_induction.json with --induction)")
    args = ap.parse_args()
    if args.induction:
        return induction(args)
    args.out = args.out or str(RESULTS / "sae.json")
    import numpy as np
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.config import REFERENCE_SHAPE
    from glassformer.research.sae import Trainer, TrainSettings, chunk_generator, resolve_site

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).to(args.device).eval()
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 1 << 20).astype(np.int64)
    site = resolve_site(model, SITE)
    settings = TrainSettings(features=args.features, k=args.k, tokens=args.tokens, batch_tokens=args.batch_tokens,
                             context=args.context, eval_tokens=args.batch_tokens)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model, site, ids, ids, settings, Path(tmp) / "sae", device=args.device)
        result = trainer.train(progress=False)  # its own clock: the chunks' harvest and steps, saves included
        # the two parts apart, on one chunk: the harvest, then the SAE's steps over what it harvested
        fresh = Trainer(model, site, ids, ids, settings, Path(tmp) / "parts", device=args.device)
        sync()
        t = time.perf_counter()
        acts = fresh._chunk_acts(ids, settings.chunk_tokens, chunk_generator(0, 0))
        sync()
        harvest_s = time.perf_counter() - t
        fresh.sae.initialize(torch.Generator().manual_seed(0), acts.mean(0).cpu())
        fresh._train_step(acts[:settings.batch_tokens])  # warm-up
        sync()
        t = time.perf_counter()
        for b in range(1, settings.chunk_batches):
            fresh._train_step(acts[b * settings.batch_tokens:(b + 1) * settings.batch_tokens])
        sync()
        step_s = (time.perf_counter() - t) / (settings.chunk_batches - 1)
    out = {
        "shape": "reference (6 layers, dim 384, 6 heads, 2 kv heads, ffn 1024, vocab 8192)", "site": SITE,
        "device": args.device, "threads": args.threads, "features": args.features, "k": args.k,
        "batch_tokens": args.batch_tokens, "context": args.context, "tokens": result["tokens"],
        "train_tokens_per_s": result["tokens_per_s"], "harvest_tokens_per_s": settings.chunk_tokens / harvest_s,
        "sae_step_tokens_per_s": args.batch_tokens / step_s, "sae_step_ms": step_s * 1e3,
        "explained_variance": result["explained_variance"], "l0": result["l0"], "dead_features": result["dead_features"],
        "load_average_1min": os.getloadavg()[0],  # other work on the machine: the figures scale with it on a shared CPU
    }
    print(f"SAE {args.features} features, k {args.k} on {SITE} ({args.device}, {args.threads} threads): "
          f"sae train {out['train_tokens_per_s']:,.0f} tokens/s end to end; harvest alone "
          f"{out['harvest_tokens_per_s']:,.0f} tokens/s; SAE steps alone {out['sae_step_tokens_per_s']:,.0f} tokens/s "
          f"({out['sae_step_ms']:.1f} ms per {args.batch_tokens}-token step)")
    write_json(args.out, out)


def induction(args) -> None:
    """512 features, k 8, on the stream leaving the demo model's last block, 262,144 tokens."""
    import contextlib
    import io
    import json
    import random

    import torch

    from glassformer.cli import main as cli

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    rows = ["".join(rng.choice(letters) for _ in range(14)) for _ in range(1500)]
    demo = Path(__file__).resolve().parents[1] / "tests" / "data" / "induction_demo"
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "repeats.txt"
        data.write_text("".join(r + r + "\n" for r in rows))
        common = ["--checkpoint", str(demo), "--data", str(data)]
        argv = ["sae", "train", *common, "--site", "blocks.1.hook_resid_post", "--features", "512", "--k", "8",
                "--tokens", "262144", "--batch-tokens", "1024", "--context", "64", "--lr", "1e-3", "--dead-tokens",
                "50000", "--out", str(Path(tmp) / "sae"), "--no-progress", "--json"]

        def last_json(cmd):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert cli(cmd) == 0
            return json.loads(out.getvalue().strip().splitlines()[-1])

        trained = last_json(argv)
        report = last_json(["sae", "features", *common, "--sae", str(Path(tmp) / "sae"), "--tokens", "8192",
                            "--context", "64", "--top", "3", "--max-features", "8", "--json"])
    result = {"model": "tests/data/induction_demo", "site": trained["site"], "features": 512, "k": 8,
              "tokens": trained["tokens"], "explained_variance": trained["explained_variance"], "l0": trained["l0"],
              "dead_features": trained["dead_features"], "train_tokens_per_s": trained["tokens_per_s"],
              "threads": args.threads, "load_average_1min": os.getloadavg()[0],
              "frequent_features": [{"id": f["id"], "frequency": f["frequency"],
                                     "promotes": [t for t, _ in f["logits"]["top"][:3]]} for f in report["features"]]}
    print(f"induction demo, {trained['site']}, 512 features k 8: explained variance {trained['explained_variance']:.3f}, "
          f"L0 {trained['l0']:.1f}, dead {trained['dead_features']}; {trained['tokens_per_s']:,.0f} tokens/s")
    write_json(args.out or str(RESULTS / "sae_induction.json"), result)


if __name__ == "__main__":
    main()
