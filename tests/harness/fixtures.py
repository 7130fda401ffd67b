"""What the harness tests share: a tiny random Hugging Face Llama saved by transformers with a
small tokenizer, and harness tasks written here as YAML + JSONL (no download)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from ..support import WORDS, synthetic_text

CONTEXT = 32  # the fixture's context: long texts need several rolling windows


def tiny_hf_llama(folder: Path) -> Path:
    """A random Llama (large weights, so log-likelihoods are far from uniform) and our trained
    tokenizer, both written by transformers' own save_pretrained."""
    import transformers

    from glassformer.text.tokenizer import EOT, Tokenizer

    tok = Tokenizer.train([synthetic_text(400, 1)], vocab_size=300)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                                   bos_token_id=None, eos_token_id=tok.eot_id, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(folder, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tk, eos_token=EOT)
    fast.save_pretrained(folder)
    return folder


def _sentence(rng: random.Random, k: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(k))


def _yaml(task: str, data: Path, cache: Path, body: str) -> str:
    return (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"  cache_dir: {cache}\ntest_split: test\n{body}")


MC_BODY = """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
ROLLING_BODY = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_BODY = """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: [" the", "."]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, n_docs: int = 12) -> dict[str, Path]:
    """tiny_mc (2 to 4 choices of several words after a shared question), tiny_ppl (texts of
    several windows) and tiny_gen (greedy, stop strings): {task name: yaml path}."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    cache = folder / "datasets-cache"
    mc = [{"question": _sentence(rng, rng.randint(4, 14)) + " ?",
           "choices": [" " + _sentence(rng, rng.randint(1, 4)) for _ in range(2 + i % 3)],
           "label": i % 2} for i in range(n_docs)]
    ppl = [{"text": synthetic_text(rng.randint(2, 9), 10 + i)} for i in range(n_docs // 2)]
    gen = [{"question": _sentence(rng, rng.randint(3, 12)), "answer": " the"} for _ in range(n_docs // 2)]
    out = {}
    for name, rows, body in (("tiny_mc", mc, MC_BODY), ("tiny_ppl", ppl, ROLLING_BODY), ("tiny_gen", gen, GEN_BODY)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = folder / f"{name}.yaml"
        out[name].write_text(_yaml(name, data, cache, body))
    return out


def mc_docs(yaml_path: Path) -> list[dict]:
    """The multiple-choice task's documents, read back from its JSONL."""
    return [json.loads(line) for line in yaml_path.with_suffix(".jsonl").read_text().splitlines()]
