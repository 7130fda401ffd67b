"""Weights by part: what `Transformer(cfg)` allocates, counted from the config alone.

For MHA without tying or biases this is design.md's P = L(4D² + 3·D·F + 2D) + D + 2VD;
here every switch is counted (GQA, head_dim, FFN kind, biases, norm kind, learned positions,
tying): the table is docs/cost.md#weights.
"""

from __future__ import annotations

from ..config import ModelConfig


def ffn_matrices(cfg: ModelConfig) -> int:
    """3 for SwiGLU (up, gate, down), 2 for ReLU/ReLU²/GELU (up, down), 0 for ffn='none'."""
    if not cfg.has_ffn:
        return 0
    return 3 if cfg.ffn == "swiglu" else 2


def sublayers(cfg: ModelConfig) -> int:
    """Sublayers in one block, each with its norm, its addition and its dropout: 2, or 1 (attention
    alone) for ffn='none'."""
    return 2 if cfg.has_ffn else 1


def norm_weights(cfg: ModelConfig) -> int:
    """Weights in one norm over D: a gain γ, plus a bias β when cfg.bias (RMSNorm or LayerNorm alike)."""
    return cfg.dim * (2 if cfg.bias else 1)


def layer_weights(cfg: ModelConfig) -> dict[str, int]:
    """Weights of one block, by part (every block is the same)."""
    D, F, NH, KH = cfg.dim, cfg.ffn_dim, cfg.q_dim, cfg.kv_dim
    m = ffn_matrices(cfg)
    qkv_bias = cfg.bias or cfg.qkv_bias
    return {
        "attn_q": D * NH,
        "attn_k": D * KH,
        "attn_v": D * KH,
        "attn_o": NH * D,
        "attn_bias": (NH + 2 * KH if qkv_bias else 0) + (D if cfg.bias else 0),
        "ffn": m * D * F,
        # up (and gate) biases are F wide, down's is D wide
        "ffn_bias": ((m - 1) * F + D) if cfg.bias and m else 0,
        "norms": sublayers(cfg) * norm_weights(cfg),
    }


def weights(cfg: ModelConfig) -> dict[str, int]:
    """Every weight of the model by part, summed over layers, with 'total' and 'non_embedding'.

    >>> weights(ModelConfig.from_preset("llama3-8b"))["total"]
    8030261248
    """
    L, D, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    per = layer_weights(cfg)
    parts = {
        "embedding": V * D,
        "positions": cfg.max_seq_len * D if cfg.pos == "learned" else 0,
        # value embeddings: a (V, K·H) table on each of cfg.value_embed_layers (qk_norm and the
        # softcap have no weights). Looked up, not multiplied; counted outside "embedding", as
        # Transformer.num_params(non_embedding=True) counts them.
        "value_embeddings": len(cfg.value_embed_layers) * V * cfg.kv_dim,
        **{k: L * v for k, v in per.items()},
        "final_norm": norm_weights(cfg),
        # A tied head is the embedding matrix itself: no weights of its own.
        "lm_head": 0 if cfg.tie_embeddings else V * D,
    }
    parts["norms"] += parts.pop("final_norm")
    total = sum(parts.values())
    # nanoGPT's convention: token and position tables are lookups, not matrix products.
    parts["total"] = total
    parts["non_embedding"] = total - parts["embedding"] - parts["positions"]
    return parts


def num_weights(cfg: ModelConfig) -> int:
    """The total: equals `Transformer(cfg).num_params()` (tied matrices once)."""
    return weights(cfg)["total"]
