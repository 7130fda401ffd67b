"""The mixture-of-experts families: Qwen3-MoE, Mixtral, OLMoE and gpt-oss, both ways.

Each is a `MoEFamily`, read the way families.py reads a `Family` (name, prefix, rules(cfg),
config_from_hf, config_to_hf), with two additions that dense families do not need:
- its rules are per layer (Qwen3-MoE may keep a dense feed-forward on some layers);
- `adapt_weights` rewrites a folder's tensors into the layout the rules read before they are
  checked: experts stored fused (transformers' in-memory `experts.gate_up_proj` / `down_proj`,
  which its own loader also reads from a file) become per-expert tensors, and gpt-oss's MXFP4
  `_blocks` / `_scales` are dequantized (e2m1 values, one e8m0 scale per 32).

What each family writes is what transformers 5.25's save_pretrained writes, so its loader reads it
back: per-expert keys for Mixtral (`block_sparse_moe.experts.{e}.w1/w2/w3`), Qwen3-MoE and OLMoE
(`mlp.experts.{e}.gate_proj/up_proj/down_proj`); gpt-oss's fused `mlp.experts.gate_up_proj` (E, D, 2F)
with gate and up interleaved column by column, `down_proj` (E, F, D) and their biases.

Built from family_base.py (as families.py is), so families.py can import this module to register them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..errors import UserError
from .family_base import (
    Family, build, check_rope_scaling, hf_rope, layer_types_out, layer_windows, need, refuse_switches, rope_fields,
)
from .transforms import TRANSFORMS, R, Rule

# ----------------------------------------------------------------------------- transforms
# Each (to_ours, to_hf) pair joins one Hugging Face tensor holding every expert with the E (or 2E)
# tensors of ours, expert by expert in order; on meta tensors to_hf gives the stored shape.


def _gpt_oss_gate_up(t, cfg):
    """(E, D, 2F), gate in even columns, up in odd ones -> per expert w_gate (F, D), w_up (F, D)."""
    return tuple(m for e in range(t.shape[0]) for m in (t[e, :, 0::2].t(), t[e, :, 1::2].t()))


def _gpt_oss_gate_up_hf(ts, cfg):
    pairs = [torch.stack([g.t(), u.t()], dim=-1).flatten(-2) for g, u in zip(ts[0::2], ts[1::2])]  # E × (D, 2F)
    return torch.stack(pairs)


def _gpt_oss_gate_up_bias(t, cfg):
    return tuple(b for e in range(t.shape[0]) for b in (t[e, 0::2], t[e, 1::2]))


def _gpt_oss_gate_up_bias_hf(ts, cfg):
    return torch.stack([torch.stack([g, u], dim=-1).flatten(-2) for g, u in zip(ts[0::2], ts[1::2])])


MOE_TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    # gpt-oss multiplies x @ W, so its matrices are ours transposed.
    "gpt_oss_gate_up": (_gpt_oss_gate_up, _gpt_oss_gate_up_hf),
    "gpt_oss_gate_up_bias": (_gpt_oss_gate_up_bias, _gpt_oss_gate_up_bias_hf),
    "experts_t": (lambda t, cfg: tuple(m.t() for m in t), lambda ts, cfg: torch.stack([m.t() for m in ts])),
    "experts": (lambda t, cfg: tuple(t), lambda ts, cfg: torch.stack(ts)),
}

# The rules name transforms by key; these join the shared table (new names only, nothing replaced).
for _name, _pair in MOE_TRANSFORMS.items():
    TRANSFORMS.setdefault(_name, _pair)

# ----------------------------------------------------------------------------- the family type


@dataclass(frozen=True)
class MoEFamily(Family):
    """A Family whose layer_rules(cfg, i) depend on the layer (dense and mixture layers can alternate),
    and which reads the fused and MXFP4 expert layouts too (adapt_weights, before the rules run)."""

    # layer i -> {fused Hugging Face key: the per-expert keys it holds, in the order its pieces come}
    fused: Callable[[ModelConfig, int], dict[str, tuple[str, ...]]] = lambda cfg, i: {}
    # Keys renamed before anything else: the undoing of a renaming transformers' loader applies (Mixtral's
    # in-memory `mlp` is its checkpoints' `block_sparse_moe`, and transformers reads either).
    rename: Callable[[str], str] | None = None

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        """Every rule with its layer index filled in, in checkpoint order."""
        out = [r for r in self.global_rules(cfg) if not r.hf.startswith("lm_head")]
        for i in range(cfg.n_layers):
            out += [r.at(i) for r in self.layer_rules(cfg, i)]
        return out + [r for r in self.global_rules(cfg) if r.hf.startswith("lm_head")]

    def adapt_weights(self, w, cfg: ModelConfig) -> None:
        """Rewrite w (hf.Weights) in place into the per-expert keys the rules read, where the folder
        stores a layer's experts in another layout transformers also loads."""
        if self.rename is not None:
            w.rename(self.rename)
        for i in range(cfg.n_layers):
            for fused_key, parts in self.fused(cfg, i).items():
                _unfuse(w, fused_key, parts, cfg)


# ----------------------------------------------------------------------------- reading other layouts


def _unfuse(w, fused_key: str, parts: tuple[str, ...], cfg: ModelConfig) -> None:
    """Replace the fused tensor `fused_key` (and/or its MXFP4 _blocks/_scales) in w by `parts`:
    per-expert keys, read lazily from the fused tensor on demand."""
    blocks, scales = fused_key + "_blocks", fused_key + "_scales"
    if blocks in w.file or scales in w.file:
        _dequantize_mxfp4(w, fused_key)
    if fused_key not in w.file or not parts:  # no parts: the fused tensor is what the rules read
        return
    if any(p in w.file for p in parts):
        raise UserError(f"{w.file[fused_key].name}: {fused_key} and per-expert tensors such as "
                        f"{next(p for p in parts if p in w.file)} are both stored: the folder holds its experts twice")
    E, shape = cfg.n_experts, w.shape[fused_key]
    if not shape or shape[0] != E or len(parts) % E:
        raise UserError(f"{w.file[fused_key].name}: {fused_key} has shape {list(shape)}, "
                        f"but config.json says {E} experts")
    file, _, read = w.take(fused_key)
    per = len(parts) // E
    held: dict[str, torch.Tensor] = {}

    def piece(e: int, j: int) -> torch.Tensor:
        # The fused tensor is read once for all its pieces, and let go after the last one.
        if "t" not in held:
            held["t"] = read()
        t = held["t"]
        if (e, j) == (E - 1, per - 1):
            held.clear()
        return t[e].chunk(per)[j]

    for e in range(E):
        for j in range(per):  # per 2: transformers' [gate; up] halves of the first dimension
            w.add(parts[e * per + j], file, (shape[1] // per, *shape[2:]), lambda e=e, j=j: piece(e, j))


# MXFP4 (OCP microscaling): each byte holds two e2m1 numbers (low nibble first), each row of 32 shares
# one e8m0 scale, 2^(s - 127). The value table is OCP's, in transformers' order.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """gpt-oss's packed experts -> the float tensor transformers dequantizes them to: blocks
    (E, R, G, 16) uint8 and scales (E, R, G) uint8 give (E, G·32, R) (rows R become columns)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise UserError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                        f"({scales.dtype}) do not pair: blocks must be uint8 (..., G, 16), scales uint8 (..., G)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # (E, R, G, 32)
    vals = torch.ldexp(vals, scales.to(torch.int32)[..., None] - 127)
    E, R = blocks.shape[:2]
    return vals.reshape(E, R, -1).transpose(1, 2).to(dtype).contiguous()


def _dequantize_mxfp4(w, key: str) -> None:
    blocks, scales = key + "_blocks", key + "_scales"
    if blocks not in w.file or scales not in w.file:
        have = blocks if blocks in w.file else scales
        raise UserError(f"{w.file[have].name}: {have} is stored without its pair "
                        f"{scales if have == blocks else blocks}: the MXFP4 experts are incomplete")
    if key in w.file:
        raise UserError(f"{w.file[key].name}: {key} is stored both as floats and as MXFP4 blocks")
    b, s = w.shape[blocks], w.shape[scales]
    if len(b) != 4 or b[:-1] != s or b[-1] != 16:
        raise UserError(f"{w.file[blocks].name}: {blocks} {list(b)} and {scales} {list(s)} are not MXFP4 "
                        "blocks (E, R, G, 16) with scales (E, R, G)")
    file, _, rb = w.take(blocks)
    _, _, rs = w.take(scales)
    w.add(key, file, (b[0], b[2] * 32, b[1]), lambda: dequantize_mxfp4(rb(), rs()))


# ----------------------------------------------------------------------------- config helpers


def _n_experts(hf: dict, family: str) -> int:
    """E under either name: transformers maps num_experts and num_local_experts onto each other in every
    family here (hub Qwen3-MoE and OLMoE folders say num_experts, Mixtral and gpt-oss num_local_experts)."""
    a, b = hf.get("num_experts"), hf.get("num_local_experts")
    if a is not None and b is not None and a != b:
        raise UserError(f"config.json of a {family} model gives num_experts={a} and num_local_experts={b}")
    return need(hf, "num_experts" if a is not None else "num_local_experts", family)


def _common(hf: dict, family: str, defaults: dict) -> dict:
    """The fields every family here shares with Llama (attention, norms, RoPE, the head)."""
    n_heads = need(hf, "num_attention_heads", family)
    dim = need(hf, "hidden_size", family)
    theta, scaling = hf_rope(hf)
    check_rope_scaling(scaling, ("yarn", "llama3", "linear"))
    return dict(
        vocab_size=need(hf, "vocab_size", family), dim=dim, n_layers=need(hf, "num_hidden_layers", family),
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or dim // n_heads,
        max_seq_len=hf.get("max_position_embeddings") or defaults["max_position_embeddings"],
        rope_theta=theta, rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps") or defaults["rms_norm_eps"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
    )


def _common_out(cfg: ModelConfig, family: MoEFamily) -> dict:
    return {
        "architectures": [family.architecture], "model_type": family.name, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, **rope_fields(cfg),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_dropout": 0.0,
        "num_experts_per_tok": cfg.n_active_experts, "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }


def _silu(hf: dict, family: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"config.json: hidden_act {act!r} in a {family} model; its experts are SwiGLU with silu")


def _window(hf: dict, family: str) -> int | None:
    """Mixtral's and Qwen3-MoE's one window for every layer (Qwen3-MoE only with use_sliding_window)."""
    if family == "qwen3_moe" and not hf.get("use_sliding_window"):
        return None
    return hf.get("sliding_window")


# ----------------------------------------------------------------------------- rules


def _global(cfg: ModelConfig) -> list[Rule]:
    rules = [R("model.embed_tokens.weight", "embed.weight"), R("model.norm.weight", "final_norm.weight")]
    if not cfg.tie_embeddings:
        rules.append(R("lm_head.weight", "lm_head.weight"))
    return rules


def _attention(cfg: ModelConfig) -> list[Rule]:
    p, o = "model.layers.{i}.", "blocks.{i}."
    rules = [R(p + "input_layernorm.weight", o + "attn_norm.weight")]
    for name, ours, rope in (("q", "wq", "rope_q"), ("k", "wk", "rope_k"), ("v", "wv", "copy"), ("o", "wo", "copy")):
        rules.append(R(p + f"self_attn.{name}_proj.weight", o + f"attn.{ours}.weight", transform=rope))
        if cfg.attn_bias:
            rules.append(R(p + f"self_attn.{name}_proj.bias", o + f"attn.{ours}.bias", transform=rope))
    if cfg.qk_norm in ("head", "proj"):
        q, k = ("rope_head", "rope_head") if cfg.qk_norm == "head" else ("rope_q", "rope_k")
        rules += [R(p + "self_attn.q_norm.weight", o + "attn.q_norm.weight", transform=q),
                  R(p + "self_attn.k_norm.weight", o + "attn.k_norm.weight", transform=k)]
    if cfg.attn_sinks:
        rules.append(R(p + "self_attn.sinks", o + "attn.sinks"))
    return rules + [R(p + "post_attention_layernorm.weight", o + "ffn_norm.weight")]


def _per_expert(cfg: ModelConfig, moe: str, names: tuple[str, str, str]) -> list[Rule]:
    """Router and experts stored one expert at a time: `names` are HF's gate, up and down projections."""
    p, o = "model.layers.{i}." + moe, "blocks.{i}.ffn."
    rules = [R(p + "gate.weight", o + "router.weight")]
    for e in range(cfg.n_experts):
        for hf, ours in zip(names, ("w_gate", "w_up", "w_down")):
            rules.append(R(p + f"experts.{e}.{hf}.weight", o + f"experts.{e}.{ours}.weight"))
    return rules


def _experts_fused(cfg: ModelConfig, i: int, moe: str, names: tuple[str, str, str]) -> dict[str, tuple[str, ...]]:
    """transformers' in-memory layout of the same experts (what its loader also reads from a file):
    gate_up_proj (E, 2F, D) = [gate; up] per expert, down_proj (E, D, F)."""
    if not cfg.is_moe(i):
        return {}
    p = f"model.layers.{i}.{moe}experts."
    per = p + "{e}."
    gu = tuple(per.format(e=e) + f"{n}.weight" for e in range(cfg.n_experts) for n in names[:2])
    down = tuple(per.format(e=e) + f"{names[2]}.weight" for e in range(cfg.n_experts))
    return {p + "gate_up_proj": gu, p + "down_proj": down}


def _dense_ffn() -> list[Rule]:
    p, o = "model.layers.{i}.mlp.", "blocks.{i}.ffn."
    return [R(p + f"{n}_proj.weight", o + f"w_{n}.weight") for n in ("gate", "up", "down")]


# ---- Mixtral


_MIXTRAL_NAMES = ("w1", "w3", "w2")


def _mixtral_layer(cfg: ModelConfig, i: int) -> list[Rule]:
    return _attention(cfg) + _per_expert(cfg, "block_sparse_moe.", _MIXTRAL_NAMES)


def _mixtral_from_hf(hf: dict) -> ModelConfig:
    _silu(hf, "mixtral")
    refuse_switches(hf, "mixtral", {"router_jitter_noise": lambda v: not v, "attention_bias": False, "mlp_bias": False})
    return build("mixtral", **_common(hf, "mixtral", MIXTRAL.defaults), ffn="swiglu",
                  ffn_dim=need(hf, "intermediate_size", "mixtral"), sliding_window=_window(hf, "mixtral"),
                  n_experts=_n_experts(hf, "mixtral"),
                  n_active_experts=need(hf, "num_experts_per_tok", "mixtral"), router="softmax", router_renorm=True)


def _mixtral_to_hf(cfg: ModelConfig) -> dict:
    return {**_common_out(cfg, MIXTRAL), "intermediate_size": cfg.expert_width, "num_local_experts": cfg.n_experts,
            "sliding_window": cfg.sliding_window, "router_jitter_noise": 0.0}


# ---- Qwen3-MoE


_QWEN_NAMES = ("gate_proj", "up_proj", "down_proj")


def _qwen3_moe_layer(cfg: ModelConfig, i: int) -> list[Rule]:
    if not cfg.is_moe(i):
        return _attention(cfg) + _dense_ffn()
    return _attention(cfg) + _per_expert(cfg, "mlp.", _QWEN_NAMES)


def _qwen3_moe_layers(hf: dict, n: int) -> list[int] | None:
    """Qwen3-MoE's sparse layers: not in mlp_only_layers, and (i + 1) a multiple of decoder_sparse_step."""
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    layers = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return None if len(layers) == n else layers


def _qwen3_moe_from_hf(hf: dict) -> ModelConfig:
    _silu(hf, "qwen3_moe")
    common = _common(hf, "qwen3_moe", QWEN3_MOE.defaults)
    moe_layers = _qwen3_moe_layers(hf, common["n_layers"])
    if moe_layers == []:
        raise UserError("config.json: this qwen3_moe model has no mixture-of-experts layer (mlp_only_layers / "
                        "decoder_sparse_step leave none); convert it as a dense model")
    return build("qwen3_moe", **common, ffn="swiglu", qk_norm="head", attn_bias=bool(hf.get("attention_bias")),
                  ffn_dim=need(hf, "intermediate_size", "qwen3_moe"),
                  expert_dim=need(hf, "moe_intermediate_size", "qwen3_moe"), moe_layers=moe_layers,
                  sliding_window=_window(hf, "qwen3_moe"), n_experts=_n_experts(hf, "qwen3_moe"),
                  n_active_experts=need(hf, "num_experts_per_tok", "qwen3_moe"), router="softmax",
                  router_renorm=bool(hf.get("norm_topk_prob", False)))


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
    dense = [i for i in range(cfg.n_layers) if not cfg.is_moe(i)]
    return {**_common_out(cfg, QWEN3_MOE), "intermediate_size": cfg.ffn_dim, "moe_intermediate_size": cfg.expert_width,
            "num_experts": cfg.n_experts, "norm_topk_prob": cfg.router_renorm, "decoder_sparse_step": 1,
            "mlp_only_layers": dense, "attention_bias": cfg.attn_bias,
            "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": cfg.n_layers}


# ---- OLMoE


def _olmoe_layer(cfg: ModelConfig, i: int) -> list[Rule]:
    return _attention(cfg) + _per_expert(cfg, "mlp.", _QWEN_NAMES)


def _olmoe_from_hf(hf: dict) -> ModelConfig:
    _silu(hf, "olmoe")
    refuse_switches(hf, "olmoe", {"clip_qkv": lambda v: False})  # null passes: clamping q, k, v is not computed
    return build("olmoe", **_common(hf, "olmoe", OLMOE.defaults), ffn="swiglu", qk_norm="proj",
                  attn_bias=bool(hf.get("attention_bias")), ffn_dim=need(hf, "intermediate_size", "olmoe"),
                  n_experts=_n_experts(hf, "olmoe"), n_active_experts=need(hf, "num_experts_per_tok", "olmoe"),
                  router="softmax", router_renorm=bool(hf.get("norm_topk_prob", False)))


def _olmoe_to_hf(cfg: ModelConfig) -> dict:
    return {**_common_out(cfg, OLMOE), "intermediate_size": cfg.expert_width, "num_experts": cfg.n_experts,
            "norm_topk_prob": cfg.router_renorm, "attention_bias": cfg.attn_bias, "clip_qkv": None}


# ---- gpt-oss


def _gpt_oss_layer(cfg: ModelConfig, i: int) -> list[Rule]:
    p, o = "model.layers.{i}.mlp.", "blocks.{i}.ffn."
    experts = [f"{o}experts.{e}." for e in range(cfg.n_experts)]
    return _attention(cfg) + [
        R(p + "router.weight", o + "router.weight"),
        R(p + "router.bias", o + "router.bias"),
        R(p + "experts.gate_up_proj", *(x + w for x in experts for w in ("w_gate.weight", "w_up.weight")),
          transform="gpt_oss_gate_up"),
        R(p + "experts.gate_up_proj_bias", *(x + w for x in experts for w in ("w_gate.bias", "w_up.bias")),
          transform="gpt_oss_gate_up_bias"),
        R(p + "experts.down_proj", *(x + "w_down.weight" for x in experts), transform="experts_t"),
        R(p + "experts.down_proj_bias", *(x + "w_down.bias" for x in experts), transform="experts"),
    ]


def _gpt_oss_fused(cfg: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """The rules read the fused float tensors: only an MXFP4 form needs rewriting (dequantized, kept fused)."""
    return {f"model.layers.{i}.mlp.experts.{name}": () for name in ("gate_up_proj", "down_proj")}


def _gpt_oss_from_hf(hf: dict) -> ModelConfig:
    refuse_switches(hf, "gpt_oss", {"swiglu_alpha": 1.702, "quantization_config": _mxfp4})
    common = _common(hf, "gpt_oss", GPT_OSS.defaults)
    n = common["n_layers"]
    # transformers' default when a config.json gives none: sliding, full, sliding, full, ...
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    window, layer_types = layer_windows(types, hf.get("sliding_window"), n, "gpt_oss")
    return build("gpt_oss", **common, ffn="swiglu_clamp", swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
                 attn_bias=bool(hf.get("attention_bias", True)), attn_sinks=True, ffn_bias=True,
                 ffn_dim=need(hf, "intermediate_size", "gpt_oss"), layer_types=layer_types, sliding_window=window,
                 n_experts=_n_experts(hf, "gpt_oss"), n_active_experts=need(hf, "num_experts_per_tok", "gpt_oss"),
                 router="softmax", router_renorm=True)


def _mxfp4(q: Any) -> bool:
    """gpt-oss's own quantization (MXFP4 experts): dequantized on reading (adapt_weights)."""
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def _gpt_oss_to_hf(cfg: ModelConfig) -> dict:
    return {**_common_out(cfg, GPT_OSS), "intermediate_size": cfg.expert_width, "num_local_experts": cfg.n_experts,
            "attention_bias": cfg.attn_bias, "layer_types": layer_types_out(cfg),
            "sliding_window": cfg.sliding_window or 128,  # read by no layer when every layer is full
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": 1.702}


# ----------------------------------------------------------------------------- the families

_BASE = dict(n_experts=lambda n: n > 0, norm="rms", norm_placement="pre", norm_offset=False, pos="rope",
             bias=False, qkv_bias=False, embed_scale=False, query_pre_attn_scalar=None, attn_softcap=None,
             logit_softcap=None, value_embeddings=False, rope_local_theta=None, nope_layers=None, n_shared_experts=0,
             router="softmax")


def _experts_as_wide(cfg: ModelConfig) -> list[str]:
    """Families whose config.json has one intermediate_size for every feed-forward (no separate expert width)."""
    return [] if cfg.expert_dim in (None, cfg.ffn_dim) else [f"expert_dim={cfg.expert_dim} (ffn_dim={cfg.ffn_dim})"]


MIXTRAL = MoEFamily(
    "mixtral", "MixtralForCausalLM", "model.", "model.embed_tokens.weight", _global, _mixtral_layer,
    _mixtral_from_hf, _mixtral_to_hf, (r"rotary_emb\.inv_freq$",),
    defaults={"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5},
    wants=dict(_BASE, ffn="swiglu", qk_norm=False, attn_bias=False, attn_sinks=False, ffn_bias=False,
               router_renorm=True, moe_layers=None, layer_types=None),
    extra_check=_experts_as_wide, fused=lambda cfg, i: _experts_fused(cfg, i, "block_sparse_moe.", _MIXTRAL_NAMES),
    rename=lambda k: re.sub(r"^(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe.", k),
)
QWEN3_MOE = MoEFamily(
    "qwen3_moe", "Qwen3MoeForCausalLM", "model.", "model.embed_tokens.weight", _global, _qwen3_moe_layer,
    _qwen3_moe_from_hf, _qwen3_moe_to_hf, (r"rotary_emb\.inv_freq$",),
    defaults={"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    wants=dict(_BASE, ffn="swiglu", qk_norm="head", attn_sinks=False, ffn_bias=False, layer_types=None),
    fused=lambda cfg, i: _experts_fused(cfg, i, "mlp.", _QWEN_NAMES),
)
OLMOE = MoEFamily(
    "olmoe", "OlmoeForCausalLM", "model.", "model.embed_tokens.weight", _global, _olmoe_layer,
    _olmoe_from_hf, _olmoe_to_hf, (r"rotary_emb\.inv_freq$",),
    defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    wants=dict(_BASE, ffn="swiglu", qk_norm="proj", attn_sinks=False, ffn_bias=False, moe_layers=None,
               layer_types=None, sliding_window=None),
    extra_check=_experts_as_wide, fused=lambda cfg, i: _experts_fused(cfg, i, "mlp.", _QWEN_NAMES),
)
GPT_OSS = MoEFamily(
    "gpt_oss", "GptOssForCausalLM", "model.", "model.embed_tokens.weight", _global, _gpt_oss_layer,
    _gpt_oss_from_hf, _gpt_oss_to_hf, (r"rotary_emb\.inv_freq$",),
    defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-5},
    wants=dict(_BASE, ffn="swiglu_clamp", qk_norm=False, attn_sinks=True, ffn_bias=True, router_renorm=True,
               moe_layers=None),
    extra_check=_experts_as_wide, fused=_gpt_oss_fused,
)

MOE_FAMILIES: dict[str, MoEFamily] = {f.name: f for f in (QWEN3_MOE, MIXTRAL, OLMOE, GPT_OSS)}

