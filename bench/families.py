"""The dense families (docs/convert.md#families): batch-1 greedy decoding of each family's small model
against transformers on the same weights, read by glassformer from the folder transformers wrote.

Each model is the same size (hidden 256, 4 layers, 4 query and 2 key/value heads of 64, feed-forward
512, vocabulary 2048), random weights drawn larger than the init with norms around 1; 128 greedy
tokens after a 16-token prompt, both with their KV caches, alternating rounds, the best round (bench/moe.py's
decode_family, which the mixtures use too); the tokens must be identical. Gemma 2's and 3's windows
(64) are shorter than the 144 positions decoded, so their sliding layers slide.

    python bench/families.py [--rounds 3] [--threads 2] [--quick] [--out bench/results/families.json]
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
from _common import write_json  # bench/ is the script's folder
from moe import decode_family

RESULTS = Path(__file__).parent / "results"


def family_configs() -> dict:
    import transformers

    base = dict(vocab_size=2048, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=512, max_position_embeddings=1024, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "llama": transformers.LlamaConfig(**base),
        "qwen3": transformers.Qwen3Config(**base),
        "gemma2": transformers.Gemma2Config(**base, sliding_window=64, query_pre_attn_scalar=64),
        "gemma3_text": transformers.Gemma3TextConfig(**base, sliding_window=64, query_pre_attn_scalar=64),
        "olmo2": transformers.Olmo2Config(**base),
        "phi3": transformers.Phi3Config(**base),
        "smollm3": transformers.SmolLM3Config(**base),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--families", nargs="+", default=None, help="only these families (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds (a smoke run)")
    ap.add_argument("--out", default=str(RESULTS / "families.json"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.new_tokens = 1, 16
    torch.set_num_threads(args.threads)
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "rounds": args.rounds,
              "torch": torch.__version__, "decode": {}}
    for name, hc in family_configs().items():
        if args.families and name not in args.families:
            continue
        r = decode_family(name, hc, args.rounds, args.new_tokens)
        result["decode"][name] = r
        print(f"decode {name}: ours {r['ours_tok_s']} tok/s, transformers {r['hf_tok_s']} tok/s ({r['hf_attention']}), "
              f"ratio {r['ratio']}, same tokens {r['same_tokens']}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
