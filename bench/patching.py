"""A full resid_pre patching grid (all layers × 64 positions) on the reference shape: the exact sweep
batched (many patches per forward) against one forward per patch, attribution patching against the
exact sweep (time ratio and Pearson correlation), and, when TransformerLens is importable, the same
grid through its TransformerBridge over our Hugging Face export (time ratio and largest difference).

    python bench/patching.py [--threads 2] [--repeats 3] [--tl-path DIR]   # bench/results/patching.json

--tl-path: a folder holding transformer_lens (e.g. `pip install --target DIR transformer-lens==4.3.0`)
when it is not installed in the environment.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"
T = 64
ANSWER, WRONG = 1, 2


def texts(vocab: int):
    """64 random ids (clean) and the same with four positions changed (corrupt): a grid with structure."""
    import torch

    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, vocab, (T,), generator=g)
    corrupt = clean.clone()
    for p in (5, 20, 40, 60):
        corrupt[p] = torch.randint(3, vocab, (1,), generator=g)
    return clean.tolist(), corrupt.tolist()


def timed(fn, repeats: int):
    """(median wall seconds, median CPU seconds of this process, fn's result): on a shared machine the
    wall time counts the waits for a core; the CPU time does not."""
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu), out


def through_transformer_lens(model, clean, corrupt, repeats: int) -> dict:
    """The same grid through TransformerLens's get_act_patch_resid_pre on a TransformerBridge booted
    from our Hugging Face export (one forward per patch, its own loop)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge

    from glassformer.checkpoint.folders import save_model
    from glassformer.cli import main as cli
    from glassformer.text.tokenizer import Tokenizer

    folder = Path(tempfile.mkdtemp())
    tok = Tokenizer.train(["a tokenizer only so the export has one " * 20], vocab_size=300)  # the bridge wants one
    save_model(folder / "ckpt", model, tok)
    assert cli(["convert", "--to-hf", str(folder / "ckpt"), "--out", str(folder / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(folder / "hf", attn_implementation="eager", dtype=torch.float32)
    bridge = TransformerBridge.boot_transformers(str(folder / "hf"), hf_model=hf, device="cpu")
    c, k = torch.tensor([clean]), torch.tensor([corrupt])
    with torch.no_grad():
        _, cache = bridge.run_with_cache(c)

    def metric(logits):
        return logits[0, -1, ANSWER] - logits[0, -1, WRONG]

    seconds, cpu, grid = timed(lambda: patching.get_act_patch_resid_pre(bridge, k, cache, metric), repeats)
    grid = grid.tensor if hasattr(grid, "tensor") else grid
    return {"seconds": seconds, "cpu_s": cpu, "grid": torch.as_tensor(grid).float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tl-path", default=None, help="a folder to import transformer_lens from")
    ap.add_argument("--no-tl", action="store_true", help="skip TransformerLens")
    ap.add_argument("--skip-single", action="store_true",
                    help="skip the one-forward-per-patch sweep (keep the figures an earlier run wrote to --out)")
    ap.add_argument("--out", default=str(RESULTS / "patching.json"))
    args = ap.parse_args()
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.config import REFERENCE_SHAPE
    from glassformer.research.patching import attribution, exact, pearson, record, rows_per_forward, site_probe

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).eval()
    cfg = model.config
    clean, corrupt = texts(cfg.vocab_size)
    names = [site_probe(cfg, "resid_pre", i) for i in range(cfg.n_layers)]
    acts, _ = record(model, clean, names)
    batch = rows_per_forward(cfg, T)

    def sweep(rows):
        a, w = exact(model, clean, corrupt, ANSWER, WRONG, "resid_pre", rows, acts)
        return a - w

    batched = timed(lambda: sweep(None), args.repeats)
    single = None if args.skip_single else timed(lambda: sweep(1), 1)
    attr = timed(lambda: attribution(model, clean, corrupt, ANSWER, WRONG, "resid_pre", acts), args.repeats)
    grid, (terms, corrupt_metric) = batched[2], attr[2]
    r = pearson(grid, corrupt_metric + terms)
    out = Path(args.out)
    result = json.loads(out.read_text()) if args.skip_single and out.exists() else {}
    result.update({
        "shape": "reference (6 layers, dim 384, 6 heads, 2 kv heads, ffn 1024, vocab 8192)", "threads": args.threads,
        "site": "resid_pre", "grid": [cfg.n_layers, T], "patches": cfg.n_layers * T, "patches_per_forward": batch,
        "exact_batched_s": batched[0], "exact_batched_cpu_s": batched[1],
        "attribution_s": attr[0], "attribution_cpu_s": attr[1],
        "exact_over_attribution_cpu": batched[1] / attr[1], "exact_over_attribution_wall": batched[0] / attr[0],
        "attribution_pearson": r,
        "note": "clean activations recorded once, outside the timings (both methods read them); ratios from CPU "
                "seconds of this process (the wall seconds count waits for a core on a shared machine)",
    })
    print(f"resid_pre grid {cfg.n_layers}x{T}: batched {batched[1]:.2f} CPU s ({batch} patches per forward); attribution "
          f"{attr[1]:.3f} CPU s ({batched[1] / attr[1]:.0f}x less than exact), Pearson r {r:.4f}", flush=True)
    if single is not None:
        result.update({"exact_one_per_patch_s": single[0], "exact_one_per_patch_cpu_s": single[1],
                       "batched_speedup_cpu": single[1] / batched[1], "batched_speedup_wall": single[0] / batched[0],
                       "batched_vs_one_per_patch_max_diff": float((grid - single[2]).abs().max())})
        print(f"one forward per patch {single[1]:.2f} CPU s: batched is {single[1] / batched[1]:.1f}x less", flush=True)
    write_json(args.out, result)
    if not args.no_tl:
        if args.tl_path:
            sys.path.insert(0, args.tl_path)
        try:
            import transformer_lens  # noqa: F401
        except ImportError:
            result["transformer_lens"] = "not importable: give --tl-path DIR or install transformer-lens"
        else:
            tl = through_transformer_lens(model, clean, corrupt, 1)
            diff = float((tl["grid"] - grid).abs().max())
            result["transformer_lens"] = {"seconds": tl["seconds"], "cpu_s": tl["cpu_s"],
                                          "over_ours_batched_cpu": tl["cpu_s"] / batched[1],
                                          "over_ours_one_per_patch_cpu": (tl["cpu_s"] / result["exact_one_per_patch_cpu_s"]
                                                                          if "exact_one_per_patch_cpu_s" in result else None),
                                          "max_grid_diff": diff}
            print(f"TransformerLens get_act_patch_resid_pre: {tl['cpu_s']:.2f} CPU s ({tl['cpu_s'] / batched[1]:.1f}x ours "
                  f"batched); largest grid difference {diff:.2e}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
