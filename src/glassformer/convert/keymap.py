"""Declarative key map between Hugging Face Llama-family names and ours.

Hugging Face's Llama keeps RoPE in the 'half' pair layout (rotate_half), which is ours by
default, so weights copy across unchanged: no permutation of Q and K rows is needed.
"""

from __future__ import annotations

import re
from typing import Any

from ..config import ModelConfig

# Ours  <->  Hugging Face LlamaForCausalLM ("{i}" is the layer index).
LLAMA_KEYS: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "blocks.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blocks.{i}.attn.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blocks.{i}.attn.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blocks.{i}.attn.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blocks.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blocks.{i}.attn.wq.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blocks.{i}.attn.wk.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blocks.{i}.attn.wv.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blocks.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blocks.{i}.ffn.w_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blocks.{i}.ffn.w_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blocks.{i}.ffn.w_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_FROM_HF = [(_pattern(hf), ours) for ours, hf in LLAMA_KEYS.items()]


def hf_to_ours_key(key: str) -> str | None:
    for pat, ours in _FROM_HF:
        m = pat.match(key)
        if m:
            return ours.replace("{i}", m.group(1)) if m.groups() else ours
    return None


def hf_rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either era: transformers < 5 writes
    `rope_theta` and `rope_scaling`, transformers >= 5 one `rope_parameters` dict.
    A scaling whose type is 'default' is plain RoPE and comes back as None."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(hf.get("rope_scaling") or params)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, scaling


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from any supported Hugging Face config.json dict (llama, mistral, qwen2, gpt2),
    refusing by name what glassformer cannot express."""
    from .families import family_named

    return family_named(hf.get("model_type")).config_from_hf(hf)


def config_from_hf_llama(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face Llama-family config.json dict (model_type llama if absent)."""
    return config_from_hf({"model_type": "llama", **hf})


def llama_state_from_hf(hf_state: dict, config: ModelConfig) -> dict:
    """Rename a Hugging Face Llama state dict to ours; every key must be used, none missing."""
    out, unused = {}, []
    for key, tensor in hf_state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer recomputed from the config
        ours = hf_to_ours_key(key)
        if ours is None:
            unused.append(key)
        else:
            out[ours] = tensor
    if unused:
        raise ValueError(f"unexpected keys in the Hugging Face checkpoint: {unused[:5]}{' ...' if len(unused) > 5 else ''}")
    if config.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out
