"""Weights by part: what `Transformer(cfg)` allocates, counted from the config alone.

For MHA without tying or biases this is design.md's P = L(4D² + 3·D·F + 2D) + D + 2VD;
here every switch is counted (GQA, head_dim, FFN kind, biases, norm kind and placement, QK
norms with weights, attention sinks, learned positions, tying, mixtures of experts): the table
is docs/cost.md#weights. A mixture of experts has two counts: every weight it holds (`total`)
and the weights one token runs through (`active`: the router, k of the E experts, the shared ones).
"""

from __future__ import annotations

from ..config import ModelConfig


def ffn_matrices(cfg: ModelConfig) -> int:
    """3 for a gated feed-forward (up, gate, down: SwiGLU, GeGLU), 2 for ReLU/ReLU²/GELU (up, down),
    0 for ffn='none'."""
    if not cfg.has_ffn:
        return 0
    return 3 if cfg.gated else 2


def ffn_bias(cfg: ModelConfig) -> bool:
    """Whether the feed-forward's matrices (every expert's too) carry biases: bias, or ffn_bias."""
    return cfg.bias or cfg.ffn_bias


def feed_forward_weights(cfg: ModelConfig, width: int) -> tuple[int, int]:
    """(matrix weights, bias weights) of one feed-forward of hidden width `width`: m·D·F, and
    (m − 1)·F + D with biases (up and gate are F wide, down's is D)."""
    m = ffn_matrices(cfg)
    return m * cfg.dim * width, ((m - 1) * width + cfg.dim) if ffn_bias(cfg) and m else 0


def sublayers(cfg: ModelConfig) -> int:
    """Sublayers in one block, each with its norm, its addition and its dropout: 2, or 1 (attention
    alone) for ffn='none'."""
    return 2 if cfg.has_ffn else 1


def norms_per_block(cfg: ModelConfig) -> int:
    """D-wide norms in one block: one per sublayer, two with sandwich norms (before and after)."""
    return sublayers(cfg) * (2 if cfg.norm_placement == "sandwich" else 1)


def norm_weights(cfg: ModelConfig) -> int:
    """Weights in one norm over D: a gain γ, plus a bias β when cfg.bias (RMSNorm or LayerNorm alike).
    With norm_offset the gain is stored as w and used as 1 + w: the same count."""
    return cfg.dim * (2 if cfg.bias else 1)


def qk_norm_weights(cfg: ModelConfig) -> int:
    """Weights of one layer's QK norms: none for the weightless one (True), H each for 'head'
    (one gain shared by every head), N·H and K·H for 'proj' (over the whole projection); doubled with bias."""
    per = 2 if cfg.bias else 1  # each a gain γ, and a bias β with bias (made by the same make_norm)
    if cfg.qk_norm == "head":
        return 2 * cfg.head_dim * per
    if cfg.qk_norm == "proj":
        return (cfg.q_dim + cfg.kv_dim) * per
    return 0


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The layers whose feed-forward is a mixture of experts (none for a dense model)."""
    return [i for i in range(cfg.n_layers) if cfg.is_moe(i)]


def shared_width(cfg: ModelConfig) -> int:
    """F of the shared experts: one feed-forward n_shared·F_e wide (0 without shared experts)."""
    return cfg.n_shared_experts * cfg.expert_width


def layer_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, int]:
    """Weights of block `layer`, by part (blocks differ only in a mixture model's dense layers)."""
    D, NH, KH = cfg.dim, cfg.q_dim, cfg.kv_dim
    qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attn_bias
    out = {
        "attn_q": D * NH,
        "attn_k": D * KH,
        "attn_v": D * KH,
        "attn_o": NH * D,
        "attn_bias": (NH + 2 * KH if qkv_bias else 0) + (D if cfg.bias or cfg.attn_bias else 0),
        "attn_sinks": cfg.n_heads if cfg.attn_sinks else 0,  # one learned logit per query head
        "qk_norms": qk_norm_weights(cfg),
        "ffn": 0, "ffn_bias": 0, "router": 0, "experts": 0, "experts_bias": 0, "shared_experts": 0,
        "norms": norms_per_block(cfg) * norm_weights(cfg),
    }
    if cfg.is_moe(layer):
        E = cfg.n_experts
        mat, bias = feed_forward_weights(cfg, cfg.expert_width)
        out["router"] = E * D + (E if cfg.ffn_bias else 0)
        out["experts"], out["experts_bias"] = E * mat, E * bias
        out["shared_experts"] = sum(feed_forward_weights(cfg, shared_width(cfg))) if cfg.n_shared_experts else 0
    else:
        out["ffn"], out["ffn_bias"] = feed_forward_weights(cfg, cfg.ffn_dim)
    return out


def idle_expert_weights(cfg: ModelConfig) -> int:
    """Weights a token does not run through: the E − k routed experts it is not sent to, in every
    mixture layer (0 for a dense model)."""
    if not cfg.n_experts:
        return 0
    one = sum(feed_forward_weights(cfg, cfg.expert_width))
    return len(moe_layers(cfg)) * (cfg.n_experts - cfg.n_active_experts) * one


def weights(cfg: ModelConfig) -> dict[str, int]:
    """Every weight of the model by part, summed over layers, with 'total' and 'non_embedding'
    (a mixture's weights one token runs through: active_weights).

    >>> weights(ModelConfig.from_preset("llama3-8b"))["total"]
    8030261248
    """
    V, D = cfg.vocab_size, cfg.dim
    per = [layer_weights(cfg, i) for i in range(cfg.n_layers)]
    parts = {
        "embedding": V * D,
        "positions": cfg.max_seq_len * D if cfg.pos == "learned" else 0,
        # value embeddings: a (V, K·H) table on each of cfg.value_embed_layers (the weightless qk_norm
        # and the softcaps have no weights). Looked up, not multiplied; counted outside "embedding", as
        # Transformer.num_params(non_embedding=True) counts them.
        "value_embeddings": len(cfg.value_embed_layers) * V * cfg.kv_dim,
        **{k: sum(p[k] for p in per) for k in layer_weights(cfg, 0)},
        # A tied head is the embedding matrix itself: no weights of its own.
        "lm_head": 0 if cfg.tie_embeddings else V * D,
    }
    parts["norms"] = parts.get("norms", 0) + norm_weights(cfg)  # the final norm
    total = sum(parts.values())
    # nanoGPT's convention: token and position tables are lookups, not matrix products.
    parts["total"] = total
    parts["non_embedding"] = total - parts["embedding"] - parts["positions"]
    return parts


def num_weights(cfg: ModelConfig) -> int:
    """The total: equals `Transformer(cfg).num_params()` (tied matrices once)."""
    return weights(cfg)["total"]


def active_weights(cfg: ModelConfig) -> int:
    """Weights one token runs through: the total less the routed experts it is not sent to (the
    total for a dense model)."""
    return num_weights(cfg) - idle_expert_weights(cfg)
