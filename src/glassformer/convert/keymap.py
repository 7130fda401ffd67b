"""The Llama key map by name, read off the one set of rules in families.py (LLAMA's rules,
shared by Mistral and Qwen2): nothing here restates a key.

Hugging Face's Llama keeps RoPE in the 'half' pair layout (rotate_half), which is ours by
default, so weights copy across unchanged; a model built with rope_pairs='interleaved'
has its Q and K rows permuted by the rules' rope_q / rope_k transforms.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..config import ModelConfig
from .families import LLAMA, family_named


def _every_llama_rule() -> list:
    """The rules of a Llama with every optional tensor (Q/K/V biases, an untied head), '{i}' unfilled."""
    # the fields the rule lists read: Llama's optional tensors on, the later families' switches off
    full = SimpleNamespace(qkv_bias=True, tie_embeddings=False, attn_bias=False, qk_norm=False)
    return LLAMA.global_rules(full) + LLAMA.layer_rules(full)


# Ours  ->  Hugging Face LlamaForCausalLM ("{i}" is the layer index), for reading and for docs/convert.md.
LLAMA_KEYS: dict[str, str] = {ours: rule.hf for rule in _every_llama_rule() for ours in rule.ours}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from any supported Hugging Face config.json dict (every family in FAMILIES),
    refusing by name what glassformer cannot express."""
    return family_named(hf.get("model_type")).config_from_hf(hf)


def config_from_hf_llama(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face Llama-family config.json dict (model_type llama if absent)."""
    return config_from_hf({"model_type": "llama", **hf})


def llama_state_from_hf(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a Hugging Face Llama-family state dict, by LLAMA's rules; every key
    must be used (recomputed buffers and a tied head aside), none missing."""
    rules = LLAMA.rules(config)
    used = {r.hf for r in rules}
    unused = [k for k in hf_state if k not in used and not LLAMA.ignored(k)
              and not (config.tie_embeddings and k == "lm_head.weight")]
    if unused:
        raise ValueError(f"unexpected keys in the Hugging Face checkpoint: {unused[:5]}{' ...' if len(unused) > 5 else ''}")
    missing = [r.hf for r in rules if r.hf not in hf_state]
    if missing:
        raise ValueError(f"keys missing from the Hugging Face checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        out.update(rule.to_ours(hf_state[rule.hf], config))
    return out
