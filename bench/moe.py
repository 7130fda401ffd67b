"""Mixtures of experts: one forward of a mixture against a dense model of the same active weights, and
batch-1 greedy decoding of each mixture family's small model against transformers on the same weights.

1. Forward: the reference shape (bench/decode.py's) with its feed-forward (F = 1024) replaced by
   E = 8 experts of F = 512, top 2 (so 2 × 512 = 1024 active: the dense model's width), against the
   dense reference shape; a prompt-sized forward (1 × 512) and a batch (8 × 128), medians; ratio
   mixture / dense. The mixture adds the router (E·D a layer) and its gather/scatter of tokens.
2. Decode: for qwen3_moe, mixtral, olmoe and gpt_oss, a small random model built by transformers
   (hidden 256, 4 layers, 8 experts of 256, top 2; gpt-oss with a window of 64 on every other layer,
   shorter than the 144 positions decoded), read by glassformer from the folder transformers wrote;
   128 greedy tokens after a 16-token prompt, both with their KV caches, alternating rounds, the
   best round; the tokens must be identical.

    python bench/moe.py [--rounds 3] [--threads 2] [--quick] [--families mixtral ...] [--out bench/results/moe.json]
    python bench/moe.py --smoke    # tiny shapes, one family: the test suite's end-to-end run (no figures)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when a test loads this file
from _common import median_ms, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer, generate  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.convert import load_hf  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MOE_SHAPE = dict(REFERENCE_SHAPE, n_experts=8, n_active_experts=2, expert_dim=512)


def randomized(model: torch.nn.Module, std: float = 0.05) -> torch.nn.Module:
    """Weights redrawn larger than the init (argmax margins not all near-ties), norms around 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if p.ndim == 1 and "norm" in name else std * noise)
    return model.eval()


def forward_ratio(rounds: int, quick: bool, smoke: bool = False) -> dict:
    torch.manual_seed(0)
    small = dict(dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=128) if smoke else {}
    dense = randomized(Transformer(ModelConfig(**{**REFERENCE_SHAPE, **small})))
    moe = randomized(Transformer(ModelConfig(**{**MOE_SHAPE, **small, "expert_dim": 64 if smoke else 512})))
    out = {"dense_weights": dense.num_params(), "moe_weights": moe.num_params()}
    cfg = moe.config
    out["moe_active_weights"] = out["moe_weights"] - cfg.n_layers * (cfg.n_experts - cfg.n_active_experts) * 3 * cfg.dim * cfg.expert_width
    for B, T in ((1, 64),) if smoke else ((1, 512),) if quick else ((1, 512), (8, 128)):
        ids = torch.randint(0, cfg.vocab_size, (B, T))
        ms = {}
        with torch.inference_mode():
            for name, m in (("dense", dense), ("moe", moe)):
                m(ids)  # warm up
            for _ in range(rounds):  # alternate, so a change in machine speed hits both
                for name, m in (("dense", dense), ("moe", moe)):
                    ms.setdefault(name, []).append(median_ms(lambda r: m(ids), 3 if quick else 5))
        best = {k: min(v) for k, v in ms.items()}
        out[f"{B}x{T}"] = {"dense_ms": round(best["dense"], 2), "moe_ms": round(best["moe"], 2),
                           "ratio": round(best["moe"] / best["dense"], 3)}
    return out


def family_configs(smoke: bool = False) -> dict:
    import transformers

    base = dict(vocab_size=2048, hidden_size=64 if smoke else 256, num_hidden_layers=2 if smoke else 4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False, num_experts_per_tok=2,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**base, intermediate_size=512, moe_intermediate_size=256,
                                                 num_experts=8, norm_topk_prob=True),
        "mixtral": transformers.MixtralConfig(**base, intermediate_size=256, num_local_experts=8),
        "olmoe": transformers.OlmoeConfig(**base, intermediate_size=256, num_experts=8),
        "gpt_oss": transformers.GptOssConfig(**base, intermediate_size=256, num_local_experts=8, sliding_window=64),
    }


def decode_family(name: str, hc, rounds: int, new_tokens: int, prompt_tokens: int = 16) -> dict:
    import transformers

    torch.manual_seed(0)
    # transformers' fastest CPU attention where the family has it (gpt-oss's sinks have no sdpa path there)
    attn = "eager" if name == "gpt_oss" else "sdpa"
    try:
        hf = transformers.AutoModelForCausalLM.from_config(hc, attn_implementation=attn, dtype=torch.float32)
    except ValueError:  # a family with no sdpa path in transformers (Gemma 2's soft cap)
        hf = transformers.AutoModelForCausalLM.from_config(hc, attn_implementation="eager", dtype=torch.float32)
    hf = randomized(hf)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours, _ = load_hf(tmp)
    ours.eval()
    prompt = torch.randint(0, hc.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(1))
    hf.generation_config.eos_token_id = None

    def mine():
        return list(generate(ours, prompt[0], max_new_tokens=new_tokens, greedy=True))

    def theirs():
        with torch.inference_mode():
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[0, prompt_tokens:].tolist()

    runs = {"ours": mine, "hf": theirs}
    tokens = {k: fn() for k, fn in runs.items()}  # warm up
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):  # alternate, so a change in machine speed hits both
        for k, fn in runs.items():
            t0 = time.perf_counter()
            tokens[k] = fn()
            times[k].append(time.perf_counter() - t0)
    tok_s = {k: new_tokens / min(v) for k, v in times.items()}
    return {"ours_tok_s": round(tok_s["ours"], 1), "hf_tok_s": round(tok_s["hf"], 1),
            "ratio": round(tok_s["ours"] / tok_s["hf"], 3), "same_tokens": tokens["ours"] == tokens["hf"],
            "hf_attention": hf.config._attn_implementation, "weights": ours.num_params()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--families", nargs="+", default=None, help="only these families' decode (default: all four)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and one family (mixtral): the end-to-end test")
    ap.add_argument("--out", default=str(RESULTS / "moe.json"))
    args = ap.parse_args(argv)
    if args.quick or args.smoke:
        args.rounds, args.new_tokens = 1, 8 if args.smoke else 16
    if args.smoke:
        args.families = args.families or ["mixtral"]
    torch.set_num_threads(args.threads)
    # The machine's load average before and after: on a shared machine the ratios hold better than the speeds.
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "rounds": args.rounds,
              "torch": torch.__version__, "load_average_before": [round(x, 2) for x in os.getloadavg()],
              "forward": forward_ratio(args.rounds, args.quick, args.smoke), "decode": {}}
    f = result["forward"]
    for shape in [k for k in f if "x" in k and isinstance(f[k], dict)]:
        print(f"forward {shape}: dense {f[shape]['dense_ms']} ms, mixture {f[shape]['moe_ms']} ms, "
              f"ratio {f[shape]['ratio']} (same active weights)")
    for name, hc in family_configs(args.smoke).items():
        if args.families and name not in args.families:
            continue
        r = decode_family(name, hc, args.rounds, args.new_tokens)
        result["decode"][name] = r
        print(f"decode {name}: ours {r['ours_tok_s']} tok/s, transformers {r['hf_tok_s']} tok/s, ratio {r['ratio']}, "
              f"same tokens {r['same_tokens']}")
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
