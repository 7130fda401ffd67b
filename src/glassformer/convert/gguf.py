"""GGUF export for llama.cpp and Ollama: `glassformer convert --to-gguf CKPT --out FILE.gguf`.

Written with the `gguf` package (llama.cpp's own writer) one tensor at a time: the tensor
table first, from the shapes the config implies, then each tensor read, converted and written
before the next is read. Three llama.cpp graphs hold glassformer's own models: `llama` (RMSNorm,
RoPE on adjacent pairs, SwiGLU), `qwen2` (the same with Q/K/V biases, RoPE on half-split
pairs) and `gpt2` (LayerNorm, learned positions, tanh GELU, biases); the families of issue 45
have their own: `qwen3`, `gemma2`, `gemma3`, `olmo2` and `smollm3` (a Phi-3 model is the `llama`
graph's). What none holds, or what a graph hard-codes otherwise (Gemma's layer pattern, SmolLM3's
NoPE step), is refused by name. The tensor names, the pair permutation and the tokenizer keys:
docs/convert.md#gguf. The way back: gguf_read.py.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from ..errors import UserError
from .transforms import half_to_interleaved, interleaved_to_half

GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")
# glassformer's own keys: the config (what llama.cpp's keys cannot say: rope_pairs, the scaling's
# parameters) and the files beside tokenizer.json, so --from-gguf gives the checkpoint back.
CONFIG_KEY, TOKENIZER_FILES_KEY = "glassformer.config", "glassformer.tokenizer_files"
Q8_BLOCK = 32  # q8_0 quantizes blocks of 32 numbers along a row, each with one fp16 scale

# ModelConfig fields the GGUF graphs express (or that do not change the computation). A field added
# to ModelConfig later is refused by name when it leaves its default: llama.cpp would ignore it.
KNOWN_FIELDS = {
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len", "rope_theta",
    "rope_scaling", "rope_pairs", "norm_eps", "norm", "norm_placement", "ffn", "pos", "tie_embeddings", "bias",
    "qkv_bias", "sliding_window", "dropout", "attention", "attention_tile", "init_std", "quantization",
}


# ----------------------------------------------------------------------------- which graph


def _later_switches(cfg: ModelConfig) -> list[str]:
    return [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
            if f.name not in KNOWN_FIELDS and getattr(cfg, f.name) != f.default]


def _speedrun_off(cfg: ModelConfig) -> list[str]:
    """The speedrun switches (docs/model.md#speedrun-switches) that no graph glassformer writes holds, by name."""
    off = []
    if cfg.qk_norm:
        off.append(f"qk_norm={cfg.qk_norm!r} (llama.cpp's llama, qwen2 and gpt2 graphs normalise no query or key; its "
                   "qwen3, gemma3 and olmo2 graphs' q/k norms have a weight and come with their families' other parts)")
    if cfg.logit_softcap is not None:
        off.append(f"logit_softcap={cfg.logit_softcap} (no soft cap on the logits in llama.cpp's llama, qwen2 or gpt2 graph)")
    if cfg.value_embeddings:
        off.append("value_embeddings (no llama.cpp graph adds a token table to the values)")
    if cfg.ffn == "relu2":
        off.append("ffn='relu2' (squared ReLU: llama.cpp's llama graph has SwiGLU, its gpt2 graph GELU)")
    return off


def _gpt2_off(cfg: ModelConfig) -> list[str]:
    """What keeps cfg off llama.cpp's gpt2 graph (empty: it fits)."""
    wants = {"norm": "layer", "pos": "learned", "bias": True, "ffn": "gelu_tanh", "n_kv_heads": cfg.n_heads,
             "head_dim": cfg.dim // cfg.n_heads}
    return [f"{k}={getattr(cfg, k)!r} (gpt2 needs {v!r})" for k, v in wants.items() if getattr(cfg, k) != v]


def _llama_off(cfg: ModelConfig) -> list[str]:
    """What keeps cfg off llama.cpp's llama/qwen2 graphs, by name (empty: it fits)."""
    off = []
    if cfg.norm != "rms":
        off.append("LayerNorm (the llama graph normalises with RMSNorm)")
    if cfg.ffn != "swiglu":
        off.append(f"a {cfg.ffn.upper().replace('_', ' ')} feed-forward (the llama graph has SwiGLU)")
    if cfg.pos != "rope":
        off.append(f"{'learned' if cfg.pos == 'learned' else 'no'} positions (the llama graph has RoPE)")
    if cfg.bias:
        off.append("biases outside q/k/v (the llama graph has biases on q, k and v at most)")
    return off


# The Hugging Face families of issue 45 that have a llama.cpp graph of their own (Phi-3's is the llama graph).
FAMILY_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "olmo2": "olmo2", "smollm3": "smollm3"}
HALF_PAIRS = ("qwen2", "qwen3", "gemma2", "gemma3", "olmo2",  # graphs that rotate (i, i+H/2): llama.cpp's NEOX RoPE
              "qwen3moe", "olmoe", "gpt-oss")
GEMMA = ("gemma2", "gemma3")
# What llama.cpp hard-codes for each graph (llama-model.cpp's load_hparams): Gemma 2 slides every other layer
# from the first, Gemma 3 five of every six with a local RoPE base of 10,000; SmolLM3 drops RoPE on every 4th
# layer; Gemma scales queries by 1/√H except at 27B (46 and 62 layers), where it takes D/N.
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
SMOLLM3_NOPE_STEP, GEMMA3_LOCAL_THETA = 4, 10000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _family(cfg: ModelConfig) -> str | None:
    """The Hugging Face family that holds cfg, or None (the older graphs' checks then name what is off)."""
    from .families import family_for

    try:
        return family_for(cfg).name
    except UserError:
        return None


def _window(cfg: ModelConfig, layer: int) -> int | None:
    """Layer `layer`'s window as it acts within the context: one as long as the context slides nothing."""
    w = cfg.window_at(layer)
    return w if w is not None and w < cfg.max_seq_len else None


def _family_off(cfg: ModelConfig, arch: str) -> list[str]:
    """What keeps a model of a new family off its llama.cpp graph, by name (empty: it runs exactly)."""
    off = []
    if cfg.attn_bias:
        off.append("attn_bias=True (the graph has no biases on the projections)")
    sc = cfg.rope_scaling
    if sc is not None and sc.get("rope_type", sc.get("type")) != "linear":
        off.append(f"rope_scaling {sc.get('rope_type', sc.get('type'))!r} (glassformer writes linear scaling only "
                   "to these graphs)")
    every = SWA_PATTERN.get(arch)
    want = [cfg.sliding_window if every and i % every < every - 1 else None for i in range(cfg.n_layers)]
    have = [_window(cfg, i) for i in range(cfg.n_layers)]
    if every is None and any(have):
        off.append(f"sliding_window={cfg.sliding_window} below the context ({cfg.max_seq_len}) (the graph attends "
                   "to the whole context)")
    elif every and have != [w if w is not None and w < cfg.max_seq_len else None for w in want] and any(have):
        off.append(f"sliding layers {[i for i, w in enumerate(have) if w]} (the graph slides "
                   f"{'every other layer from the first' if every == 2 else 'five layers of every six'})")
    if arch == "smollm3":
        nope = [i for i in range(cfg.n_layers) if (i + 1) % SMOLLM3_NOPE_STEP == 0]
        if (cfg.nope_layers or []) != nope:
            off.append(f"nope_layers={cfg.nope_layers} (the graph drops RoPE on every {SMOLLM3_NOPE_STEP}th layer: {nope})")
    if arch in GEMMA:
        scale = cfg.dim // cfg.n_heads if cfg.n_layers == GEMMA_27B_LAYERS[arch] else cfg.head_dim
        if (cfg.query_pre_attn_scalar or cfg.head_dim) != scale:
            off.append(f"query_pre_attn_scalar={cfg.query_pre_attn_scalar} (the graph scales queries by 1/√{scale})")
    if arch == "gemma2" and not cfg.tie_embeddings:
        off.append("tie_embeddings=False (the gemma2 graph reads its head from the token embedding)")
    if arch == "gemma2" and (cfg.attn_softcap is None or cfg.logit_softcap is None):
        off.append(f"attn_softcap={cfg.attn_softcap}, logit_softcap={cfg.logit_softcap} (the gemma2 graph always "
                   "soft-caps both)")
    if arch == "gemma3":
        if cfg.attn_softcap is not None or cfg.logit_softcap is not None:
            off.append(f"attn_softcap={cfg.attn_softcap}, logit_softcap={cfg.logit_softcap} (the gemma3 graph caps neither)")
        if any(have) and (cfg.rope_local_theta or cfg.rope_theta) != GEMMA3_LOCAL_THETA:
            off.append(f"rope_local_theta={cfg.rope_local_theta} (the graph's sliding layers turn by base "
                       f"{GEMMA3_LOCAL_THETA:,.0f})")
    return off


def gguf_arch(cfg: ModelConfig) -> str:
    """'llama', 'qwen2', 'gpt2' or a new family's graph (FAMILY_ARCH): the llama.cpp graph that computes
    exactly what cfg does, or a UserError naming every switch that none of them has."""
    if not cfg.has_ffn:
        raise UserError("ffn='none' (attention-only blocks): llama.cpp's llama, qwen2 and gpt2 graphs have a "
                        "feed-forward in each block: export refused")
    if cfg.norm_placement == "post":
        raise UserError("post-norm models have no llama.cpp graph (llama.cpp's llama, qwen2 and gpt2 are pre-norm): export refused")
    family = _family(cfg)
    if family in MOE_ARCH:
        return moe_arch(cfg, family)
    if family in FAMILY_ARCH:
        arch = FAMILY_ARCH[family]
        off = _family_off(cfg, arch)
        if off:
            raise UserError(f"llama.cpp's {arch} graph cannot run this {family} model: {'; '.join(off)}: export refused")
        return arch
    speedrun = _speedrun_off(cfg)
    if speedrun:
        raise UserError(f"{'; '.join(speedrun)}: no place for it in a GGUF file llama.cpp can run; "
                        "train without it to export to GGUF: export refused")
    later = _later_switches(cfg)
    if later:
        raise UserError(f"llama.cpp has no equivalent of {', '.join(later)}: export refused")
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        raise UserError(f"sliding_window={cfg.sliding_window} is below the context ({cfg.max_seq_len}); llama.cpp's "
                        "llama and qwen2 graphs attend to the whole context: export refused")
    llama_off = _llama_off(cfg)
    if not llama_off:
        if cfg.qkv_bias and (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type")) == "llama3":
            raise UserError("llama3 rope scaling with Q/K/V biases: llama.cpp's qwen2 graph has no rope_freqs: export refused")
        return "qwen2" if cfg.qkv_bias else "llama"
    if not _gpt2_off(cfg):
        return "gpt2"
    raise UserError(f"llama.cpp's llama graph cannot run this model: it has {'; '.join(llama_off)}; "
                    f"and the gpt2 graph does not fit either: {'; '.join(_gpt2_off(cfg))}")


# ----------------------------------------------------------------------------- tensor rules


def rope_to_graph(t: torch.Tensor, heads: int, cfg: ModelConfig, arch: str) -> torch.Tensor:
    """Q or K rows (or biases, or q/k norm weights) from our pair layout to the graph's: llama.cpp's
    llama and smollm3 rotate adjacent pairs (2i, 2i+1), the others half-split pairs (i, i+H/2)."""
    want = "half" if arch in HALF_PAIRS else "interleaved"
    if cfg.rope_pairs == want:
        return t
    return half_to_interleaved(t, heads, cfg.head_dim) if want == "interleaved" else interleaved_to_half(t, heads, cfg.head_dim)


def rope_from_graph(t: torch.Tensor, heads: int, cfg: ModelConfig, arch: str) -> torch.Tensor:
    """Inverse of rope_to_graph."""
    have = "half" if arch in HALF_PAIRS else "interleaved"
    if cfg.rope_pairs == have:
        return t
    return interleaved_to_half(t, heads, cfg.head_dim) if have == "interleaved" else half_to_interleaved(t, heads, cfg.head_dim)


ROPE_HEADS = {"rope_q": lambda cfg: cfg.n_heads, "rope_k": lambda cfg: cfg.n_kv_heads, "rope_head": lambda cfg: 1}


@dataclass(frozen=True)
class GRule:
    """One GGUF tensor <-> one or more of ours; kind: copy, rope_q, rope_k, rope_head (a head's norm
    weight), qkv (rows stacked), or offset (Gemma's norms: llama.cpp multiplies by the stored weight,
    so it stores 1 + w, as llama.cpp's own converter does), or rope_head+offset (Gemma 3's q/k norms)."""

    gguf: str
    ours: tuple[str, ...]
    kind: str = "copy"

    def to_gguf(self, ts: list[torch.Tensor], cfg: ModelConfig, arch: str) -> torch.Tensor:
        if self.kind == "qkv":
            return torch.cat(ts, dim=0)  # (N·H + 2·K·H, D) or its bias
        if self.kind == "experts":
            return torch.stack(ts)  # E × (F, D) -> (E, F, D): llama.cpp's *_exps tensors, or their biases
        kind, offset = self.kind.removesuffix("+offset"), self.kind.endswith("offset")
        t = ts[0].float() + 1.0 if offset else ts[0]
        return rope_to_graph(t, ROPE_HEADS[kind](cfg), cfg, arch) if kind in ROPE_HEADS else t

    def to_ours(self, t: torch.Tensor, cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
        if self.kind == "qkv":
            return dict(zip(self.ours, t.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=0)))  # (N·H, D), 2 × (K·H, D)
        if self.kind == "experts":
            if t.shape[0] != len(self.ours):
                raise ValueError(f"{t.shape[0]} experts stored, {len(self.ours)} in the config")
            return dict(zip(self.ours, t.unbind(0)))
        kind, offset = self.kind.removesuffix("+offset"), self.kind.endswith("offset")
        if kind in ROPE_HEADS:
            t = rope_from_graph(t, ROPE_HEADS[kind](cfg), cfg, arch)
        return {self.ours[0]: t.float() - 1.0 if offset else t}


def _layer_rules(cfg: ModelConfig, arch: str, i: int) -> list[GRule]:
    b, o = f"blk.{i}.", f"blocks.{i}."
    if cfg.n_experts:
        return _moe_layer_rules(cfg, arch, b, o)
    if arch == "gpt2":
        qkv = [o + f"attn.w{x}" for x in "qkv"]
        rules = [GRule(b + "attn_qkv.weight", tuple(k + ".weight" for k in qkv), "qkv"),
                 GRule(b + "attn_qkv.bias", tuple(k + ".bias" for k in qkv), "qkv")]
        pairs = [("attn_norm", "attn_norm"), ("attn_output", "attn.wo"), ("ffn_norm", "ffn_norm"),
                 ("ffn_up", "ffn.w_up"), ("ffn_down", "ffn.w_down")]
        rules += [GRule(f"{b}{g}.{p}", (f"{o}{ours}.{p}",)) for g, ours in pairs for p in ("weight", "bias")]
        return rules
    if arch in FAMILY_ARCH.values():
        return _family_layer_rules(cfg, arch, b, o)
    rules = [GRule(b + "attn_norm.weight", (o + "attn_norm.weight",)),
             GRule(b + "attn_q.weight", (o + "attn.wq.weight",), "rope_q"),
             GRule(b + "attn_k.weight", (o + "attn.wk.weight",), "rope_k"),
             GRule(b + "attn_v.weight", (o + "attn.wv.weight",))]
    if cfg.qkv_bias:
        rules += [GRule(b + "attn_q.bias", (o + "attn.wq.bias",), "rope_q"),
                  GRule(b + "attn_k.bias", (o + "attn.wk.bias",), "rope_k"),
                  GRule(b + "attn_v.bias", (o + "attn.wv.bias",))]
    return rules + [GRule(b + "attn_output.weight", (o + "attn.wo.weight",)),
                    GRule(b + "ffn_norm.weight", (o + "ffn_norm.weight",)),
                    GRule(b + "ffn_gate.weight", (o + "ffn.w_gate.weight",)),
                    GRule(b + "ffn_up.weight", (o + "ffn.w_up.weight",)),
                    GRule(b + "ffn_down.weight", (o + "ffn.w_down.weight",))]


def _family_layer_rules(cfg: ModelConfig, arch: str, b: str, o: str) -> list[GRule]:
    """qwen3, gemma2, gemma3, olmo2, smollm3: llama's tensors, plus q/k norms and the norms after each
    sublayer where the family has them (OLMo 2's sit only there: our attn_norm/ffn_norm)."""
    norm = "offset" if arch in GEMMA else "copy"
    head = cfg.qk_norm == "head"
    rules = [] if arch == "olmo2" else [GRule(b + "attn_norm.weight", (o + "attn_norm.weight",), norm)]
    rules += [GRule(b + "attn_q.weight", (o + "attn.wq.weight",), "rope_q"),
              GRule(b + "attn_k.weight", (o + "attn.wk.weight",), "rope_k"),
              GRule(b + "attn_v.weight", (o + "attn.wv.weight",))]
    if cfg.qk_norm in ("head", "proj"):
        plus = "+offset" if arch in GEMMA else ""  # Gemma 3's q/k norms are (1 + w) norms too
        rules += [GRule(b + "attn_q_norm.weight", (o + "attn.q_norm.weight",), ("rope_head" if head else "rope_q") + plus),
                  GRule(b + "attn_k_norm.weight", (o + "attn.k_norm.weight",), ("rope_head" if head else "rope_k") + plus)]
    rules.append(GRule(b + "attn_output.weight", (o + "attn.wo.weight",)))
    if arch == "olmo2":
        rules.append(GRule(b + "post_attention_norm.weight", (o + "attn_norm.weight",)))
    elif arch in GEMMA:
        rules.append(GRule(b + "post_attention_norm.weight", (o + "attn_post_norm.weight",), norm))
    if arch != "olmo2":
        rules.append(GRule(b + "ffn_norm.weight", (o + "ffn_norm.weight",), norm))
    rules += [GRule(b + "ffn_gate.weight", (o + "ffn.w_gate.weight",)),
              GRule(b + "ffn_up.weight", (o + "ffn.w_up.weight",)),
              GRule(b + "ffn_down.weight", (o + "ffn.w_down.weight",))]
    if arch == "olmo2":
        rules.append(GRule(b + "post_ffw_norm.weight", (o + "ffn_norm.weight",)))
    elif arch in GEMMA:
        rules.append(GRule(b + "post_ffw_norm.weight", (o + "ffn_post_norm.weight",), norm))
    return rules


def gguf_rules(cfg: ModelConfig, arch: str) -> list[GRule]:
    """Every GGUF tensor of the graph, in llama.cpp's order; a tied head has no output.weight."""
    rules = [GRule("token_embd.weight", ("embed.weight",))]
    if arch == "gpt2":
        rules.append(GRule("position_embd.weight", ("pos_embed.weight",)))
    for i in range(cfg.n_layers):
        rules += _layer_rules(cfg, arch, i)
    rules.append(GRule("output_norm.weight", ("final_norm.weight",), "offset" if arch in GEMMA else "copy"))
    if arch == "gpt2":
        rules.append(GRule("output_norm.bias", ("final_norm.bias",)))
    if not cfg.tie_embeddings:
        rules.append(GRule("output.weight", ("lm_head.weight",)))
    return rules


def rope_freqs(cfg: ModelConfig) -> torch.Tensor | None:
    """Llama 3.1's scaling as llama.cpp takes it: per pair, what its frequency is divided by
    (plain / scaled, from the model's own rope_inv_freq); None without llama3 scaling."""
    from ..model import rope_inv_freq

    sc = cfg.rope_scaling
    if sc is None or sc.get("rope_type", sc.get("type")) != "llama3":
        return None
    return rope_inv_freq(cfg.replace(rope_scaling=None)) / rope_inv_freq(cfg)  # (H/2,)


# ----------------------------------------------------------------------------- mixtures of experts
# families_moe.py's families on llama.cpp's graphs: Qwen3-MoE on qwen3moe, OLMoE on olmoe, gpt-oss on gpt-oss
# and Mixtral on the llama graph (which runs experts when its file has them). Each graph hard-codes parts of
# the mixture (llama-model.cpp's builders): qwen3moe and llama renormalise the chosen k weights, olmoe does
# not; every layer is a mixture; gpt-oss's SwiGLU clamps at 7 with α = 1.702 and slides every other layer
# from the first; a model that differs is refused by name.

MOE_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss", "mixtral": "llama"}
MOE_RENORM = {"qwen3moe": True, "olmoe": False, "llama": True, "gpt-oss": True}
GPT_OSS_LIMIT = 7.0


def _moe_off(cfg: ModelConfig, arch: str) -> list[str]:
    """What keeps a mixture off its llama.cpp graph, by name (empty: it runs exactly)."""
    off = []
    if cfg.router_renorm != MOE_RENORM[arch]:
        off.append(f"router_renorm={cfg.router_renorm} (the {arch} graph {'re' if MOE_RENORM[arch] else 'never re'}"
                   "normalises the chosen experts' weights)")
    if cfg.moe_layers is not None:
        off.append(f"moe_layers={cfg.moe_layers} (every layer of the {arch} graph is a mixture)")
    have = [_window(cfg, i) for i in range(cfg.n_layers)]
    sc = cfg.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if arch == "gpt-oss":
        want = [cfg.sliding_window if i % 2 == 0 else None for i in range(cfg.n_layers)]
        if any(have) and have != [w if w is not None and w < cfg.max_seq_len else None for w in want]:
            off.append(f"sliding layers {[i for i, w in enumerate(have) if w]} (the gpt-oss graph slides every other "
                       "layer from the first)")
        if cfg.swiglu_limit != GPT_OSS_LIMIT:
            off.append(f"swiglu_limit={cfg.swiglu_limit} (the gpt-oss graph clamps at {GPT_OSS_LIMIT})")
        if kind not in (None, "yarn"):
            off.append(f"rope_scaling {kind!r} (glassformer writes YaRN or none to the gpt-oss graph)")
        if not cfg.attn_bias:
            off.append("attn_bias=False (the gpt-oss graph reads biases on q, k, v and the output)")
    else:
        if any(have):
            off.append(f"sliding_window={cfg.sliding_window} below the context ({cfg.max_seq_len}) (the {arch} graph "
                       "attends to the whole context)")
        if kind not in (None, "linear") and not (arch == "llama" and kind == "llama3"):
            off.append(f"rope_scaling {kind!r} (glassformer writes linear scaling only to the {arch} graph)")
        if cfg.attn_bias:
            off.append(f"attn_bias=True (the {arch} graph has no biases on the projections)")
    if arch == "olmoe" and cfg.n_kv_heads != cfg.n_heads:
        off.append(f"n_kv_heads={cfg.n_kv_heads} (the olmoe graph's key norm is as wide as the model: one key head "
                   "per query head)")
    return off


def moe_arch(cfg: ModelConfig, family: str) -> str:
    arch = MOE_ARCH[family]
    off = _moe_off(cfg, arch)
    if off:
        raise UserError(f"llama.cpp's {arch} graph cannot run this {family} model: {'; '.join(off)}: export refused")
    return arch


def _moe_layer_rules(cfg: ModelConfig, arch: str, b: str, o: str) -> list[GRule]:
    """Attention as llama's (with q/k norms, biases and sinks where the family has them), then the router
    and each expert matrix stacked over the experts (ffn_{gate,up,down}_exps, (E, F, D) / (E, D, F))."""
    rules = [GRule(b + "attn_norm.weight", (o + "attn_norm.weight",))]
    for g, ours, kind in (("attn_q", "wq", "rope_q"), ("attn_k", "wk", "rope_k"), ("attn_v", "wv", "copy"),
                          ("attn_output", "wo", "copy")):
        rules.append(GRule(f"{b}{g}.weight", (f"{o}attn.{ours}.weight",), kind))
        if cfg.attn_bias:
            rules.append(GRule(f"{b}{g}.bias", (f"{o}attn.{ours}.bias",), kind))
    if cfg.qk_norm in ("head", "proj"):
        head = cfg.qk_norm == "head"
        rules += [GRule(b + "attn_q_norm.weight", (o + "attn.q_norm.weight",), "rope_head" if head else "rope_q"),
                  GRule(b + "attn_k_norm.weight", (o + "attn.k_norm.weight",), "rope_head" if head else "rope_k")]
    if cfg.attn_sinks:
        rules.append(GRule(b + "attn_sinks.weight", (o + "attn.sinks",)))
    # gpt-oss's graph names the norm before the feed-forward post_attention_norm (Hugging Face's name for it)
    rules.append(GRule(b + ("post_attention_norm" if arch == "gpt-oss" else "ffn_norm") + ".weight", (o + "ffn_norm.weight",)))
    experts = [f"{o}ffn.experts.{e}." for e in range(cfg.n_experts)]
    params = ("weight", "bias") if cfg.ffn_bias else ("weight",)
    rules += [GRule(f"{b}ffn_gate_inp.{p}", (f"{o}ffn.router.{p}",)) for p in params]
    for g, ours in (("ffn_gate_exps", "w_gate"), ("ffn_up_exps", "w_up"), ("ffn_down_exps", "w_down")):
        rules += [GRule(f"{b}{g}.{p}", tuple(f"{x}{ours}.{p}" for x in experts), "experts") for p in params]
    return rules


def _moe_hparams(w, cfg: ModelConfig, arch: str) -> None:
    w.add_expert_count(cfg.n_experts)
    w.add_expert_used_count(cfg.n_active_experts)
    w.add_expert_feed_forward_length(cfg.expert_width)
    if arch != "gpt-oss":
        return
    from gguf import RopeScalingType

    slides = any(_window(cfg, i) for i in range(cfg.n_layers))
    w.add_sliding_window(cfg.sliding_window if slides else cfg.max_seq_len)
    sc = cfg.rope_scaling
    if sc is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))


# ----------------------------------------------------------------------------- tensor types


def tensor_type(name: str, shape: tuple[int, ...], dtype: str):
    """The GGML type a tensor is stored as: 1-D tensors (norms, biases) and every bias (the experts'
    are (E, F): llama.cpp adds them only in f32) stay f32, and under q8_0 a matrix whose rows are not
    a multiple of 32 long is stored f16."""
    from gguf import GGMLQuantizationType as Q

    if len(shape) == 1 or dtype == "f32" or name == "rope_freqs.weight" or name.endswith(".bias"):
        return Q.F32
    if dtype == "q8_0":
        return Q.Q8_0 if shape[-1] % Q8_BLOCK == 0 else Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16}[dtype]


def nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    return n // block * size


def encode_tensor(t: torch.Tensor, qtype):
    """The bytes of t as GGML type qtype, as a numpy array in GGUF's (numpy) order."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    t = t.detach().to("cpu")
    if qtype == Q.F32:
        return t.float().contiguous().numpy()
    if qtype == Q.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16:  # numpy has no bfloat16: torch rounds (to nearest even), the bits are written
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return quants.quantize(t.float().contiguous().numpy().astype(np.float32, copy=False), qtype)


def file_type(dtype: str) -> int:
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0}[dtype]


# ----------------------------------------------------------------------------- the source checkpoint


@dataclass
class Source:
    """A checkpoint to export: its config, a reader of our tensors by name (one at a time), its
    tokenizer (and tokenizer.json's exact text) and the dtype it stores."""

    config: ModelConfig
    read: Callable[[str], torch.Tensor]
    tokenizer: object | None
    tokenizer_json: str | None
    stored: str
    name: str
    notes: list[str]
    side_files: dict[str, str] = dataclasses.field(default_factory=dict)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8}


def safetensors_index(file: Path) -> tuple[int, dict]:
    """(where the data starts, name -> {dtype, shape, data_offsets}) from a safetensors file's header,
    once safetensors has checked it (its length and every tensor's offsets inside the file)."""
    from ..checkpoint.checks import open_safetensors

    open_safetensors(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _native_reader(file: Path, cfg: ModelConfig) -> Callable[[str], torch.Tensor]:
    """Our tensors by name, each read from the file when asked (no memory map, whose pages would stay
    resident: the export holds one tensor, and what it becomes, at a time)."""
    start, index = safetensors_index(file)

    def raw(key: str) -> torch.Tensor:
        entry = index[key]
        a, b = entry["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + a)
            buf = bytearray(b - a)
            f.readinto(buf)  # straight into the tensor's storage: no second copy
        return torch.frombuffer(buf, dtype=_SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])  # (n,) -> stored shape

    def read(key: str) -> torch.Tensor:
        if key == "lm_head.weight" and cfg.tie_embeddings:
            key = "embed.weight"
        scale = key[: -len("weight")] + "weight_scale"
        if key.endswith(".weight") and scale in index:  # int8: q · scale, per output channel
            return raw(key).float() * raw(scale).float()[:, None]
        return raw(key)

    return read


def _stored_name(file: Path) -> str:
    names = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
    kinds = {e["dtype"] for e in safetensors_index(file)[1].values()} - {"I8"}
    return names.get(kinds.pop(), "f32") if len(kinds) == 1 else "f32"


def open_source(src: str | Path) -> Source:
    """The checkpoint, run or Hugging Face folder `src`, ready to be read tensor by tensor."""
    from ..checkpoint.checks import check_layers_held, model_config, open_safetensors
    from ..checkpoint.folders import FORMAT, read_config, resolve

    folder = resolve(src)
    meta = read_config(folder)
    name = folder.parent.name if folder.name.startswith("step-") else folder.name  # a run's checkpoint: the run
    tok_json = (folder / "tokenizer.json").read_text(encoding="utf-8") if (folder / "tokenizer.json").is_file() else None
    tok = _tokenizer(folder) if tok_json is not None else None
    side = _side_files(folder) if tok_json is not None else {}
    if meta.get("format") == FORMAT and "lora" not in meta:
        cfg, file = model_config(meta, folder / "config.json"), folder / "model.safetensors"
        # read one tensor at a time (no memory limit), but a config that outgrows its file is refused first
        check_layers_held(cfg, folder / "config.json", open_safetensors(file).keys(), file)
        notes = [] if tok is not None else [f"{folder} has no tokenizer.json: the GGUF file has no vocabulary, "
                                            "which llama.cpp needs to load it"]
        if cfg.quantization is not None:
            notes.append(f"{folder} stores int8 weights: they are dequantized (q · scale) and written in the chosen type")
        return Source(cfg, _native_reader(file, cfg), tok, tok_json, _stored_name(file), name, notes, side)
    from ..checkpoint.loading import load

    # A Hugging Face folder (its tensors map through the family rules) or a LoRA adapter on its
    # base: read whole, the adapter merged into the base's weights as `convert --merge-lora` does.
    model, _ = load(folder)
    notes = []
    if "lora" in meta:
        from .lora import merge_lora

        merge_lora(model)  # refuses an int8 base, saying how to go instead
        notes.append(f"{src} is a LoRA adapter: merged into its base (W + (alpha/r)·B·A, as "
                     "`glassformer convert --merge-lora` does) before the export")
    state = model.state_dict()
    stored = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[next(model.parameters()).dtype]
    return Source(model.config, state.__getitem__, tok, tok_json, stored, name, notes, side)


def _side_files(folder: Path) -> dict[str, str]:
    """The files beside tokenizer.json (tokenizer_config.json, templates, generation_config.json) by
    relative name, as text: --from-gguf writes them back as they were."""
    from ..checkpoint.folders import TOKENIZER_SIDE_DIR, TOKENIZER_SIDE_FILES

    files = [folder / n for n in TOKENIZER_SIDE_FILES] + sorted((folder / TOKENIZER_SIDE_DIR).glob("*.jinja"))
    return {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in files if p.is_file()}


def _tokenizer(folder: Path):
    from ..text.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder)


# ----------------------------------------------------------------------------- writing


def _hparams(w, cfg: ModelConfig, arch: str) -> None:
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "gpt2":
        w.add_layer_norm_eps(cfg.norm_eps)
        return
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    sc = cfg.rope_scaling
    if sc is not None and sc.get("rope_type", sc.get("type")) == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(sc["factor"]))
    if arch in GEMMA:  # the graph slides its pattern's layers: a window as long as the context slides nothing
        slides = any(_window(cfg, i) for i in range(cfg.n_layers))
        w.add_sliding_window(cfg.sliding_window if slides else cfg.max_seq_len)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_softcap)
        w.add_final_logit_softcapping(cfg.logit_softcap)
    if cfg.n_experts:
        _moe_hparams(w, cfg, arch)


def _add_fields(w, fields: dict) -> None:
    """Tokenizer keys by their Python type; ids and flags get llama.cpp's types."""
    from gguf import GGUFValueType as V

    for key, value in fields.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_key_value(key, value, V.STRING)
        elif key.endswith("scores"):
            w.add_key_value(key, value, V.ARRAY, sub_type=V.FLOAT32)
        elif key.endswith("token_type"):
            w.add_key_value(key, value, V.ARRAY, sub_type=V.INT32)
        else:
            w.add_key_value(key, value, V.ARRAY, sub_type=V.STRING)


def _plan(source: Source, arch: str, dtype: str) -> list[tuple[str, Callable[[], torch.Tensor], tuple, object]]:
    """(GGUF name, reader, numpy shape, GGML type) per tensor, from the config's shapes (nothing read)."""
    from .hf import our_shapes

    cfg = source.config
    shapes = our_shapes(cfg)
    shapes.setdefault("lm_head.weight", shapes["embed.weight"])
    plan = []
    for rule in gguf_rules(cfg, arch):
        parts = [shapes[k] for k in rule.ours]
        shape = (sum(p[0] for p in parts), *parts[0][1:]) if rule.kind == "qkv" else parts[0]
        shape = (len(parts), *parts[0]) if rule.kind == "experts" else shape
        read = (lambda r=rule: r.to_gguf([source.read(k) for k in r.ours], cfg, arch))
        plan.append((rule.gguf, read, tuple(shape), tensor_type(rule.gguf, tuple(shape), dtype)))
    freqs = rope_freqs(cfg) if arch == "llama" else None
    if freqs is not None:
        plan.append(("rope_freqs.weight", lambda: freqs, tuple(freqs.shape), tensor_type("rope_freqs.weight", (1,), "f32")))
    return plan


def _write(path: Path, source: Source, arch: str, dtype: str, progress: bool) -> None:
    import gguf
    from tqdm import tqdm

    cfg = source.config
    w = gguf.GGUFWriter(path, arch)
    w.add_name(source.name)
    w.add_file_type(file_type(dtype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _hparams(w, cfg, arch)
    if source.tokenizer is not None:
        from .gguf_tokenizer import tokenizer_fields

        _add_fields(w, tokenizer_fields(source.tokenizer, source.tokenizer_json, cfg.vocab_size))
    w.add_string(CONFIG_KEY, json.dumps({**cfg.to_dict(), "quantization": None}))
    if source.side_files:
        w.add_string(TOKENIZER_FILES_KEY, json.dumps(source.side_files, ensure_ascii=False))
    plan = _plan(source, arch, dtype)
    for name, _, shape, qtype in plan:
        w.add_tensor_info(name, shape, torch.float32, nbytes(shape, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    try:
        for name, read, shape, qtype in tqdm(plan, desc="gguf", unit="tensor", disable=not progress):
            data = encode_tensor(read(), qtype)
            w.write_tensor_data(data)
            del data
        w.flush()
    finally:
        w.close()


def check_gguf_dtype(dtype: str | None) -> str | None:
    if dtype is not None and dtype not in GGUF_DTYPES:
        raise UserError(f"--dtype {dtype!r} cannot be written to GGUF: choose one of {', '.join(GGUF_DTYPES)}")
    return dtype


def export_gguf(src: str | Path, out: str | Path, dtype: str | None = None, progress: bool = True) -> tuple[Source, str, str]:
    """Write checkpoint `src` as the GGUF file `out` (which must not exist): (source, arch, dtype).
    dtype: f32, f16, bf16 or q8_0 (None: the stored dtype). Written to a temporary name and renamed,
    so an error leaves nothing at `out`."""
    import os

    out = Path(out)
    check_gguf_dtype(dtype)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new file name or remove it first")
    if out.suffix != ".gguf":
        raise UserError(f"--out {out} should end in .gguf (llama.cpp and Ollama look for that name)")
    source = open_source(src)
    arch = gguf_arch(source.config)
    dtype = dtype or source.stored
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _write(tmp, source, arch, dtype, progress)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return source, arch, dtype
