"""What a model costs, from its config alone (pure functions; no model is built; tests/cost).

    from glassformer.cost import estimate, format_table
    report = estimate(ModelConfig.from_preset("llama3-8b"), batch=1, seq=8192)
    report["params"], report["kv_cache_bytes_per_token"]   # 8030261248, 131072
Formulas and every key of `estimate`'s dict: docs/cost.md.
"""

from .flops import (
    all_score_pairs,
    causal_pairs,
    crossover_seq,
    decode_flops,
    forward_flops,
    score_pairs,
    tiled_pairs,
    train_flops_per_token,
    train_step_flops,
)
from .hardware import HARDWARE, Hardware, get_hardware, parse_bytes
from .memory import (
    activation_bytes,
    activations,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    kv_cache_numbers_per_token,
    max_inference_batch,
    max_train_batch,
    train_memory,
)
from .plot import plot_costs
from .report import estimate, format_table
from .params import active_weights, layer_weights, num_weights, weights

__all__ = [
    "estimate", "format_table", "plot_costs", "weights", "layer_weights", "num_weights", "active_weights", "all_score_pairs", "forward_flops", "train_step_flops",
    "train_flops_per_token",
    "decode_flops", "score_pairs", "causal_pairs", "tiled_pairs", "crossover_seq", "activations",
    "activation_bytes", "train_memory", "kv_cache_bytes_per_token", "kv_cache_numbers_per_token", "kv_cache_bytes", "max_train_batch",
    "max_inference_batch", "HARDWARE", "Hardware", "get_hardware", "parse_bytes",
]
