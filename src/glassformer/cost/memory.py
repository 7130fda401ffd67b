"""Memory: activations saved for backward, training memory, KV cache, the largest batch.

Activations are counted the way this code base's model saves them (measured with
torch.autograd.graph.saved_tensors_hooks, tensors deduplicated by storage), per layer, per
part and per kernel, with the parts kept in fp32 whatever the dtype: the table and the
reasons are in docs/cost.md#activations-a (design.md's A is the same count in round numbers).
"""

from __future__ import annotations

from ..config import ModelConfig
from .flops import tiled_pairs
from .params import norms_per_block, num_weights, shared_width, sublayers

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZERS = {"adamw": 2, "sgd": 1, "none": 0}  # state tensors per weight (AdamW: m and v)


def dtype_bytes(dtype: str) -> int:
    if dtype not in BYTES:
        raise ValueError(f"dtype must be one of {', '.join(BYTES)}; got {dtype!r}")
    return BYTES[dtype]


def _norm(cfg: ModelConfig, BT: int) -> tuple[int, int]:
    """(elements in the training dtype, elements in fp32) that one norm saves."""
    D = cfg.dim
    if cfg.norm == "rms":
        return BT * D, BT * D + BT  # normalised x; the fp32 input copy and 1/rms
    return BT * D, 2 * BT  # LayerNorm: the input; mean and 1/std


def _kernel(cfg: ModelConfig, B: int, T: int, kernel: str, window: int | None = None) -> tuple[int, int, int]:
    """(dtype elements, fp32 elements, bool bytes) one attention kernel saves in one layer whose sliding
    window is `window`. A soft cap keeps tanh's output of every computed score, a sink one more softmax
    column per query row (sdpa hands both to the naive kernel, as attention/sdpa.py does)."""
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = B * T * (N + 2 * K) * H
    capped, sinks = cfg.attn_softcap is not None, cfg.attn_sinks
    if kernel == "sdpa" and (capped or sinks):
        kernel = "naive"
    if kernel == "naive":
        return qkv + (3 if capped else 2) * B * N * T * T + (B * N * T if sinks else 0), 0, B * T * T
    if kernel == "sdpa":
        lse = B * N * T
        if window is None:  # plain causal: is_causal, no mask tensor
            return qkv, lse, 0
        return qkv + B * T * T + B * T * N * H + B * T, lse, 0
    if kernel == "tiled":
        p = tiled_pairs(T, cfg.attention_tile, window)
        per_tile = (
            (3 if capped else 2) * B * N * p["pairs"]  # scores (for the running max) and exp-weights of every computed tile
            + B * N * H * p["rows"] * 2  # a copy of the q slice, and the running o before each update
            # copies of the k and v slices; with one batch row or one KV head each slice is a view (its
            # batch and head dims merge without a copy), and k and v are kept whole instead
            + (2 * B * K * H * T if B == 1 or K == 1 else 2 * B * K * H * p["cols"])
            + 4 * B * N * p["rows"]  # running max, alpha, l and the new max per query row
        )
        per_q_tile = B * N * T * H + 2 * B * N * T + (B * N * T if sinks else 0)  # the final o / l division
        return per_tile + per_q_tile, 0, B * p["pairs"]
    raise ValueError(f"unknown attention kernel {kernel!r}; choose one of: naive, tiled, sdpa")


def _kernels(cfg: ModelConfig, B: int, T: int, kernel: str, recompute: bool) -> tuple[int, int, int]:
    """_kernel summed over the layers, each with its own window (layer_types); recompute: the layer
    that holds most, as one block at a time is recomputed."""
    per = [_kernel(cfg, B, T, kernel, cfg.window_at(i)) for i in range(cfg.n_layers)] or [(0, 0, 0)]
    if recompute:
        return max(per, key=lambda x: x[0] + x[1])
    return tuple(sum(x[j] for x in per) for j in range(3))


# Elements of F wide a feed-forward saves per token: SwiGLU keeps up, gate, silu(gate) and the
# product; relu² keeps relu's output (for both backwards) and the square (w_down's input). The
# families' kinds (geglu, swiglu_clamp) are estimates: docs/cost.md#activations-a.
FFN_SAVED = {"swiglu": 4, "geglu": 4, "swiglu_clamp": 7, "gelu": 2, "gelu_tanh": 2, "relu": 1, "relu2": 2, "none": 0}


def _ffn_saved(cfg: ModelConfig, BT: int, recompute: bool) -> int:
    """Elements the feed-forwards save: F wide per token on a dense layer; on a mixture layer k expert
    rows of F_e per token and the shared experts' row, each expert's gathered inputs and the slots'
    outputs (k·D per token each), and the router's: its probabilities (E), the top k (k), with
    router_renorm their sum and the rescaled weights (1 + k), and E for the balance loss.
    recompute: the largest one layer holds."""
    per, k, E = FFN_SAVED[cfg.ffn], cfg.n_active_experts, cfg.n_experts
    dense = per * BT * cfg.ffn_dim
    router = (E + k + (k + 1 if cfg.router_renorm else 0)) * BT + E
    mixture = (per * (k * cfg.expert_width + shared_width(cfg)) + 2 * k * cfg.dim) * BT + router
    layers = [mixture if cfg.is_moe(i) else dense for i in range(cfg.n_layers)]
    return (max(layers) if recompute else sum(layers)) if layers else 0


def _qk_norm_saved(cfg: ModelConfig, BT: int) -> tuple[int, int]:
    """(dtype, fp32) elements one layer's QK norm saves: the queries and keys it normalises (in fp32)
    and 1/rms of each row it normalises (each head's row, or the whole projection's with 'proj');
    a norm with a gain ('head', 'proj') keeps its normalised output too, for the gain's product."""
    if not cfg.qk_norm:
        return 0, 0
    rows = 2 if cfg.qk_norm == "proj" else cfg.n_heads + cfg.n_kv_heads
    weighted = BT * (cfg.q_dim + cfg.kv_dim) if cfg.qk_norm in ("head", "proj") else 0
    return weighted, BT * (cfg.q_dim + cfg.kv_dim + rows)


def _local_rope(cfg: ModelConfig, BT: int) -> int:
    """fp32 elements of the sliding layers' own RoPE table (rope_local_theta, Gemma 3): its cos and sin
    tables, B·T·H each (as measured by the tests; the global table counts B·T·H in all)."""
    local = any(cfg.rope_kind(i) == "local" for i in range(cfg.n_layers))
    return 2 * BT * cfg.head_dim if local else 0


def _offset_gains(cfg: ModelConfig, L: int) -> int:
    """fp32 elements of Gemma's gains 1 + w, one vector per norm module that ran (norm_offset)."""
    if not cfg.norm_offset:
        return 0
    qk = {"head": 2 * cfg.head_dim, "proj": cfg.q_dim + cfg.kv_dim}.get(cfg.qk_norm, 0)
    return (norms_per_block(cfg) * L + 1) * cfg.dim + L * qk


def activations(cfg: ModelConfig, B: int, T: int, kernel: str | None = None, recompute: bool = False) -> dict[str, int]:
    """Elements autograd saves for backward in one training forward over (B, T), by part.

    Keys: the parts (elements), 'total' (elements, all floating point), 'fp32' (how many
    of them are kept in fp32 whatever the dtype) and 'mask_bytes' (bool masks).
    recompute (--activation-checkpointing): the peak during backward instead, when each block
    keeps only its input (part 'block_inputs', L·B·T·D) and one block at a time recomputes its
    activations: the block parts count one layer, the parts outside the blocks are unchanged.
    """
    kernel = cfg.attention if kernel is None else kernel
    D, V = cfg.dim, cfg.vocab_size
    L = 1 if recompute else cfg.n_layers  # layers whose activations are held at once
    BT = B * T
    n_act, n_32 = _norm(cfg, BT)
    k_act, k_32, k_mask = _kernels(cfg, B, T, kernel, recompute)
    qk_act, qk_32 = _qk_norm_saved(cfg, BT)
    S = sublayers(cfg)  # sublayer inputs and dropout sites per block: 2, or 1 without a feed-forward
    norms = norms_per_block(cfg)  # D-wide norms per block: 2 with sandwich norms on each sublayer's output
    parts_act = {  # in the training dtype
        "norms": (norms * L + 1) * n_act + L * qk_act,
        # (+ one element: the √D that scales the embedding, with embed_scale)
        "linear_in": (S * L + 1) * BT * D + (1 if cfg.embed_scale else 0),
        # No joined copy of W_Q, W_K and W_V: the model runs them as three products. The key stays, 0, for
        # the reports' readers (docs/cost.md#every-json-key).
        "qkv_weight": 0,
        "attn_z": L * BT * cfg.q_dim,
        "attn_kernel": k_act,
        "ffn": _ffn_saved(cfg, BT, recompute),
        # Dropout keeps its noise per site (the embedding and both sublayers of every block):
        # a float tensor on the CPU; CUDA's fused dropout keeps a bool mask instead (1 byte).
        "dropout": (S * L + 1) * BT * D if cfg.dropout > 0 else 0,
        "block_inputs": cfg.n_layers * BT * D if recompute else 0,  # what checkpoint keeps of each block
    }
    parts_32 = {  # fp32 whatever the dtype
        # qk_norm: the queries and keys it normalises (in fp32) and 1/rms of every head's row of them
        "norms": (norms * L + 1) * n_32 + L * qk_32 + _offset_gains(cfg, L),
        "attn_kernel": k_32,
        "logits": BT * V * (2 if cfg.logit_softcap is not None else 1),  # the soft cap keeps its input and tanh's output
        "rope": (BT * cfg.head_dim if cfg.pos == "rope" else 0) + _local_rope(cfg, BT),
    }
    order = ("norms", "linear_in", "qkv_weight", "attn_z", "attn_kernel", "ffn", "dropout", "logits", "rope",
             "block_inputs")
    parts = {k: parts_act.get(k, 0) + parts_32.get(k, 0) for k in order}
    parts["total"] = sum(parts.values())
    parts["fp32"] = sum(parts_32.values())
    parts["mask_bytes"] = k_mask
    return parts


def activation_bytes(cfg: ModelConfig, B: int, T: int, dtype: str = "fp32", kernel: str | None = None,
                     recompute: bool = False) -> int:
    """Bytes of the saved activations: dtype-sized elements, fp32 ones, and bool masks."""
    a = activations(cfg, B, T, kernel, recompute)
    return (a["total"] - a["fp32"]) * dtype_bytes(dtype) + 4 * a["fp32"] + a["mask_bytes"]


def train_memory(
    cfg: ModelConfig, B: int, T: int, dtype: str = "fp32", kernel: str | None = None,
    optimizer: str = "adamw", master_weights: bool | None = None, recompute: bool = False,
) -> dict[str, int]:
    """Bytes held during a training step, by part, with 'total'.

    16 bytes per weight in fp32 and in mixed precision (master_weights, the default for bf16/fp16:
    ZeRO, Rajbhandari et al., 2020, §3.1); 8 with master_weights=False. Not counted: backward's
    temporaries, the allocator's slack, the CUDA context. See docs/cost.md#training-memory.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    P, nb = num_weights(cfg), dtype_bytes(dtype)
    master = dtype != "fp32" if master_weights is None else (master_weights and dtype != "fp32")
    state_bytes = 4 if master or dtype == "fp32" else nb
    parts = {
        "weights": P * nb,
        "grads": P * nb,
        "master_weights": P * 4 if master else 0,
        "optimizer": P * OPTIMIZERS[optimizer] * state_bytes,
        "activations": activation_bytes(cfg, B, T, dtype, kernel, recompute),
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_cache_numbers_per_token(cfg: ModelConfig) -> int:
    """2 (k and v) · L · K · H: the numbers a KV cache keeps per token (a key and a value per layer per KV head)."""
    return 2 * cfg.n_layers * cfg.kv_dim


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "bf16") -> int:
    """kv_cache_numbers_per_token at the dtype's size. Llama 3 8B in bf16: 2·32·8·128·2 = 131,072 bytes."""
    return kv_cache_numbers_per_token(cfg) * dtype_bytes(dtype)


def kv_cache_bytes(cfg: ModelConfig, tokens: int, batch: int = 1, dtype: str = "bf16") -> int:
    """Bytes of a cache holding `tokens` positions for each of `batch` rows (Llama 3 8B: 1 GiB at 8192)."""
    return batch * tokens * kv_cache_bytes_per_token(cfg, dtype)


def max_batch(memory_bytes: int, fixed_bytes: int, bytes_per_row: int) -> int:
    """Largest B with fixed + B·per_row ≤ memory (0 when not even one row fits)."""
    if bytes_per_row <= 0:
        raise ValueError("bytes_per_row must be positive")
    return max(0, (memory_bytes - fixed_bytes) // bytes_per_row)


def max_train_batch(cfg: ModelConfig, T: int, memory_bytes: int, dtype: str = "fp32", kernel: str | None = None,
                    optimizer: str = "adamw", master_weights: bool | None = None, recompute: bool = False) -> int:
    """Largest batch of T-token rows whose training step fits in memory_bytes (activations grow with B)."""
    one = train_memory(cfg, 1, T, dtype, kernel, optimizer, master_weights, recompute)
    per_row = train_memory(cfg, 2, T, dtype, kernel, optimizer, master_weights, recompute)["total"] - one["total"]
    return max_batch(memory_bytes, one["total"] - per_row, per_row)


def max_inference_batch(cfg: ModelConfig, T: int, memory_bytes: int, dtype: str = "bf16") -> int:
    """Largest batch that can generate up to T tokens each: weights plus a T-position KV cache per row."""
    return max_batch(memory_bytes, num_weights(cfg) * dtype_bytes(dtype), kv_cache_bytes(cfg, T, 1, dtype))
