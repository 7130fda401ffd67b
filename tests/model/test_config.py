import pytest
import torch

from glassformer import PRESETS, ModelConfig, Transformer


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(dim=66, n_heads=4), "set head_dim explicitly"),
        (dict(dim=60, n_heads=4), "head_dim must be even"),
        (dict(norm="batch"), "norm must be one of rms, layer"),
        (dict(ffn="tanh"), "ffn must be one of"),
        (dict(attention="flash3"), "attention must be one of sdpa, naive, tiled"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(dropout=1.0), "dropout must be in [0, 1)"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "original_max_position_embeddings"),
        (dict(sliding_window=0), "sliding_window"),
    ],
)
def test_bad_configs_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**{"vocab_size": 64, "dim": 64, "n_heads": 4, **kwargs})


def test_odd_head_dim_is_fine_without_rope():
    cfg = ModelConfig(dim=60, n_heads=4, pos="learned")
    assert cfg.head_dim == 15


def test_dict_round_trip_keeps_every_field():
    cfg = ModelConfig.from_preset("llama3.2-1b")
    again = ModelConfig.from_json(cfg.to_json())
    assert again == cfg and again.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layer": 3})


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        ModelConfig.from_preset("gpt5")


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_on_meta(name):
    cfg = ModelConfig.from_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.n_experts:  # routing reads the router's numbers (which tokens go where): meta tensors have none
        experts = [len(b.ffn.experts) for i, b in enumerate(model.blocks) if cfg.is_moe(i)]
        assert experts and experts == [cfg.n_experts] * len(experts)
        return
    logits, _ = model(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    assert logits.shape == (1, 4, cfg.vocab_size)


def test_llama3_8b_has_its_published_weight_count():
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_preset("llama3-8b"))
    assert model.num_params() == 8_030_261_248
