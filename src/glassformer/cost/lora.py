"""LoRA fine-tuning's costs from a config alone: the adapters' trainable weights, r·(in + out) per
adapted product, and the memory of a step that trains only them (the base held, frozen, in the
dtype; gradients, master copy and optimizer moments for the adapters alone). docs/cost.md#lora.
"""

from __future__ import annotations

from ..config import ModelConfig
from .memory import OPTIMIZERS, activation_bytes, dtype_bytes
from .params import num_weights, shared_width

# The block products an adapter may wrap: convert.lora.LORA_TARGETS, spelled here so that cost/
# stays free of torch (tests/cost checks the two lists agree).
TARGETS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def product_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable product of one block; no w_gate without a gated feed-forward.

    >>> product_shapes(ModelConfig.from_preset("tiny"))["wk"]
    (64, 32)
    """
    D, F = cfg.dim, cfg.ffn_dim
    shapes = {"wq": (D, cfg.q_dim), "wk": (D, cfg.kv_dim), "wv": (D, cfg.kv_dim), "wo": (cfg.q_dim, D),
              "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
    if not cfg.gated:
        del shapes["w_gate"]
    return shapes


def lora_weights(cfg: ModelConfig, r: int, targets=TARGETS) -> dict[str, int]:
    """Trainable weights by target, summed over the L layers, with 'total': L·r·(in + out) each.

    >>> lora_weights(ModelConfig.from_preset("tiny"), 8, ("wq", "wv"))
    {'wq': 2048, 'wv': 1536, 'total': 3584}
    """
    if r < 1:
        raise ValueError(f"the LoRA rank must be at least 1, got {r}")
    shapes = product_shapes(cfg)
    missing = [t for t in targets if t not in shapes]
    if missing:
        raise ValueError(f"LoRA targets {missing} are not products of this model; choose from {', '.join(shapes)}")
    parts = {t: r * sum(sum(io) for i in range(cfg.n_layers) for io in _layer_products(cfg, i, t, shapes))
             for t in targets}
    parts["total"] = sum(parts.values())
    return parts


def _layer_products(cfg: ModelConfig, layer: int, target: str, shapes: dict) -> list[tuple[int, int]]:
    """(in, out) of every product `target` names in block `layer`: one, or on a mixture layer one per
    expert and one for the shared experts (apply_lora adapts each of them)."""
    if target in ("wq", "wk", "wv", "wo") or not cfg.is_moe(layer):
        return [shapes[target]]
    D, widths = cfg.dim, [cfg.expert_width] * cfg.n_experts + ([shared_width(cfg)] if cfg.n_shared_experts else [])
    return [(F, D) if target == "w_down" else (D, F) for F in widths]


def _adapter_rows(cfg: ModelConfig, targets) -> int:
    """Rows (per token) the adapters run on, summed over layers and targets: one per product on a
    dense layer; on a mixture layer k routed experts' rows and the shared experts' row."""
    rows = 0
    for i in range(cfg.n_layers):
        for t in targets:
            dense = t in ("wq", "wk", "wv", "wo") or not cfg.is_moe(i)
            rows += 1 if dense else cfg.n_active_experts + (1 if cfg.n_shared_experts else 0)
    return rows


def lora_train_memory(cfg: ModelConfig, B: int, T: int, r: int, targets=TARGETS, dtype: str = "fp32",
                      kernel: str | None = None, optimizer: str = "adamw",
                      master_weights: bool | None = None) -> dict[str, int]:
    """Bytes a LoRA training step holds, by part, with 'total': the frozen base and the adapters in
    the dtype, gradients, master copy and optimizer state for the adapters only, and activations.

    The activations are full fine-tuning's (a frozen product still passes gradients back to the
    adapters below it, so its input stays saved for the adapter beside it) plus each adapter's
    r-wide x·Aᵀ: an estimate, docs/cost.md#lora."""
    n, P, nb = lora_weights(cfg, r, targets)["total"], num_weights(cfg), dtype_bytes(dtype)
    master = dtype != "fp32" if master_weights is None else (master_weights and dtype != "fp32")
    state_bytes = 4 if master or dtype == "fp32" else nb
    act = activation_bytes(cfg, B, T, dtype, kernel) + _adapter_rows(cfg, targets) * B * T * r * nb
    parts = {
        "base_weights": P * nb,
        "adapter_weights": n * nb,
        "grads": n * nb,
        "master_weights": n * 4 if master else 0,
        "optimizer": n * OPTIMIZERS[optimizer] * state_bytes,
        "activations": act,
    }
    parts["total"] = sum(parts.values())
    return parts


def lora_keys(cfg: ModelConfig, B: int, T: int, r: int, targets, dtype: str, kernel: str, optimizer: str,
              master_weights: bool | None) -> dict:
    """The "lora" entry of `estimate`'s report (docs/cost.md#every-json-key)."""
    targets = tuple(TARGETS if targets is None else targets)
    w = lora_weights(cfg, r, targets)
    mem = lora_train_memory(cfg, B, T, r, targets, dtype, kernel, optimizer, master_weights)
    return {"r": r, "targets": list(targets), "trainable_weights": w["total"],
            "trainable_by_target": {k: v for k, v in w.items() if k != "total"},
            "trainable_fraction": w["total"] / num_weights(cfg),
            "adapter_file_bytes": 4 * w["total"],
            "optimizer_bytes": mem["optimizer"],
            "train_memory_bytes": mem["total"],
            "train_memory_by_part": {k: v for k, v in mem.items() if k != "total"}}
