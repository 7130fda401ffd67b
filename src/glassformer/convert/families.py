"""Per-family key maps between Hugging Face checkpoints and ours.

A family is a `model_type` of Hugging Face `transformers`: how its config.json maps onto a
ModelConfig (both ways) and a declarative list of rules, one per Hugging Face tensor, each
naming the tensor on both sides and the transform between them (transforms.py). Run on meta
tensors the rules also give every tensor's shape: docs/convert.md#the-key-map-and-its-transforms.

Dense families: llama, mistral, qwen2, gpt2, and those of issue 45 (qwen3, gemma2, gemma3_text,
olmo2, phi3, smollm3), each with what it adds to the block (docs/convert.md#families).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..errors import UserError
from .family_base import (  # noqa: F401  (Family and hf_rope are imported from here by other modules)
    ANY, Family, build, check_rope_scaling, hf_rope, layer_types_out, layer_windows, need, partial_rotary,
    refuse_switches, rope_fields,
)
from .transforms import R, Rule


# ----------------------------------------------------------------------------- rules

P, O = "model.layers.{i}.", "blocks.{i}."  # a llama-like layer's prefix in Hugging Face's names, and ours


def _llama_global(cfg: ModelConfig) -> list[Rule]:
    rules = [R("model.embed_tokens.weight", "embed.weight"), R("model.norm.weight", "final_norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight"))
    return rules


def _attn_rules(cfg: ModelConfig, fused: bool = False) -> list[Rule]:
    """One llama-like attention: q/k/v (or Phi-3's fused qkv_proj), their biases (Qwen2's qkv_bias,
    attention_bias's), the q/k norms (a head's: Qwen3, Gemma 3; the projection's: OLMo 2), o_proj."""
    a, o = P + "self_attn.", O + "attn."
    if fused:
        rules = [R(a + "qkv_proj.weight", o + "wq.weight", o + "wk.weight", o + "wv.weight", transform="qkv_fused")]
    else:
        rules = [
            R(a + "q_proj.weight", o + "wq.weight", transform="rope_q"),
            R(a + "k_proj.weight", o + "wk.weight", transform="rope_k"),
            R(a + "v_proj.weight", o + "wv.weight"),
        ]
    if cfg.qkv_bias or cfg.attn_bias:
        rules += [
            R(a + "q_proj.bias", o + "wq.bias", transform="rope_q"),
            R(a + "k_proj.bias", o + "wk.bias", transform="rope_k"),
            R(a + "v_proj.bias", o + "wv.bias"),
        ]
    if cfg.qk_norm in ("head", "proj"):  # the norm's weight follows the rows it scales
        head = cfg.qk_norm == "head"
        rules += [
            R(a + "q_norm.weight", o + "q_norm.weight", transform="rope_head" if head else "rope_q"),
            R(a + "k_norm.weight", o + "k_norm.weight", transform="rope_head" if head else "rope_k"),
        ]
    rules.append(R(a + "o_proj.weight", o + "wo.weight"))
    if cfg.attn_bias:
        rules.append(R(a + "o_proj.bias", o + "wo.bias"))
    return rules


def _mlp_rules(cfg: ModelConfig, fused: bool = False) -> list[Rule]:
    m, f = P + "mlp.", O + "ffn."
    if fused:  # Phi-3
        rules = [R(m + "gate_up_proj.weight", f + "w_gate.weight", f + "w_up.weight", transform="gate_up_fused")]
    else:
        rules = [R(m + "gate_proj.weight", f + "w_gate.weight"), R(m + "up_proj.weight", f + "w_up.weight")]
    return rules + [R(m + "down_proj.weight", f + "w_down.weight")]


def _llama_layer(cfg: ModelConfig) -> list[Rule]:
    """Llama, Mistral, Qwen2, Qwen3, SmolLM3: pre-norms around a llama attention and SwiGLU."""
    return [R(P + "input_layernorm.weight", O + "attn_norm.weight"), *_attn_rules(cfg),
            R(P + "post_attention_layernorm.weight", O + "ffn_norm.weight"), *_mlp_rules(cfg)]


def _phi3_layer(cfg: ModelConfig) -> list[Rule]:
    return [R(P + "input_layernorm.weight", O + "attn_norm.weight"), *_attn_rules(cfg, fused=True),
            R(P + "post_attention_layernorm.weight", O + "ffn_norm.weight"), *_mlp_rules(cfg, fused=True)]


def _gemma_layer(cfg: ModelConfig) -> list[Rule]:
    """Gemma 2/3: a norm before and after each sublayer ("sandwich")."""
    return [
        R(P + "input_layernorm.weight", O + "attn_norm.weight"), *_attn_rules(cfg),
        R(P + "post_attention_layernorm.weight", O + "attn_post_norm.weight"),
        R(P + "pre_feedforward_layernorm.weight", O + "ffn_norm.weight"), *_mlp_rules(cfg),
        R(P + "post_feedforward_layernorm.weight", O + "ffn_post_norm.weight"),
    ]


def _olmo2_layer(cfg: ModelConfig) -> list[Rule]:
    """OLMo 2: the norms sit on each sublayer's output, before the addition; the names keep their 'post'."""
    return [*_attn_rules(cfg), R(P + "post_attention_layernorm.weight", O + "attn_norm.weight"),
            *_mlp_rules(cfg), R(P + "post_feedforward_layernorm.weight", O + "ffn_norm.weight")]


# ----------------------------------------------------------------------------- config.json -> ModelConfig


def _sizes(hf: dict, family: str, defaults: dict) -> dict:
    """The sizes every llama-like config.json spells the same way."""
    n_heads = need(hf, "num_attention_heads", family)
    dim = need(hf, "hidden_size", family)
    return dict(
        vocab_size=need(hf, "vocab_size", family),
        dim=dim,
        n_layers=need(hf, "num_hidden_layers", family),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or (dim // n_heads if isinstance(dim, int) and isinstance(n_heads, int) and n_heads else None),
        ffn_dim=need(hf, "intermediate_size", family),
        max_seq_len=hf.get("max_position_embeddings") or defaults["max_position_embeddings"],
        norm_eps=hf.get("rms_norm_eps") or defaults["rms_norm_eps"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False))),
    )


def _llama_like_config(hf: dict, family: str, defaults: dict, **extra) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json: hidden_act {act!r} in a {family} model; glassformer's SwiGLU uses silu")
    if hf.get("mlp_bias"):
        raise UserError(f"config.json: mlp_bias=true in a {family} model is not supported (no MLP biases in glassformer's SwiGLU)")
    theta, scaling = hf_rope(hf)
    check_rope_scaling(scaling)
    return build(family, **_sizes(hf, family, defaults), rope_theta=theta, rope_scaling=scaling,
                 norm="rms", ffn="swiglu", pos="rope", rope_pairs="half", **extra)


def _llama_from_hf(hf: dict) -> ModelConfig:
    if hf.get("attention_bias"):
        # Llama's attention_bias puts a bias on o_proj too; glassformer has Q/K/V biases or biases everywhere.
        raise UserError("config.json: attention_bias=true in a llama model (biases on q/k/v/o_proj) is not supported")
    return _llama_like_config(hf, "llama", LLAMA.defaults)


def _mistral_from_hf(hf: dict) -> ModelConfig:
    return _llama_like_config(hf, "mistral", MISTRAL.defaults, sliding_window=hf.get("sliding_window"))


def qwen2_layer_types(hf: dict) -> list[str]:
    """Each layer's kind in a Qwen2 config: `layer_types` where transformers wrote it out, else
    sliding on the layers i >= max_window_layers when use_sliding_window is true (Qwen2's rule)."""
    n = need(hf, "num_hidden_layers", "qwen2")
    if hf.get("layer_types") is not None:
        return hf["layer_types"]
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return ["full_attention"] * n
    first = hf.get("max_window_layers", 28)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


def _qwen2_from_hf(hf: dict) -> ModelConfig:
    n = need(hf, "num_hidden_layers", "qwen2")
    window, types = layer_windows(qwen2_layer_types(hf), hf.get("sliding_window") if hf.get("use_sliding_window")
                                  else None, n, "qwen2")
    return _llama_like_config(hf, "qwen2", QWEN2.defaults, qkv_bias=True, sliding_window=window, layer_types=types)


# What any new family refuses by name wherever the field appears with another value: each changes the
# computation (clip_qkv clamps Q/K/V: OLMo 1; mlp_bias adds MLP biases; bidirectional attention drops
# the causal mask: EmbeddingGemma).
_NEVER = {"clip_qkv": None, "mlp_bias": False, "use_bidirectional_attention": False, "qk_layernorm": False,
          "use_qk_norm": False, "residual_multiplier": 1.0, "embedding_multiplier": 1.0, "logits_scaling": 1.0}
_ROPES = ("llama3", "linear", "yarn")  # the scalings glassformer computes (rope_scaling.py)


def _rope(hf: dict, family: str) -> dict:
    """rope_theta and rope_scaling for a new family, refusing partial rotation and unknown scalings by name;
    YaRN without its original context takes max_position_embeddings, as transformers does."""
    partial_rotary(hf, family)
    theta, scaling = hf_rope(hf)
    scaling = _checked_scaling(scaling, hf, family)
    return dict(rope_theta=theta, rope_scaling=scaling)


def _checked_scaling(scaling: dict | None, hf: dict, family: str) -> dict | None:
    if scaling is None:
        return None
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("longrope", "su"):
        raise UserError(f"config.json asks for RoPE scaling {kind!r} (LongRoPE: Phi-3's 128k models) in a {family} "
                        f"model, which glassformer does not implement (supported: {', '.join(_ROPES)}, or none)")
    check_rope_scaling(scaling, _ROPES)
    if kind == "yarn" and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = need(hf, "max_position_embeddings", family)
    return scaling


def _act(hf: dict, family: str, key: str, allowed: str) -> None:
    act = hf.get(key) or allowed
    if act != allowed:
        raise UserError(f"config.json: {key} {act!r} in a {family} model is not supported (glassformer computes {allowed})")


def _qwen3_from_hf(hf: dict) -> ModelConfig:
    refuse_switches(hf, "qwen3", _NEVER)
    _act(hf, "qwen3", "hidden_act", "silu")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    n = need(hf, "num_hidden_layers", "qwen3")
    types = hf.get("layer_types")
    if types is None and window is not None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    window, types = layer_windows(types, window, n, "qwen3")
    return build("qwen3", **_sizes(hf, "qwen3", QWEN3.defaults), **_rope(hf, "qwen3"), norm="rms", ffn="swiglu",
                 pos="rope", qk_norm="head", attn_bias=bool(hf.get("attention_bias")), sliding_window=window,
                 layer_types=types)


def _smollm3_from_hf(hf: dict) -> ModelConfig:
    refuse_switches(hf, "smollm3", _NEVER)
    _act(hf, "smollm3", "hidden_act", "silu")
    n = need(hf, "num_hidden_layers", "smollm3")
    flags = hf.get("no_rope_layers")
    if flags is None:
        every = hf.get("no_rope_layer_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UserError(f"config.json: no_rope_layer_interval={every!r} in a smollm3 model is not a positive whole number")
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise UserError(f"config.json: no_rope_layers of a smollm3 model must list {n} entries, each 0 (no RoPE) or 1; "
                        f"got {str(flags)[:80]}")
    types = hf.get("layer_types")
    if types is None:
        slide = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
        types = ["sliding_attention" if slide and not flags[i] else "full_attention" for i in range(n)]
    window, types = layer_windows(types, hf.get("sliding_window"), n, "smollm3")
    nope = [i for i, f in enumerate(flags) if f == 0]
    return build("smollm3", **_sizes(hf, "smollm3", SMOLLM3.defaults), **_rope(hf, "smollm3"), norm="rms",
                 ffn="swiglu", pos="rope", nope_layers=nope or None, attn_bias=bool(hf.get("attention_bias")),
                 sliding_window=window, layer_types=types)


def _olmo2_from_hf(hf: dict) -> ModelConfig:
    refuse_switches(hf, "olmo2", _NEVER)
    _act(hf, "olmo2", "hidden_act", "silu")
    return build("olmo2", **_sizes(hf, "olmo2", OLMO2.defaults), **_rope(hf, "olmo2"), norm="rms", ffn="swiglu",
                 pos="rope", norm_placement="post_branch", qk_norm="proj", attn_bias=bool(hf.get("attention_bias")))


def _phi3_from_hf(hf: dict) -> ModelConfig:
    refuse_switches(hf, "phi3", _NEVER)
    _act(hf, "phi3", "hidden_act", "silu")
    return build("phi3", **_sizes(hf, "phi3", PHI3.defaults), **_rope(hf, "phi3"), norm="rms", ffn="swiglu",
                 pos="rope", sliding_window=hf.get("sliding_window"))


def _gemma_from_hf(hf: dict, family: str, defaults: dict, **extra) -> ModelConfig:
    """What Gemma 2 and Gemma 3 share: (1 + w) norms before and after each sublayer, GeGLU, embeddings
    times √D, query_pre_attn_scalar, soft caps, and sliding layers by layer_types."""
    refuse_switches(hf, family, _NEVER)
    _act(hf, family, "hidden_activation" if hf.get("hidden_activation") else "hidden_act", "gelu_pytorch_tanh")
    n = need(hf, "num_hidden_layers", family)
    types = hf.get("layer_types")
    if types is None:  # older config.json files: every `pattern`-th layer is global (Gemma 2: every other)
        every = hf.get("sliding_window_pattern", defaults["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    window, types = layer_windows(types, hf.get("sliding_window"), n, family)
    scalar = hf.get("query_pre_attn_scalar", defaults["query_pre_attn_scalar"])
    return build(family, **_sizes(hf, family, defaults), norm="rms", norm_offset=True, norm_placement="sandwich",
                 ffn="geglu", pos="rope", embed_scale=True, attn_bias=bool(hf.get("attention_bias")),
                 query_pre_attn_scalar=None if scalar is None else float(scalar),
                 attn_softcap=hf.get("attn_logit_softcapping"), logit_softcap=hf.get("final_logit_softcapping"),
                 sliding_window=window, layer_types=types, **extra)


def _gemma2_from_hf(hf: dict) -> ModelConfig:
    return _gemma_from_hf(hf, "gemma2", GEMMA2.defaults, **_rope(hf, "gemma2"))


def _gemma3_rope(hf: dict) -> dict:
    """Gemma 3's two RoPE tables: the global layers' (rope_theta, with any scaling) and the sliding
    layers' (rope_local_base_freq, never scaled). transformers >= 5 writes rope_parameters keyed by
    layer type; older files write rope_theta, rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
        partial_rotary({"rope_parameters": full}, "gemma3_text")
        partial_rotary({"rope_parameters": local}, "gemma3_text")
        if local.get("rope_type", "default") != "default":
            raise UserError(f"config.json: RoPE scaling {local['rope_type']!r} on the sliding layers of a gemma3_text "
                            "model is not supported (glassformer scales the global layers' RoPE only)")
        theta, scaling = hf_rope({"rope_parameters": full, "rope_theta": full.get("rope_theta", 1_000_000.0)})
        local_theta = float(local.get("rope_theta", 10_000.0))
    else:
        partial_rotary(hf, "gemma3_text")
        theta, scaling = hf_rope({**hf, "rope_theta": hf.get("rope_theta") or 1_000_000.0})
        local_theta = float(hf.get("rope_local_base_freq") or 10_000.0)
    return dict(rope_theta=theta, rope_scaling=_checked_scaling(scaling, hf, "gemma3_text"), rope_local_theta=local_theta)


def _gemma3_from_hf(hf: dict) -> ModelConfig:
    return _gemma_from_hf(hf, "gemma3_text", GEMMA3.defaults, qk_norm="head", **_gemma3_rope(hf))


# Gemma3TextConfig's defaults: the hub's multimodal Gemma 3 folders (4B, 12B, 27B) write only a few text fields.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
)


def _gemma3_multimodal(hf: dict) -> ModelConfig:
    """The text part of a Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): its text_config,
    Gemma3TextConfig's defaults filling what the hub's files leave out. Only text is read; images are not."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UserError("config.json: a gemma3 (Gemma3ForConditionalGeneration) model has no text_config object: "
                        "the folder's config is incomplete")
    tied = hf.get("tie_word_embeddings", True)
    return _gemma3_from_hf({**GEMMA3_TEXT_DEFAULTS, "tie_word_embeddings": tied, **text, "model_type": "gemma3_text"})


_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))


@dataclass(frozen=True)
class TextOfMultimodal(Family):
    """A multimodal folder read for its language model: the vision tower and projector are left
    unread, the language model's tensors take the text-only family's names (both layouts
    transformers has written: language_model.model.* and model.language_model.*)."""

    def adapt_weights(self, w, cfg: ModelConfig) -> None:
        def text_name(key: str) -> str:
            for old, new in _LANGUAGE_MODEL:
                if key.startswith(old):
                    return new + key[len(old):]
            return key

        w.drop(lambda k: k.startswith(("language_model.", "model.language_model.", "lm_head.")))
        w.rename(text_name)


# ----------------------------------------------------------------------------- ModelConfig -> config.json


def _llama_like_to_hf(cfg: ModelConfig, model_type: str, arch: str) -> dict:
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        **rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
    }


def _llama_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "llama", "LlamaForCausalLM"), "attention_bias": False, "mlp_bias": False}


def _mistral_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "mistral", "MistralForCausalLM"), "sliding_window": cfg.sliding_window}


def _qwen2_to_hf(cfg: ModelConfig) -> dict:
    types = layer_types_out(cfg)
    first = types.index("sliding_attention") if "sliding_attention" in types else cfg.n_layers
    return {
        **_llama_like_to_hf(cfg, "qwen2", "Qwen2ForCausalLM"),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": first,  # transformers < 5's rule (layers from it on slide); >= 5 reads layer_types
        "layer_types": types,
    }


def _windows_to_hf(cfg: ModelConfig) -> dict:
    """Sliding windows as Qwen3 and SmolLM3 read them: the window, and which layers take it."""
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": 0, "layer_types": layer_types_out(cfg)}


def _qwen3_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "qwen3", "Qwen3ForCausalLM"), "attention_bias": cfg.attn_bias, **_windows_to_hf(cfg)}


def _smollm3_to_hf(cfg: ModelConfig) -> dict:
    nope = set(cfg.nope_layers or ())
    return {**_llama_like_to_hf(cfg, "smollm3", "SmolLM3ForCausalLM"), "attention_bias": cfg.attn_bias,
            "mlp_bias": False, "no_rope_layers": [0 if i in nope else 1 for i in range(cfg.n_layers)],
            **_windows_to_hf(cfg)}


def _olmo2_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "olmo2", "Olmo2ForCausalLM"), "attention_bias": cfg.attn_bias}


def _phi3_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "phi3", "Phi3ForCausalLM"), "sliding_window": cfg.sliding_window,
            "original_max_position_embeddings": cfg.max_seq_len, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _gemma_to_hf(cfg: ModelConfig, model_type: str, arch: str) -> dict:
    hf = _llama_like_to_hf(cfg, model_type, arch)
    del hf["hidden_act"]
    return {
        **hf,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": cfg.attn_bias,
        # None means the usual 1/√H: Gemma always reads a scalar, so write H (transformers wants a whole number).
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim),
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.logit_softcap,
        # transformers' Gemma builds a sliding mask whatever the layers: with none sliding, a window as long
        # as the context, which hides nothing
        "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else cfg.max_seq_len,
        "layer_types": layer_types_out(cfg),
        "use_bidirectional_attention": False,
    }


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _gemma2_to_hf(cfg: ModelConfig) -> dict:
    return _gemma_to_hf(cfg, "gemma2", "Gemma2ForCausalLM")


def _gemma3_to_hf(cfg: ModelConfig) -> dict:
    hf = _gemma_to_hf(cfg, "gemma3_text", "Gemma3ForCausalLM")
    local = float(cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)
    hf["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                             "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    hf["rope_local_base_freq"] = local  # transformers < 5's name
    return hf


def _gemma3_rope_check(cfg: ModelConfig) -> list[str]:
    """Gemma 3's sliding layers never scale RoPE: a model that scales on every layer does not fit."""
    if cfg.rope_scaling is not None and cfg.rope_local_theta is None and any(
            cfg.window_at(i) is not None for i in range(cfg.n_layers)):
        return ["rope_scaling on sliding layers (Gemma 3 scales only its global layers' RoPE: set rope_local_theta)"]
    return []


# ----------------------------------------------------------------------------- the families


def _plain(**allow: Any) -> dict[str, Any]:
    """What export needs of a llama-like model, every switch off unless `allow` says otherwise."""
    wants = dict(
        norm="rms", norm_placement="pre", ffn="swiglu", pos="rope", bias=False, qkv_bias=False, sliding_window=None,
        layer_types=None, qk_norm=False, logit_softcap=None, value_embeddings=False, norm_offset=False,
        embed_scale=False, query_pre_attn_scalar=None, attn_softcap=None, rope_local_theta=None, nope_layers=None,
        attn_bias=False, attn_sinks=False, n_experts=0, ffn_bias=False,
        rope_scaling=lambda s: s is None or s.get("rope_type", s.get("type")) in ("llama3", "linear"),
    )
    return {**wants, **allow}


_ANY_ROPE = lambda s: s is None or s.get("rope_type", s.get("type")) in _ROPES  # noqa: E731
_LLAMA_IGNORE = (r"rotary_emb\.inv_freq$",)
_GEMMA_IGNORE = (r"rotary_emb\.inv_freq$", r"rotary_emb_local\.inv_freq$", r"embed_tokens\.embed_scale$")
_GEMMA = dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True, query_pre_attn_scalar=ANY,
              attn_softcap=ANY, logit_softcap=ANY, sliding_window=ANY, layer_types=ANY, attn_bias=ANY)


def _family(name, arch, layer, from_hf, to_hf, defaults, wants, ignore=_LLAMA_IGNORE, extra_check=None) -> Family:
    return Family(name, arch, "model.", "model.embed_tokens.weight", _llama_global, layer, from_hf, to_hf, ignore,
                  defaults=defaults, wants=wants, extra_check=extra_check)


LLAMA = _family("llama", "LlamaForCausalLM", _llama_layer, _llama_from_hf, _llama_to_hf,
                {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}, _plain())
MISTRAL = _family("mistral", "MistralForCausalLM", _llama_layer, _mistral_from_hf, _mistral_to_hf,
                  {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6}, _plain(sliding_window=ANY))
QWEN2 = _family("qwen2", "Qwen2ForCausalLM", _llama_layer, _qwen2_from_hf, _qwen2_to_hf,
                {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
                _plain(qkv_bias=ANY, sliding_window=ANY, layer_types=ANY))
QWEN3 = _family("qwen3", "Qwen3ForCausalLM", _llama_layer, _qwen3_from_hf, _qwen3_to_hf,
                {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
                _plain(qk_norm="head", attn_bias=ANY, sliding_window=ANY, layer_types=ANY, rope_scaling=_ANY_ROPE))
SMOLLM3 = _family("smollm3", "SmolLM3ForCausalLM", _llama_layer, _smollm3_from_hf, _smollm3_to_hf,
                  {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
                  _plain(nope_layers=ANY, attn_bias=ANY, sliding_window=ANY, layer_types=ANY, rope_scaling=_ANY_ROPE))
OLMO2 = _family("olmo2", "Olmo2ForCausalLM", _olmo2_layer, _olmo2_from_hf, _olmo2_to_hf,
                {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
                _plain(norm_placement="post_branch", qk_norm="proj", attn_bias=ANY, rope_scaling=_ANY_ROPE))
# Phi-3 holds what Llama and Mistral hold, so export picks it only by name (save_hf(family="phi3")).
PHI3 = _family("phi3", "Phi3ForCausalLM", _phi3_layer, _phi3_from_hf, _phi3_to_hf,
               {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}, _plain(sliding_window=ANY, rope_scaling=_ANY_ROPE))
GEMMA2 = _family("gemma2", "Gemma2ForCausalLM", _gemma_layer, _gemma2_from_hf, _gemma2_to_hf,
                 {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                  "query_pre_attn_scalar": 256, "sliding_window_pattern": 2},
                 _plain(**_GEMMA), ignore=_GEMMA_IGNORE)
GEMMA3 = _family("gemma3_text", "Gemma3ForCausalLM", _gemma_layer, _gemma3_from_hf, _gemma3_to_hf,
                 {"max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                  "query_pre_attn_scalar": 256, "sliding_window_pattern": 6},
                 _plain(**_GEMMA, qk_norm="head", rope_local_theta=ANY, rope_scaling=_ANY_ROPE),
                 ignore=_GEMMA_IGNORE, extra_check=_gemma3_rope_check)
# Read for its text part; written back as gemma3_text (export picks GEMMA3: this one has no `wants`).
GEMMA3_MULTIMODAL = TextOfMultimodal("gemma3", "Gemma3ForConditionalGeneration", "model.", "model.embed_tokens.weight",
                                     _llama_global, _gemma_layer, _gemma3_multimodal, _gemma3_to_hf, _GEMMA_IGNORE)
# ---- GPT-2


def _gpt2_global(cfg: ModelConfig) -> list[Rule]:
    rules = [
        R("transformer.wte.weight", "embed.weight"),
        R("transformer.wpe.weight", "pos_embed.weight"),
        R("transformer.ln_f.weight", "final_norm.weight"),
        R("transformer.ln_f.bias", "final_norm.bias"),
    ]
    if not cfg.tie_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight"))
    return rules


def _gpt2_layer(cfg: ModelConfig) -> list[Rule]:
    p, o = "transformer.h.{i}.", "blocks.{i}."
    qkv = (o + "attn.wq", o + "attn.wk", o + "attn.wv")
    return [
        R(p + "ln_1.weight", o + "attn_norm.weight"),
        R(p + "ln_1.bias", o + "attn_norm.bias"),
        R(p + "attn.c_attn.weight", *(k + ".weight" for k in qkv), transform="qkv_conv1d"),
        R(p + "attn.c_attn.bias", *(k + ".bias" for k in qkv), transform="qkv_bias"),
        R(p + "attn.c_proj.weight", o + "attn.wo.weight", transform="conv1d"),
        R(p + "attn.c_proj.bias", o + "attn.wo.bias"),
        R(p + "ln_2.weight", o + "ffn_norm.weight"),
        R(p + "ln_2.bias", o + "ffn_norm.bias"),
        R(p + "mlp.c_fc.weight", o + "ffn.w_up.weight", transform="conv1d"),
        R(p + "mlp.c_fc.bias", o + "ffn.w_up.bias"),
        R(p + "mlp.c_proj.weight", o + "ffn.w_down.weight", transform="conv1d"),
        R(p + "mlp.c_proj.bias", o + "ffn.w_down.bias"),
    ]


# transformers' activation names -> ours ('gelu_new' and 'gelu_pytorch_tanh' are both the tanh form)
_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_GPT2_ACT_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def _gpt2_from_hf(hf: dict) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise UserError(f"config.json: GPT-2 activation_function {act!r} is not supported ({', '.join(_GPT2_ACT)})")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False)):
        if bool(hf.get(key, ok)) != ok:
            raise UserError(f"config.json: GPT-2 with {key}={hf[key]} is not supported (glassformer needs {ok})")
    dim = need(hf, "n_embd", "gpt2")
    try:
        return ModelConfig(
            vocab_size=need(hf, "vocab_size", "gpt2"),
            dim=dim,
            n_layers=need(hf, "n_layer", "gpt2"),
            n_heads=need(hf, "n_head", "gpt2"),
            ffn_dim=hf.get("n_inner") or 4 * dim,
            max_seq_len=need(hf, "n_positions", "gpt2"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            norm="layer", ffn=_GPT2_ACT[act], pos="learned", bias=True,
        )
    except ValueError as e:
        raise UserError(f"config.json describes a gpt2 model that glassformer cannot build: {e}") from None


def _gpt2_to_hf(cfg: ModelConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": _GPT2_ACT_OUT[cfg.ffn],
        "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True,
    }


GPT2 = Family(
    "gpt2", "GPT2LMHeadModel", "transformer.", "transformer.wte.weight", _gpt2_global, _gpt2_layer,
    _gpt2_from_hf, _gpt2_to_hf,
    # The causal-mask buffers that older GPT-2 checkpoints (the hub's gpt2 among them) carry.
    ignore=(r"(^|\.)attn\.(masked_)?bias$",),
    wants=_plain(norm="layer", ffn=lambda f: f in _GPT2_ACT_OUT, pos="learned", bias=True, rope_scaling=ANY),
    extra_check=lambda cfg: [f"{k}={getattr(cfg, k)!r}" for k, v in
                             (("n_kv_heads", cfg.n_heads), ("head_dim", cfg.dim // cfg.n_heads)) if getattr(cfg, k) != v],
)

# Export tries them in this order and takes the first that holds the model: the older, plainer families
# first, so a model that Llama holds is written as Llama, as before these families came.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    LLAMA, MISTRAL, QWEN2, GPT2, QWEN3, SMOLLM3, OLMO2, GEMMA2, GEMMA3, PHI3, GEMMA3_MULTIMODAL)}
# The mixture-of-experts families (families_moe.py, which imports family_base.py, never this module) join here:
from .families_moe import MOE_FAMILIES  # noqa: E402

FAMILIES.update(MOE_FAMILIES)


def family_named(model_type: Any, where: str = "config.json") -> Family:
    if model_type not in FAMILIES:
        raise UserError(
            f"{where}: model_type {model_type!r} is not supported; glassformer converts "
            f"{', '.join(f for f in FAMILIES if FAMILIES[f].wants is not None)} "
            "(SmolLM, TinyLlama and Llama 2/3 are 'llama')"
        )
    return FAMILIES[model_type]


# ----------------------------------------------------------------------------- export


def _speedrun_off(cfg: ModelConfig) -> list[str]:
    """The speedrun switches (docs/model.md#speedrun-switches) that no family glassformer writes holds, by name."""
    off = []
    if cfg.qk_norm is True:
        off.append("qk_norm=True (a weightless RMS of each head: Qwen3's and Gemma 3's q_norm/k_norm have a weight, "
                   "qk_norm='head'; OLMo 2's, qk_norm='proj')")
    if cfg.value_embeddings:
        off.append("value_embeddings (no family adds a token table to the values)")
    if cfg.ffn == "relu2":
        off.append("ffn='relu2' (squared ReLU: llama-like families have SwiGLU, Gemma GeGLU, gpt2 GELU or ReLU)")
    return off


def _mismatches_of(wants: dict[str, Any], cfg: ModelConfig) -> list[str]:
    return [f"{k}={getattr(cfg, k)!r}" for k, ok in wants.items()
            if not (ok(getattr(cfg, k)) if callable(ok) else getattr(cfg, k) == ok)]


def family_for(cfg: ModelConfig, name: str | None = None) -> Family:
    """The Hugging Face family that can hold this model exactly (the first in FAMILIES' order, or the
    one named), or a UserError saying why none can."""
    speedrun = _speedrun_off(cfg)
    if speedrun:
        raise UserError(f"{'; '.join(speedrun)}: no Hugging Face family glassformer writes can hold it; "
                        "train without it to export to Hugging Face")
    if not cfg.has_ffn:
        raise UserError("ffn='none' (attention-only blocks): every Hugging Face family that glassformer writes "
                        f"({', '.join(f.name for f in FAMILIES.values() if f.wants)}) has a feed-forward in each block: "
                        "export refused")
    if name is not None:
        family = family_named(name, "export")
        off = family.mismatches(cfg)
        if off:
            raise UserError(f"the Hugging Face family {name!r} cannot hold this model: it has {', '.join(off)}")
        return family
    offs = {}
    for family in FAMILIES.values():
        if family.wants is None:
            continue
        offs[family.name] = family.mismatches(cfg)
        if not offs[family.name]:
            return family
    # Name the closest family, and those that hold one of the model's own switches (qk_norm='proj' -> olmo2),
    # with what each lacks: the switch a user changes to export.
    switched = {w.split("=")[0] for w in _mismatches_of(_plain(), cfg)}  # what the model sets beyond plain Llama
    own = [f for f in offs if any(k in switched and f"{k}={getattr(cfg, k)!r}" not in offs[f] for k in FAMILIES[f].wants)]
    ranked = sorted(offs, key=lambda f: len(offs[f]))
    closest = list(dict.fromkeys(ranked[:1] + sorted(own, key=lambda f: len(offs[f]))))[:3]
    raise UserError(
        f"no Hugging Face family that glassformer writes ({', '.join(offs)}) can hold this model: "
        + "; ".join(f"for {f} it has {', '.join(offs[f])}" for f in closest)
    )
