"""The mixture-of-experts presets (one real configuration of each family) count their weights exactly:
the same total as transformers' own model of that configuration (built on the meta device from the
config.json our export writes), and the active weights near each model card's figure."""

from __future__ import annotations

import pytest
import torch

from glassformer.config import ModelConfig
from glassformer.convert import family_for
from glassformer.cost.params import active_weights, num_weights

transformers = pytest.importorskip("transformers")

# preset -> (the family export picks, the model card's total and active weights, in billions). Active weights
# count the token table, as cost does, except gpt-oss's 3.6B, which OpenAI counts without it (a lookup).
PRESETS = {
    "olmoe-1b-7b": ("olmoe", 6.9, 1.3),  # allenai/OLMoE-1B-7B-0924: 6.9B total, 1.3B active
    "gpt-oss-20b": ("gpt_oss", 20.9, 3.6),  # openai/gpt-oss-20b: 20.9B total, 3.6B active
    "qwen3-30b-a3b": ("qwen3_moe", 30.5, 3.4),  # Qwen/Qwen3-30B-A3B: 30.5B total, "3.3B activated" (3.35B)
    "mixtral-8x7b": ("mixtral", 46.7, 12.9),  # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B active
}


def transformers_weights(cfg: ModelConfig, family: str) -> int:
    """The weights of transformers' own model of cfg (its config.json as our export writes it)."""
    from glassformer.convert.families import family_named

    hc = transformers.AutoConfig.for_model(**family_named(family).config_to_hf(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hc)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_moe_preset_counts_as_transformers_does(name):
    family, total_b, active_b = PRESETS[name]
    cfg = ModelConfig.from_preset(name)
    assert family_for(cfg).name == family
    total, active = num_weights(cfg), active_weights(cfg)
    assert total == transformers_weights(cfg, family)
    assert round(total / 1e9, 1) == total_b
    lookup = cfg.vocab_size * cfg.dim if family == "gpt_oss" else 0
    assert round((active - lookup) / 1e9, 1) == active_b
    # what a token skips: the k-of-E experts it is not routed to, on every layer, and nothing else
    idle = cfg.n_layers * (cfg.n_experts - cfg.n_active_experts) * 3 * cfg.dim * cfg.expert_width
    idle += cfg.n_layers * (cfg.n_experts - cfg.n_active_experts) * (2 * cfg.expert_width + cfg.dim) * cfg.ffn_bias
    assert total - active == idle


def test_mixtral_total_is_the_published_count():
    # Mixtral 8x7B: 46,702,792,704 weights (its safetensors index's total_size / 2 bytes).
    assert num_weights(ModelConfig.from_preset("mixtral-8x7b")) == 46_702_792_704
