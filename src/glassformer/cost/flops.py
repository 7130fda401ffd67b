"""Forward FLOPs by part: matrix products only, 2 FLOPs per multiply-add.

design.md's C = L(8BTD² + 4BT²D + 6BTDF) + 2BTDV, generalised to GQA, head_dim ≠ D/N,
two-matrix FFNs, each kernel's share of the T×T score grid (naive: the full grid; tiled:
the tiles not fully masked; causal: the pairs the mask lets through; a window on the sliding
layers only), and mixtures of experts (the router's product and k experts per token, the shared
ones on every token). Elementwise work (norms, soft-caps, sinks, the mixture's weighted sum) is
left out, as FlopCounterMode leaves it out. See docs/cost.md#forward-flops.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from .params import ffn_matrices, moe_layers, shared_width

KERNELS = ("naive", "tiled", "sdpa")


def causal_pairs(T: int, window: int | None = None) -> int:
    """(query, key) pairs the causal (and sliding-window) mask lets through for T tokens from position 0.

    >>> causal_pairs(4), causal_pairs(4, window=2)
    (10, 7)
    """
    if window is None or window >= T:
        return T * (T + 1) // 2
    # The first W queries see 1..W keys; each later one sees exactly W.
    return window * (window + 1) // 2 + (T - window) * window


def tiled_pairs(T: int, tile: int, window: int | None = None) -> dict[str, int]:
    """Pairs (and tiles) that the tiled kernel computes for T tokens from position 0, by the rule
    of attention/tiled.py's `_tile_is_hidden` (docs/cost.md#forward-flops).

    >>> p = tiled_pairs(4, tile=2)  # the walkthrough: 3 of 4 tiles computed, 12 of 16 pairs
    >>> p["pairs"], p["tiles"], p["tiles_skipped"]
    (12, 3, 1)
    """
    n_tiles = math.ceil(T / tile)
    pairs = tiles = rows = cols = 0
    for qi in range(n_tiles):
        q_lo, q_hi = qi * tile, min((qi + 1) * tile, T) - 1
        j_hi = q_hi // tile  # last key tile that starts at or before the last query
        j_lo = 0
        if window is not None:  # first key tile whose last key is still inside q_lo's window
            j_lo = max(0, math.ceil((q_lo - window + 2) / tile) - 1)
        tq, width = q_hi - q_lo + 1, min((j_hi + 1) * tile, T) - j_lo * tile
        tiles += j_hi - j_lo + 1
        pairs += tq * width
        rows += tq * (j_hi - j_lo + 1)  # query rows summed over computed tiles
        cols += width  # key columns summed over computed tiles
    return {"pairs": pairs, "tiles": tiles, "tiles_skipped": n_tiles * n_tiles - tiles,
            "pairs_skipped": T * T - pairs, "rows": rows, "cols": cols}


def score_pairs(cfg: ModelConfig, T: int, kernel: str, layer: int = 0) -> int:
    """(query, key) pairs per head per row whose scores `kernel` computes in layer `layer`'s forward over
    T tokens (the window is the layer's own: cfg.window_at).

    sdpa is counted as the full grid: that is what FlopCounterMode's formula for the fused
    kernels counts on a GPU (on the CPU it counts nothing). Real flash kernels skip masked
    blocks as the tiled one does.
    """
    window = cfg.window_at(layer)
    if kernel == "tiled":
        return tiled_pairs(T, cfg.attention_tile, window)["pairs"]
    if kernel == "causal":
        return causal_pairs(T, window)
    if kernel in ("naive", "sdpa"):
        return T * T
    raise ValueError(f"unknown kernel {kernel!r}; choose one of: naive, tiled, sdpa, causal")


def all_score_pairs(cfg: ModelConfig, T: int, kernel: str) -> int:
    """score_pairs summed over the layers (sliding and full layers differ)."""
    return sum(score_pairs(cfg, T, kernel, i) for i in range(cfg.n_layers))


def ffn_flops_per_token(cfg: ModelConfig, all_experts: bool = False) -> dict[str, int]:
    """FLOPs of every layer's feed-forward for one token, by part: 'ffn' (dense layers), 'router'
    (E logits of D), 'experts' (k routed experts; all E with all_experts) and 'shared_experts'."""
    m, D = ffn_matrices(cfg), cfg.dim
    moe = moe_layers(cfg)
    dense = cfg.n_layers - len(moe)
    k = cfg.n_experts if all_experts else cfg.n_active_experts
    return {
        "ffn": dense * 2 * m * D * cfg.ffn_dim,
        "router": len(moe) * 2 * D * cfg.n_experts,
        "experts": len(moe) * k * 2 * m * D * cfg.expert_width,
        "shared_experts": len(moe) * 2 * m * D * shared_width(cfg),
    }


def forward_flops(cfg: ModelConfig, B: int, T: int, kernel: str = "naive", all_experts: bool = False) -> dict[str, int]:
    """FLOPs of the matrix products of one forward over (B, T), by part, with 'total'.

    kernel chooses how many score pairs are counted (see score_pairs); 'naive' is the
    full T×T grid, the figure FlopCounterMode gives on the naive kernel. A mixture of experts runs
    k experts per token; all_experts: as if every token ran through all E (the dense equivalent).
    """
    L, D, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    NH, KH, BT = cfg.q_dim, cfg.kv_dim, B * T
    pairs = all_score_pairs(cfg, T, kernel)
    ffn = ffn_flops_per_token(cfg, all_experts)
    parts = {
        "attn_qkv": L * 2 * BT * D * (NH + 2 * KH),
        "attn_o": L * 2 * BT * NH * D,
        "attn_scores": 2 * B * pairs * NH,  # QKᵀ: each pair is an H-long dot product, for N heads
        "attn_values": 2 * B * pairs * NH,  # weights · V: the same shape of product
        **{k: BT * v for k, v in ffn.items()},
        "lm_head": 2 * BT * D * V,
    }
    parts["total"] = sum(parts.values())
    return parts


def train_step_flops(forward_total: int) -> int:
    """A training step ≈ 3 forwards: each product Y = XW needs two more in backward,
    dX = dY·Wᵀ and dW = Xᵀ·dY, of the same size (Kaplan et al., 2020, section 2.1)."""
    return 3 * forward_total


def train_flops_per_token(cfg: ModelConfig, T: int) -> float:
    """FLOPs of a training step per token over rows of T tokens, the full score grid counted: 6 per
    weight of a matrix product (the LM head too, tied or not) plus 12·L·T·N·H for the scores.
    PaLM's formula (Chowdhery et al., 2022, appendix B), the figure MFU is quoted against."""
    return train_step_flops(forward_flops(cfg, 1, T, "naive")["total"]) / T


def decode_flops(cfg: ModelConfig, context: int) -> int:
    """FLOPs of the matrix products to decode one token that reads `context` cached positions (a
    sliding layer reads at most its window)."""
    f = forward_flops(cfg, 1, 1)
    read = sum(context if cfg.window_at(i) is None else min(context, cfg.window_at(i)) for i in range(cfg.n_layers))
    return f["total"] - f["attn_scores"] - f["attn_values"] + 4 * cfg.q_dim * read  # scores and values, per key


def crossover_seq(cfg: ModelConfig, kernel: str = "naive") -> int | None:
    """Smallest T at which the score FLOPs reach the feed-forward's (all layers; a mixture's
    feed-forward as a token runs it: router, k experts, shared ones).

    Full grid (naive): 4·N·H·T² ≥ 2·m·D·F·T, so T = m·D·F / (2·N·H): 1.5·F for MHA SwiGLU.
    Causal pairs only: about twice that. With a sliding window W, each query reads at most W
    keys, so if W is below that point the scores never overtake the FFN: None.
    """
    NH, L = cfg.q_dim, cfg.n_layers
    ffn_per_token = sum(ffn_flops_per_token(cfg).values())  # every layer's, one token
    if not ffn_per_token:  # ffn='none': no feed-forward to pass
        return None
    if kernel in ("naive", "sdpa"):
        return math.ceil(ffn_per_token / (4 * NH * L))
    hi = 4 * math.ceil(ffn_per_token / (2 * NH * L)) + 4 * cfg.attention_tile + 4

    def scores_win(T: int) -> bool:
        return 4 * NH * all_score_pairs(cfg, T, kernel) >= ffn_per_token * T

    if not scores_win(hi):
        return None
    lo = 1  # binary search: pairs/T grows with T (up to the window)
    while lo < hi:
        mid = (lo + hi) // 2
        if scores_win(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
