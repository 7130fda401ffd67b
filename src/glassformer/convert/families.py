"""Per-family key maps between Hugging Face checkpoints and ours.

A family is a `model_type` of Hugging Face `transformers`: how its config.json maps onto a
ModelConfig (both ways) and a declarative list of rules, one per Hugging Face tensor, each
naming the tensor on both sides and the transform between them (transforms.py). Run on meta
tensors the rules also give every tensor's shape: docs/convert.md#the-key-map-and-its-transforms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import ModelConfig
from ..errors import UserError
from .transforms import R, Rule

# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    name: str  # the config.json model_type
    architecture: str  # the config.json architectures entry
    prefix: str  # the base model's prefix, absent from checkpoints saved without the LM head
    embed_key: str  # the Hugging Face token embedding (what a tied lm_head.weight must equal)
    global_rules: Callable[[ModelConfig], list[Rule]]
    layer_rules: Callable[[ModelConfig], list[Rule]]
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    ignore: tuple[str, ...] = ()  # regexes of buffers that are recomputed, never weights
    defaults: dict[str, Any] = field(default_factory=dict)

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        """Every rule with its layer index filled in, in checkpoint order."""
        out = [r for r in self.global_rules(cfg) if not r.hf.startswith("lm_head")]
        for i in range(cfg.n_layers):
            out += [r.at(i) for r in self.layer_rules(cfg)]
        out += [r for r in self.global_rules(cfg) if r.hf.startswith("lm_head")]
        return out

    def ignored(self, key: str) -> bool:
        return any(re.search(p, key) for p in self.ignore)


def _need(hf: dict, key: str, family: str) -> Any:
    if hf.get(key) is None:
        raise UserError(f"config.json of a {family} model has no {key!r}: the folder's config is incomplete")
    return hf[key]


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


def _check_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("llama3", "linear"):
        raise UserError(
            f"config.json asks for RoPE scaling {kind!r}, which glassformer does not implement "
            "(supported: llama3, linear, or none)"
        )


# ---- Llama, Mistral, Qwen2: one shape of block, three config dialects


def _llama_global(cfg: ModelConfig) -> list[Rule]:
    rules = [R("model.embed_tokens.weight", "embed.weight"), R("model.norm.weight", "final_norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight"))
    return rules


def _llama_layer(cfg: ModelConfig) -> list[Rule]:
    p, o = "model.layers.{i}.", "blocks.{i}."
    rules = [
        R(p + "input_layernorm.weight", o + "attn_norm.weight"),
        R(p + "self_attn.q_proj.weight", o + "attn.wq.weight", transform="rope_q"),
        R(p + "self_attn.k_proj.weight", o + "attn.wk.weight", transform="rope_k"),
        R(p + "self_attn.v_proj.weight", o + "attn.wv.weight"),
    ]
    if cfg.qkv_bias:
        rules += [
            R(p + "self_attn.q_proj.bias", o + "attn.wq.bias", transform="rope_q"),
            R(p + "self_attn.k_proj.bias", o + "attn.wk.bias", transform="rope_k"),
            R(p + "self_attn.v_proj.bias", o + "attn.wv.bias"),
        ]
    return rules + [
        R(p + "self_attn.o_proj.weight", o + "attn.wo.weight"),
        R(p + "post_attention_layernorm.weight", o + "ffn_norm.weight"),
        R(p + "mlp.gate_proj.weight", o + "ffn.w_gate.weight"),
        R(p + "mlp.up_proj.weight", o + "ffn.w_up.weight"),
        R(p + "mlp.down_proj.weight", o + "ffn.w_down.weight"),
    ]


def _llama_like_config(hf: dict, family: str, defaults: dict, **extra) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json: hidden_act {act!r} in a {family} model; glassformer's SwiGLU uses silu")
    if hf.get("mlp_bias"):
        raise UserError(f"config.json: mlp_bias=true in a {family} model is not supported (no MLP biases in glassformer's SwiGLU)")
    theta, scaling = hf_rope(hf)
    _check_rope_scaling(scaling)
    n_heads = _need(hf, "num_attention_heads", family)
    dim = _need(hf, "hidden_size", family)
    try:
        return ModelConfig(
            vocab_size=_need(hf, "vocab_size", family),
            dim=dim,
            n_layers=_need(hf, "num_hidden_layers", family),
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or dim // n_heads,
            ffn_dim=_need(hf, "intermediate_size", family),
            max_seq_len=hf.get("max_position_embeddings") or defaults["max_position_embeddings"],
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=hf.get("rms_norm_eps") or defaults["rms_norm_eps"],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm="rms", ffn="swiglu", pos="rope", rope_pairs="half", **extra,
        )
    except ValueError as e:
        raise UserError(f"config.json describes a {family} model that glassformer cannot build: {e}") from None


def _llama_from_hf(hf: dict) -> ModelConfig:
    if hf.get("attention_bias"):
        # Llama's attention_bias puts a bias on o_proj too; glassformer has Q/K/V biases or biases everywhere.
        raise UserError("config.json: attention_bias=true in a llama model (biases on q/k/v/o_proj) is not supported")
    return _llama_like_config(hf, "llama", LLAMA.defaults)


def _mistral_from_hf(hf: dict) -> ModelConfig:
    return _llama_like_config(hf, "mistral", MISTRAL.defaults, sliding_window=hf.get("sliding_window"))


def qwen2_window(hf: dict) -> int | None:
    """The one sliding window that every layer of a Qwen2 config uses, or None.

    Qwen2 slides its window only when use_sliding_window is true, and then only on layers
    i >= max_window_layers (transformers writes this out as `layer_types`). glassformer
    applies one window to every layer, so a config that mixes the two is refused.
    """
    n = _need(hf, "num_hidden_layers", "qwen2")
    types = hf.get("layer_types")
    if types is None:
        if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
            types = ["full_attention"] * n
        else:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    kinds = set(types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return _need(hf, "sliding_window", "qwen2")
    raise UserError(
        "config.json: this qwen2 model slides its attention window on some layers only "
        f"({sum(t == 'sliding_attention' for t in types)} of {n}); glassformer uses one window for every layer"
    )


def _qwen2_from_hf(hf: dict) -> ModelConfig:
    return _llama_like_config(hf, "qwen2", QWEN2.defaults, qkv_bias=True, sliding_window=qwen2_window(hf))


def _rope_fields(cfg: ModelConfig) -> dict:
    """Both spellings: transformers < 5 reads rope_theta/rope_scaling, >= 5 reads rope_parameters
    (and converts the old spelling too); an older reader ignores the newer key."""
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        scaling["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))  # old configs say "type"
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": float(cfg.rope_theta)}
    return {"rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "rope_parameters": params}


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
        **_rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
    }


def _llama_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "llama", "LlamaForCausalLM"), "attention_bias": False, "mlp_bias": False}


def _mistral_to_hf(cfg: ModelConfig) -> dict:
    return {**_llama_like_to_hf(cfg, "mistral", "MistralForCausalLM"), "sliding_window": cfg.sliding_window}


def _qwen2_to_hf(cfg: ModelConfig) -> dict:
    w = cfg.sliding_window
    return {
        **_llama_like_to_hf(cfg, "qwen2", "Qwen2ForCausalLM"),
        "use_sliding_window": w is not None,
        "sliding_window": w,
        "max_window_layers": 0 if w is not None else cfg.n_layers,  # every layer slides, or none
        "layer_types": ["sliding_attention" if w is not None else "full_attention"] * cfg.n_layers,
    }


_LLAMA_IGNORE = (r"rotary_emb\.inv_freq$",)

LLAMA = Family(
    "llama", "LlamaForCausalLM", "model.", "model.embed_tokens.weight", _llama_global, _llama_layer,
    _llama_from_hf, _llama_to_hf, _LLAMA_IGNORE,
    defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
)
MISTRAL = Family(
    "mistral", "MistralForCausalLM", "model.", "model.embed_tokens.weight", _llama_global, _llama_layer,
    _mistral_from_hf, _mistral_to_hf, _LLAMA_IGNORE,
    defaults={"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6},
)
QWEN2 = Family(
    "qwen2", "Qwen2ForCausalLM", "model.", "model.embed_tokens.weight", _llama_global, _llama_layer,
    _qwen2_from_hf, _qwen2_to_hf, _LLAMA_IGNORE,
    defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
)

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
    dim = _need(hf, "n_embd", "gpt2")
    try:
        return ModelConfig(
            vocab_size=_need(hf, "vocab_size", "gpt2"),
            dim=dim,
            n_layers=_need(hf, "n_layer", "gpt2"),
            n_heads=_need(hf, "n_head", "gpt2"),
            ffn_dim=hf.get("n_inner") or 4 * dim,
            max_seq_len=_need(hf, "n_positions", "gpt2"),
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
)

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, GPT2)}


def family_named(model_type: Any, where: str = "config.json") -> Family:
    if model_type not in FAMILIES:
        raise UserError(
            f"{where}: model_type {model_type!r} is not supported; glassformer converts "
            f"{', '.join(FAMILIES)} (SmolLM, TinyLlama and Llama 2/3 are 'llama')"
        )
    return FAMILIES[model_type]


# ----------------------------------------------------------------------------- export


def _mismatches(cfg: ModelConfig, wants: dict[str, Any]) -> list[str]:
    out = []
    for name, ok in wants.items():
        value = getattr(cfg, name)
        good = ok(value) if callable(ok) else value == ok
        if not good:
            out.append(f"{name}={value!r}")
    return out


def _speedrun_off(cfg: ModelConfig) -> list[str]:
    """The speedrun switches (docs/model.md#speedrun-switches) that no family glassformer writes holds, by name."""
    off = []
    if cfg.qk_norm:
        off.append("qk_norm (llama, mistral, qwen2 and gpt2 normalise no query or key; Qwen3's q_norm/k_norm has "
                   "a weight, and glassformer writes no qwen3 family)")
    if cfg.logit_softcap is not None:
        off.append(f"logit_softcap={cfg.logit_softcap} (no soft cap on the logits in llama, mistral, qwen2 or gpt2)")
    if cfg.value_embeddings:
        off.append("value_embeddings (no family adds a token table to the values)")
    if cfg.ffn == "relu2":
        off.append("ffn='relu2' (squared ReLU: llama-like families have SwiGLU, gpt2 GELU or ReLU)")
    return off


def family_for(cfg: ModelConfig) -> Family:
    """The Hugging Face family that can hold this model exactly, or a UserError saying why none can."""
    speedrun = _speedrun_off(cfg)
    if speedrun:
        raise UserError(f"{'; '.join(speedrun)}: no Hugging Face family glassformer writes can hold it; "
                        "train without it to export to Hugging Face")
    if not cfg.has_ffn:
        raise UserError("ffn='none' (attention-only blocks): every Hugging Face family that glassformer writes "
                        "(llama, mistral, qwen2, gpt2) has a feed-forward in each block: export refused")
    llama_wants = dict(norm="rms", norm_placement="pre", ffn="swiglu", pos="rope", bias=False)
    gpt2_wants = dict(
        norm="layer", norm_placement="pre", ffn=lambda f: f in _GPT2_ACT_OUT, pos="learned", bias=True,
        n_kv_heads=cfg.n_heads, sliding_window=None, head_dim=cfg.dim // cfg.n_heads,
    )
    llama_off, gpt2_off = _mismatches(cfg, llama_wants), _mismatches(cfg, gpt2_wants)
    if not llama_off:
        if cfg.qkv_bias:
            return QWEN2
        return MISTRAL if cfg.sliding_window is not None else LLAMA
    if not gpt2_off:
        return GPT2
    raise UserError(
        "no Hugging Face family that glassformer writes (llama, mistral, qwen2, gpt2) can hold this model: "
        f"for llama/mistral/qwen2 it has {', '.join(llama_off)}; for gpt2 it has {', '.join(gpt2_off)}"
    )
