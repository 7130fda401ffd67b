"""ModelConfig: every size and switch of the model in one dataclass, with named presets.

Field names follow Meta's llama3 `ModelArgs` where one exists. Sizes that are left as
None (`n_kv_heads`, `head_dim`, `ffn_dim`) are resolved in `__post_init__`, so after
construction every size is a plain int.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

NORMS = ("rms", "layer")
PLACEMENTS = ("pre", "post", "sandwich", "post_branch")
FFNS = ("swiglu", "geglu", "swiglu_clamp", "relu", "relu2", "gelu", "gelu_tanh", "none")
GATED_FFNS = ("swiglu", "geglu", "swiglu_clamp")  # a gate and an up projection, multiplied
QK_NORMS = (False, True, "head", "proj")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROUTERS = ("softmax", "sigmoid")
POSITIONS = ("rope", "learned", "none")
ATTENTIONS = ("sdpa", "naive", "tiled")
ROPE_PAIRS = ("half", "interleaved")
ROPE_SCALINGS = ("llama3", "linear", "yarn")


# The kind of each ModelConfig field that __post_init__ does not check otherwise: (kind, may be None).
FIELD_KINDS = {
    "n_kv_heads": (int, True), "head_dim": (int, True), "ffn_dim": (int, True), "sliding_window": (int, True),
    "rope_theta": (float, False), "norm_eps": (float, False), "dropout": (float, False), "init_std": (float, False),
    "tie_embeddings": (bool, False), "bias": (bool, False), "qkv_bias": (bool, False),
    "rope_scaling": (dict, True), "quantization": (dict, True),
    "norm_offset": (bool, False), "embed_scale": (bool, False), "query_pre_attn_scalar": (float, True),
    "attn_softcap": (float, True), "swiglu_limit": (float, False), "layer_types": (list, True),
    "rope_local_theta": (float, True), "nope_layers": (list, True), "attn_bias": (bool, False),
    "attn_sinks": (bool, False), "n_experts": (int, False), "n_active_experts": (int, False),
    "n_shared_experts": (int, False), "expert_dim": (int, True), "router_renorm": (bool, False),
    "moe_layers": (list, True), "ffn_bias": (bool, False), "router_aux_loss_coef": (float, False),
}
KIND_WORDS = {int: "a whole number", float: "a number", bool: "true or false", dict: "an object", list: "a list"}
# The largest value each count may take: a hand-edited or hostile config.json is refused before any
# weight is allocated (the same guard as checkpoint/checks.py's size checks).
MOST_EXPERTS = 4096


def _swiglu_width(dim: int) -> int:
    """Llama's rule: 2/3 of 4·dim (so SwiGLU's three matrices cost what two would), rounded up to 32."""
    return 32 * math.ceil(int(8 * dim / 3) / 32)


def _default_ffn_width(ffn: str, dim: int) -> int:
    """F when none is given: SwiGLU's width, 4·dim for the others, 0 without a feed-forward."""
    if ffn == "none":
        return 0
    return _swiglu_width(dim) if ffn in GATED_FFNS else 4 * dim


@dataclass
class ModelConfig:
    """The shape and the switches of one glassformer model."""

    vocab_size: int = 512
    """V: number of token ids (follows the tokenizer)."""
    dim: int = 64
    """D: width of the residual stream."""
    n_layers: int = 2
    """L: number of blocks."""
    n_heads: int = 4
    """N: query heads per attention layer."""
    n_kv_heads: int | None = None
    """K: key/value heads (None = n_heads, MHA; 1 = MQA; between = GQA)."""
    head_dim: int | None = None
    """H: size of one head (None = dim // n_heads)."""
    ffn_dim: int | None = None
    """F: feed-forward width (None = 8·dim/3 rounded up to 32 for SwiGLU, 4·dim otherwise; 0 with ffn='none')."""
    max_seq_len: int = 256
    """Longest context the model accepts (positions 0 … max_seq_len-1)."""
    rope_theta: float = 10000.0
    """RoPE base: pair i turns theta^(-2i/H) radians per position."""
    rope_scaling: dict | None = None
    """None, or a Hugging Face rope_scaling dict ({'rope_type': 'llama3'|'linear', ...})."""
    rope_pairs: str = "half"
    """How RoPE pairs features: 'half' (i with i+H/2, Hugging Face) or 'interleaved' (2i with 2i+1, Meta)."""
    norm_eps: float = 1e-5
    """Epsilon inside the norms."""
    norm: str = "rms"
    """'rms' (RMSNorm) or 'layer' (LayerNorm)."""
    norm_placement: str = "pre"
    """'pre' (norm before each sublayer, Llama/GPT-2) or 'post' (after each addition, the 2017 Transformer)."""
    ffn: str = "swiglu"
    """'swiglu', 'relu', 'relu2' (relu(x)², nanochat), 'gelu', 'gelu_tanh', or 'none': attention-only blocks, no feed-forward sublayer."""
    pos: str = "rope"
    """'rope', 'learned' (absolute, GPT-2) or 'none'."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head."""
    bias: bool = False
    """Biases in every linear layer and norm (GPT-2 style)."""
    qkv_bias: bool = False
    """Biases on the Q/K/V projections only (Qwen2 style)."""
    sliding_window: int | None = None
    """None, or how many most recent positions a query may see (Mistral)."""
    dropout: float = 0.0
    """Dropout on the embedding and on each sublayer's output, while training."""
    attention: str = "sdpa"
    """Attention kernel: 'sdpa' (PyTorch fused), 'naive' (full T×T grid) or 'tiled' (online softmax)."""
    attention_tile: int = 64
    """Tile size (queries and keys) for the 'tiled' kernel."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (residual projections get std/sqrt(2L))."""
    qk_norm: bool | str = False
    """RMS-normalise queries and keys after the projection, before RoPE. True: each head's, with no weight
    (nanochat, modded-nanogpt; nanochat's place after RoPE gives the same numbers up to rounding, the rotation
    keeping the norm); 'head': each head's with a weight of H (Qwen3, Gemma 3); 'proj': the whole projection's
    with a weight of N·H (K·H for keys), before it is split into heads (OLMo 2, OLMoE); docs/model.md#speedrun-switches."""
    logit_softcap: float | None = None
    """None, or C: the head's logits become C·tanh(logits/C) (Gemma 2, modded-nanogpt), in training and generation alike."""
    value_embeddings: bool = False
    """Value embeddings (modded-nanogpt, nanochat): a (V, K·H) table per layer, on every other layer ending with
    the last, whose row for the token is added to that layer's V."""
    quantization: dict | None = None
    """None (float weights), or how the weights are stored, e.g. {'method': 'int8_weight_only',
    'granularity': 'per_channel'} (convert/quantize.py, docs/quantize.md)."""
    # ---- the families' switches (docs/model.md#families; each off by default)
    norm_offset: bool = False
    """RMSNorm scales by (1 + w), w stored and initialised at 0 (Gemma)."""
    embed_scale: bool = False
    """Embeddings multiplied by √D before the first block (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """None, or s: scores scaled by s^-1/2 instead of H^-1/2 (Gemma)."""
    attn_softcap: float | None = None
    """None, or C: the scaled scores become C·tanh(s/C) before the mask (Gemma 2)."""
    swiglu_limit: float = 7.0
    """ffn='swiglu_clamp' (gpt-oss): the gate clamped to at most L, the up projection to [-L, L]."""
    layer_types: list | None = None
    """None (sliding_window, if set, on every layer), or per layer 'full_attention' or 'sliding_attention':
    the window applies to the sliding layers only (Gemma 2/3, gpt-oss)."""
    rope_local_theta: float | None = None
    """None, or the RoPE base of the sliding layers, which then take no rope_scaling (Gemma 3)."""
    nope_layers: list | None = None
    """None, or the layers whose attention uses no RoPE at all (SmolLM3's NoPE layers)."""
    attn_bias: bool = False
    """Biases on the Q, K, V and output projections (gpt-oss; Llama's attention_bias)."""
    attn_sinks: bool = False
    """A learned logit per query head that joins each softmax's denominator and takes weight from the keys
    (gpt-oss; "attention sinks", Xiao et al., 2023)."""
    n_experts: int = 0
    """E: 0 for a dense feed-forward; otherwise a mixture of E experts on the moe_layers (moe.py)."""
    n_active_experts: int = 0
    """k: how many experts each token is routed to (top-k of the router)."""
    n_shared_experts: int = 0
    """Experts every token passes through, unweighted, beside the routed ones (one FeedForward of that many widths)."""
    expert_dim: int | None = None
    """F of one expert (None = ffn_dim); dense layers of a mixture model keep ffn_dim."""
    router: str = "softmax"
    """The router's scores: 'softmax' over the experts, or 'sigmoid' of each logit."""
    router_renorm: bool = True
    """Rescale the k chosen scores to sum to 1 (Mixtral, gpt-oss; Qwen3-MoE's norm_topk_prob; not OLMoE)."""
    moe_layers: list | None = None
    """None (every layer), or the layers whose feed-forward is a mixture when n_experts > 0."""
    ffn_bias: bool = False
    """Biases on the feed-forward's (and each expert's) matrices and on the router (gpt-oss)."""
    router_aux_loss_coef: float = 0.0
    """Training adds this times the load-balancing loss E·Σ f_e·P_e (Switch Transformer; Mixtral)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "attention_tile"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._check_types()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}): "
                f"choose n_kv_heads among {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}"
            )
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim ({self.dim}) is not divisible by n_heads ({self.n_heads}): "
                    "change one of them, or set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be a positive integer, got {self.head_dim}")
        for name, allowed in (
            ("norm", NORMS),
            ("norm_placement", PLACEMENTS),
            ("ffn", FFNS),
            ("pos", POSITIONS),
            ("attention", ATTENTIONS),
            ("rope_pairs", ROPE_PAIRS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(
                f"RoPE turns features in pairs, so head_dim must be even (got {self.head_dim}): "
                "change dim/n_heads or head_dim, or use pos='learned' or 'none'"
            )
        if self.ffn_dim is None or self.ffn == "none":  # 'none' has no width: any value given describes nothing
            self.ffn_dim = _default_ffn_width(self.ffn, self.dim)
        if self.ffn_dim < 1 and self.ffn != "none":
            raise ValueError(f"ffn_dim must be a positive integer, got {self.ffn_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        self._check_speedrun_switches()
        self._check_families()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or a positive integer, got {self.sliding_window}")
        if self.rope_scaling is not None:
            self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if kind not in ROPE_SCALINGS:
            raise ValueError(
                f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALINGS)} "
                "(or None for plain RoPE)"
            )
        if "factor" not in self.rope_scaling:
            raise ValueError("rope_scaling needs a 'factor'")
        if kind == "yarn" and "original_max_position_embeddings" not in self.rope_scaling:
            raise ValueError("rope_scaling of type 'yarn' needs 'original_max_position_embeddings'")

    def _check_types(self) -> None:
        """Each remaining field of the kind it holds (FIELD_KINDS), so a hand-edited config.json
        ("n_kv_heads": "2", "bias": "yes") is refused by name instead of failing in a comparison
        below or passing as truthy."""
        for name, (kind, optional) in FIELD_KINDS.items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if kind is bool:
                ok = isinstance(value, bool)
            else:  # True is an int to Python, never a size or a rate here
                ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
            if not ok:
                raise ValueError(f"{name} must be {KIND_WORDS[kind]}{' or null' if optional else ''}, got {value!r}")

    def _check_speedrun_switches(self) -> None:
        """value_embeddings is a boolean; logit_softcap is None or a positive number (made a float)."""
        if self.logit_softcap is not None:
            if isinstance(self.logit_softcap, bool) or not isinstance(self.logit_softcap, (int, float)) or not self.logit_softcap > 0:
                raise ValueError(f"logit_softcap must be None (off) or a positive number such as 15.0, got {self.logit_softcap!r}")
            self.logit_softcap = float(self.logit_softcap)
        if not isinstance(self.value_embeddings, bool):
            raise ValueError(f"value_embeddings must be true or false, got {self.value_embeddings!r}")

    def _check_families(self) -> None:
        """The families' switches: known values, lists as long as the model, counts in range."""
        if self.qk_norm not in QK_NORMS or (isinstance(self.qk_norm, int) and not isinstance(self.qk_norm, bool)):
            raise ValueError(f"qk_norm must be false, true, 'head' or 'proj', got {self.qk_norm!r}")
        for name in ("query_pre_attn_scalar", "attn_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or a positive number, got {value!r}")
        if not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit!r}")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if len(self.layer_types) != self.n_layers or bad:
                raise ValueError(f"layer_types must list {self.n_layers} entries, each one of {', '.join(LAYER_TYPES)}; "
                                 f"got {len(self.layer_types)}{' with ' + repr(bad[0]) if bad else ''}")
        for name in ("nope_layers", "moe_layers"):
            value = getattr(self, name)
            if value is not None:
                if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in value):
                    raise ValueError(f"{name} must list layer indices in 0..{self.n_layers - 1}, got {value!r}")
                setattr(self, name, sorted(set(value)))
        for name in ("n_experts", "n_active_experts", "n_shared_experts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.n_experts > MOST_EXPERTS:
            raise ValueError(f"n_experts={self.n_experts} is more than {MOST_EXPERTS}: the config is damaged")
        if self.n_experts and not 1 <= self.n_active_experts <= self.n_experts:
            raise ValueError(f"n_active_experts must be in 1..n_experts ({self.n_experts}), got {self.n_active_experts}")
        if not self.n_experts and (self.n_active_experts or self.n_shared_experts or self.moe_layers):
            raise ValueError("n_active_experts, n_shared_experts and moe_layers need n_experts > 0")
        if self.n_experts and self.ffn == "none":
            raise ValueError("a mixture of experts needs a feed-forward kind (ffn is 'none')")
        if self.expert_dim is not None and self.expert_dim < 1:
            raise ValueError(f"expert_dim must be a positive integer, got {self.expert_dim}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be 0 or more, got {self.router_aux_loss_coef}")
        if self.norm_offset and self.norm != "rms":
            raise ValueError("norm_offset (Gemma's (1 + w)) applies to norm='rms' only")

    # ---- per layer -----------------------------------------------------------------
    def window_at(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it reads every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def rope_kind(self, layer: int) -> str | None:
        """Which RoPE table layer `layer` turns its queries and keys by: 'global', 'local'
        (rope_local_theta, on sliding layers) or None (no RoPE there)."""
        if self.pos != "rope" or (self.nope_layers is not None and layer in self.nope_layers):
            return None
        if self.rope_local_theta is not None and self.window_at(layer) is not None:
            return "local"
        return "global"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    # ---- derived sizes -------------------------------------------------------------
    @property
    def gated(self) -> bool:
        """Whether the feed-forward multiplies a gate by an up projection (SwiGLU, GeGLU)."""
        return self.ffn in GATED_FFNS

    @property
    def expert_width(self) -> int:
        """F of one expert: expert_dim, or ffn_dim when none is given."""
        return self.ffn_dim if self.expert_dim is None else self.expert_dim

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (1 for MHA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def has_ffn(self) -> bool:
        """Whether each block has a feed-forward sublayer (False for ffn='none', attention-only)."""
        return self.ffn != "none"

    @property
    def value_embed_layers(self) -> list[int]:
        """The layers with a value embedding: every other one, ending with the last (nanochat's has_ve)."""
        if not self.value_embeddings:
            return []
        return [i for i in range(self.n_layers) if i % 2 == (self.n_layers - 1) % 2]

    @property
    def q_dim(self) -> int:
        """N·H: width of all query heads together."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """K·H: width of all key (or value) heads together."""
        return self.n_kv_heads * self.head_dim

    # ---- (de)serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


_LLAMA = dict(norm="rms", ffn="swiglu", pos="rope", norm_eps=1e-5)

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: a few thousand weights, every feature on the default path.
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=128),
    # The CPU demo model, tuned for held-out bits per byte on Shakespeare after about two CPU
    # minutes (docs/benchmarks.md): at that compute a narrow model seeing many small batches
    # beats a wider one; its vocab_size is replaced by the prepared tokenizer's.
    "small": dict(
        vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=64,
        tie_embeddings=True,
    ),
    # GPT-2 small (Radford et al., 2019; Hugging Face gpt2/config.json): LayerNorm, tanh GELU,
    # learned positions, biases everywhere, tied embeddings.
    "gpt2-124m": dict(
        vocab_size=50257, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_seq_len=1024,
        norm="layer", ffn="gelu_tanh", pos="learned", bias=True, tie_embeddings=True,
    ),
    # SmolLM-135M (HuggingFaceTB/SmolLM-135M config.json).
    "smollm-135m": dict(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, max_seq_len=2048,
        rope_theta=10000.0, tie_embeddings=True, **_LLAMA,
    ),
    # Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): llama3 rope scaling, tied embeddings.
    "llama3.2-1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, ffn_dim=8192,
        max_seq_len=131072, rope_theta=500000.0, tie_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        **_LLAMA,
    ),
    # TinyLlama 1.1B (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json).
    "tinyllama-1.1b": dict(
        vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=2048,
        rope_theta=10000.0, **_LLAMA,
    ),
    # Llama 3 8B (Meta, 2024; meta-llama/Meta-Llama-3-8B config.json): 8,030,261,248 weights.
    "llama3-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=8192,
        rope_theta=500000.0, **_LLAMA,
    ),
    # Mistral 7B v0.1 (Jiang et al., 2023; mistralai/Mistral-7B-v0.1 config.json): sliding window 4096.
    "mistral-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
        rope_theta=10000.0, sliding_window=4096, **_LLAMA,
    ),
    # ---- the families of issue 45, each from its Hugging Face config.json (docs/convert.md#families)
    # Qwen3-0.6B (Qwen/Qwen3-0.6B): per-head q/k norms with weights, head_dim 128 > dim/heads; 596,049,920 weights.
    "qwen3-0.6b": dict(
        vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
        max_seq_len=40960, rope_theta=1000000.0, tie_embeddings=True, qk_norm="head", **{**_LLAMA, "norm_eps": 1e-6},
    ),
    # Gemma 3 270M (google/gemma-3-270m): (1 + w) sandwich norms, GeGLU, √D embeddings, q/k norms, five sliding
    # layers (window 512, local RoPE base 10,000) of every six; 268,098,176 weights.
    "gemma3-270m": dict(
        vocab_size=262144, dim=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=2048,
        max_seq_len=32768, rope_theta=1000000.0, rope_local_theta=10000.0, tie_embeddings=True, norm="rms",
        norm_eps=1e-6, norm_offset=True, norm_placement="sandwich", ffn="geglu", pos="rope", embed_scale=True,
        qk_norm="head", query_pre_attn_scalar=256.0, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    ),
    # SmolLM3-3B (HuggingFaceTB/SmolLM3-3B): no RoPE on every 4th layer; 3,075,098,624 weights.
    "smollm3-3b": dict(
        vocab_size=128256, dim=2048, n_layers=36, n_heads=16, n_kv_heads=4, ffn_dim=11008, max_seq_len=65536,
        rope_theta=5000000.0, tie_embeddings=True, nope_layers=list(range(3, 36, 4)), **{**_LLAMA, "norm_eps": 1e-6},
    ),
    # OLMo 2 1B (allenai/OLMo-2-0425-1B): norms after each sublayer, q/k norms over the projection; 1,484,916,736.
    "olmo2-1b": dict(
        vocab_size=100352, dim=2048, n_layers=16, n_heads=16, ffn_dim=8192, max_seq_len=4096, rope_theta=500000.0,
        norm_placement="post_branch", qk_norm="proj", **{**_LLAMA, "norm_eps": 1e-6},
    ),
    # Phi-3-mini-4k (microsoft/Phi-3-mini-4k-instruct): Llama's block (fused in its files), window 2047; 3,821,079,552.
    "phi3-mini": dict(
        vocab_size=32064, dim=3072, n_layers=32, n_heads=32, ffn_dim=8192, max_seq_len=4096, rope_theta=10000.0,
        sliding_window=2047, **_LLAMA,
    ),
    # Gemma 2 2B (google/gemma-2-2b): Gemma's parts with soft caps 50 (attention) and 30 (logits), every other
    # layer sliding (window 4096); 2,614,341,888 weights.
    "gemma2-2b": dict(
        vocab_size=256000, dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=9216,
        max_seq_len=8192, rope_theta=10000.0, tie_embeddings=True, norm="rms", norm_eps=1e-6, norm_offset=True,
        norm_placement="sandwich", ffn="geglu", pos="rope", embed_scale=True, query_pre_attn_scalar=256.0,
        attn_softcap=50.0, logit_softcap=30.0, sliding_window=4096,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(26)],
    ),
    # ---- mixtures of experts (docs/convert.md#families): total weights, and those one token runs through
    # OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924): 64 experts of 1024, top 8, raw top-k weights, q/k norms over the
    # projections; 6,919,161,856 weights, 1,282,017,280 active.
    "olmoe-1b-7b": dict(
        vocab_size=50304, dim=2048, n_layers=16, n_heads=16, ffn_dim=1024, max_seq_len=4096, rope_theta=10000.0,
        qk_norm="proj", n_experts=64, n_active_experts=8, router_renorm=False, router_aux_loss_coef=0.01, **_LLAMA,
    ),
    # gpt-oss-20b (openai/gpt-oss-20b, its experts dequantized from MXFP4): 32 experts of 2880, top 4, biases,
    # attention sinks, the clamped SwiGLU, every other layer sliding (window 128), YaRN ×32; 20,914,757,184
    # weights, 4,187,440,704 active (3,608,307,264 without the token table, as OpenAI's 3.6B counts them).
    "gpt-oss-20b": dict(
        vocab_size=201088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880,
        max_seq_len=131072, rope_theta=150000.0, ffn="swiglu_clamp", swiglu_limit=7.0, attn_bias=True,
        attn_sinks=True, ffn_bias=True, n_experts=32, n_active_experts=4, router_aux_loss_coef=0.9,
        sliding_window=128, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
        norm="rms", pos="rope", norm_eps=1e-5,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B): 128 experts of 768, top 8, renormalised, per-head q/k norms;
    # 30,532,122,624 weights, 3,353,032,704 active.
    "qwen3-30b-a3b": dict(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
        expert_dim=768, max_seq_len=40960, rope_theta=1000000.0, qk_norm="head", n_experts=128, n_active_experts=8,
        router_aux_loss_coef=0.001, **{**_LLAMA, "norm_eps": 1e-6},
    ),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): 8 experts of 14336, top 2; 46,702,792,704 weights,
    # 12,879,925,248 active.
    "mixtral-8x7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=32768,
        rope_theta=1000000.0, n_experts=8, n_active_experts=2, router_aux_loss_coef=0.02, **_LLAMA,
    ),
}

# The chat demo's model (`make chat-demo`, docs/chat.md#the-chat-demo): the small demo model with a
# context that holds several turns of a conversation from text/dialogue.py.
PRESETS["chat"] = {**PRESETS["small"], "max_seq_len": 256}

# The induction-heads demo's model (`glassformer demo --induction`, docs/training.md#the-induction-heads-demo):
# two attention-only layers (Olsson et al., 2022), a byte vocabulary, one repeat block of context. Its
# init_std is 5x the default: from 0.02 the attention logits start near 0 and, measured, no induction
# head had formed after 1500 steps; from 0.1 one forms within a few hundred (docs/training.md).
PRESETS["induction"] = dict(vocab_size=257, dim=64, n_layers=2, n_heads=4, ffn="none", max_seq_len=64, init_std=0.1)

# The reference shape that the benchmarks compare against Hugging Face on (15.7M weights).
REFERENCE_SHAPE = dict(
    vocab_size=8192, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=1024, max_seq_len=2048,
)


# ----------------------------------------------------------------------------- training


# prepare's BPE vocabulary when none is given: 1024 (2048 until the eighth tuning round, where on
# tinyshakespeare 1024 tokens and epoch sampling trained to lower held-out bits per byte in the same
# CPU time: docs/benchmarks-log.md#quality-per-cpu-minute-on-tinyshakespeare).
DEFAULT_VOCAB_SIZE = 1024
SAMPLINGS = ("epochs", "random")  # how training draws its windows: TrainConfig.sampling, text.data.get_batch
# Training settings whose default changed after runs were saved without them: what those runs used.
CHECKPOINT_FORMATS = ("safetensors", "dcp")  # train --checkpoint-format: one file gathered, or DCP shards
SAVED_BEFORE = {"sampling": "random"}


@dataclass
class TrainConfig:
    """Everything `glassformer train` needs besides the model; each field's doc is its --help text.

    Resolution order: these defaults < a --config FILE (JSON or TOML) < flags given on the
    command line. With --resume the run's saved TrainConfig replaces the defaults.
    """

    data: str = "data"
    """Prepared data folder (from `glassformer prepare`): tokenizer.json, train.bin, val.bin, meta.json."""
    out: str = "runs/run"
    """Run folder: checkpoints step-NNNNNN/, latest, best, metrics.jsonl, loss.png."""
    preset: str = "small"
    """Model preset (its vocab_size is replaced by the prepared tokenizer's)."""
    model: str = ""
    """Model overrides of the preset as comma-separated key=value pairs, e.g. 'dim=256,n_layers=6'."""
    init_from: str | None = None
    """Start from the weights of this checkpoint (checkpoint, run or Hugging Face folder, or a Hub name org/name[@revision]) instead of random ones."""
    resume: bool = False
    """Continue the run in --out exactly from its newest complete checkpoint (starts fresh if there is none)."""
    device: str = "auto"
    """'cpu', 'cuda', 'mps' or 'auto' (cuda if present, else cpu)."""
    seed: int = 1337
    """Seeds the weights, the batches (drawn from (seed, step)) and dropout."""
    sampling: str = "epochs"
    """How the training windows are drawn: 'epochs' (each token once an epoch: the windows tile the text from an offset drawn each epoch, in a shuffled order) or 'random' (each window anywhere, drawn anew: some text twice, other text not at all; the only way before; docs/data.md#batches-glassformertextdata)."""
    align_docs: bool = False
    """Begin every training window at a document's start (position 0 or right after an end-of-text token), each document start once an epoch under --sampling epochs (docs/data.md#batches-from-shards)."""
    batch_size: int = 8
    """Sequences per optimizer step, over all processes together (the global batch)."""
    micro_batch: int = 0
    """Sequences per forward pass in each process (0 = the whole global batch share); the rest is gradient accumulation."""
    seq_len: int = 0
    """Tokens per training sequence (0 = the model's max_seq_len)."""
    max_steps: int = 1000
    """Optimizer steps to run (ignored when --time-budget is given)."""
    time_budget: float = 0.0
    """Seconds of wall time for the whole run (0 = off): the speed of the first steps fixes the step count and schedule."""
    calibrate_steps: int = 20
    """Steps timed to fix the step count under --time-budget (must not exceed warmup_steps)."""
    follow_clock: bool = True
    """With --time-budget and --schedule wsd: plan the step count again from the speed of the latest steps every 50 steps until the decay begins (the rate is flat until then, so no step taken changes), so the run ends on time on a machine whose speed drifts; --no-follow-clock keeps the calibration's count (docs/training.md#time-budget)."""
    lr: float = 2e-3
    """Peak learning rate, reached after the warm-up."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay (the last step)."""
    schedule: str = "wsd"
    """After the warm-up: 'cosine' (half a cosine from --lr to --min-lr) or 'wsd' (hold --lr, then a straight line to --min-lr over the last --decay-frac of the steps; docs/training.md#the-learning-rate-schedule)."""
    decay_frac: float = 0.4
    """With --schedule wsd: the share of all steps spent decaying at the end."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to tensors of 2+ dims only (matrices and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': torch.optim.Muon for the block matrices (wq wk wv wo w_gate w_up w_down), AdamW for the embedding, head, norms and biases (docs/training.md#muon)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the schedule scales it as it scales --lr)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off); the norm before clipping is logged."""
    dropout: float = 0.0
    """Dropout probability while training (overrides the model config's)."""
    eval_every: int = 500
    """Evaluate on held-out data (loss, bits per byte) and save a checkpoint every N steps (0 = only at the end)."""
    eval_tokens: int = 16384
    """Held-out tokens scored at each evaluation (0 = the whole validation split)."""
    log_every: int = 10
    """Write a metrics.jsonl line every N steps."""
    keep_last: int = 2
    """Checkpoints kept besides the best one."""
    snapshot_every: int = 0
    """Also keep a checkpoint every N steps for the explorer's checkpoint slider (`glassformer view --run`), exempt from --keep-last pruning (0 = off; docs/training.md#snapshots)."""
    compile: bool = False
    """torch.compile the model."""
    dtype: str = "auto"
    """Autocast dtype: 'auto' (bf16 on CUDA, fp32 elsewhere), 'bf16' or 'fp32'."""
    fsdp: bool = False
    """Under torchrun, shard weights, gradients and optimizer state with FSDP2 (fully_shard) instead of DDP."""
    checkpoint_format: str = "safetensors"
    """How checkpoints hold the weights and optimizer state: 'safetensors' (full tensors gathered on rank 0 into model.safetensors and train_state.safetensors) or 'dcp' (each process writes its own shards with torch.distributed.checkpoint into step-N/dcp/, nothing gathered; resumes at any world size; docs/training.md#past-one-machine)."""
    activation_checkpointing: bool = False
    """Keep only each block's input from the forward and recompute the block's activations in backward (torch.utils.checkpoint): about a third more compute for a fraction of the activation memory (`glassformer cost --activation-checkpointing`; docs/training.md#activation-checkpointing)."""
    skip_nonfinite: bool = False
    """Skip an optimizer step whose loss or gradient norm is not finite instead of stopping."""
    progress: bool = True
    """Show a progress bar."""
    stats_every: int = -1
    """Per-layer statistics (gradient norms, update/weight RMS, stream RMS, attention entropy) on a fixed held-out batch every N steps, into metrics.jsonl (-1 = the --eval-every interval; 0 = off; docs/training.md#per-layer-statistics)."""
    log: list[str] = dataclasses.field(default_factory=list)
    """Also log the metrics to tensorboard[:DIR] (default DIR: the run folder's tb/) or wandb[:PROJECT]; repeatable."""
    threads: int = 0
    """CPU threads for PyTorch (0 = PyTorch's default); 1 is fastest for tiny models on a busy machine."""
    keep_freed_memory: bool = True
    """On the CPU (Linux, glibc): keep the memory a step frees for the next one instead of faulting fresh pages in each step (what that costs a step: bench/cpu_memory.py, docs/benchmarks.md)."""
    lora_r: int = 0
    """LoRA rank: freeze the --init-from model and train only rank-R adapters on its products; checkpoints hold the adapter alone (0 = off: train every weight; docs/lora.md)."""
    lora_alpha: float = 16.0
    """LoRA alpha: the adapters' products are scaled by alpha / r."""
    lora_dropout: float = 0.0
    """LoRA dropout on the adapters' input while training."""
    lora_targets: str = "wq,wk,wv,wo,w_gate,w_up,w_down"
    """The block products that get a LoRA adapter, comma-separated."""
    base: str | None = None
    """The base checkpoint of an adapter run given to --init-from or resumed, when it has moved from where the adapter records it."""

    def __post_init__(self) -> None:
        for name in ("batch_size",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("micro_batch", "seq_len", "max_steps", "warmup_steps", "eval_every", "eval_tokens",
                     "keep_last", "snapshot_every", "log_every", "calibrate_steps", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.time_budget < 0:
            raise ValueError(f"time_budget must be 0 (off) or a number of seconds, got {self.time_budget}")
        if self.device not in ("auto", "cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda, mps or auto; got {self.device!r}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bf16 or fp32; got {self.dtype!r}")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0; got lr={self.lr}, min_lr={self.min_lr}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be {' or '.join(SAMPLINGS)}, got {self.sampling!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"schedule must be cosine or wsd, got {self.schedule!r}")
        if not 0.0 < self.decay_frac <= 1.0:
            raise ValueError(f"decay_frac must be in (0, 1] (a share of the steps), got {self.decay_frac}")
        if self.stats_every < -1:
            raise ValueError(f"stats_every must be -1 (the eval interval), 0 (off) or a number of steps, got {self.stats_every}")
        if not self.muon_lr > 0 or not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"need muon_lr > 0 and 0 <= muon_momentum < 1; got {self.muon_lr}, {self.muon_momentum}")
        if isinstance(self.log, str):
            self.log = [self.log]
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be {' or '.join(CHECKPOINT_FORMATS)}, got {self.checkpoint_format!r}")
        if self.lora_r < 0:
            raise ValueError(f"lora_r must be at least 1 (or 0: no LoRA), got {self.lora_r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_saved(cls, d: dict[str, Any]) -> "TrainConfig":
        """The settings a run saved (train_state.json's config): a setting it predates takes the value
        the run had then (SAVED_BEFORE), not today's default, so resuming or explaining it keeps its batches."""
        return cls.from_dict({**SAVED_BEFORE, **d})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown training settings {unknown}; known: {sorted(known)}")
        return cls(**d)

    def model_overrides(self) -> dict[str, Any]:
        """The --model string as a dict of ModelConfig fields, values parsed as JSON where they can be."""
        out: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in self.model.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--model expects key=value pairs separated by commas; got {item!r}")
            try:
                out[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                out[key.strip()] = value.strip()
        return out


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field (the --help text), read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs
