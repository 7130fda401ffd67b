"""glassformer.cost on the families' switches (issue 45): every weight a tiny model of each switch
allocates is counted, part by part; a mixture's total and active weights and FLOPs per token agree
with the hand formula and with FlopCounterMode on the naive kernel."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.cost import activations, estimate, forward_flops, weights

from ..explaining.test_explain_families import FAMILIES
from .test_cost import meta_model, real_parts

SWITCHES = {**FAMILIES,
            "biases_everywhere": dict(bias=True, qk_norm="proj", norm_placement="sandwich", n_experts=3,
                                      n_active_experts=1, n_shared_experts=1, moe_layers=[0]),
            "relu_experts": dict(ffn="relu", n_experts=5, n_active_experts=3, ffn_bias=True),
            "attention_only_sandwich": dict(ffn="none", norm_placement="sandwich", attn_sinks=True)}


def config(name: str) -> ModelConfig:
    return ModelConfig.from_preset("tiny", **SWITCHES[name])


@pytest.mark.parametrize("name", list(SWITCHES))
def test_every_weight_counted_by_part(name):
    cfg = config(name)
    model = meta_model(cfg)
    w = weights(cfg)
    assert w["total"] == model.num_params() == sum(p.numel() for p in model.parameters())
    assert {k: v for k, v in w.items() if v and k not in ("total", "non_embedding", "active")} == real_parts(model)


@pytest.mark.parametrize("name", list(SWITCHES))
def test_forward_flops_match_the_flop_counter(name):
    cfg = config(name).replace(attention="naive")
    model = Transformer(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(idx)
    assert forward_flops(cfg, 2, 9)["total"] == fc.get_total_flops()


def test_mixture_total_and_active_by_hand():
    # 2 layers, both mixtures: E = 8 experts of F_e = 24, k = 2 per token, one shared expert, SwiGLU (m = 3)
    cfg = ModelConfig.from_preset("tiny", n_experts=8, n_active_experts=2, n_shared_experts=1, expert_dim=24)
    D, V, L, E, k, Fe, NH, KH = 64, 512, 2, 8, 2, 24, 64, 32
    attn = D * NH + 2 * D * KH + NH * D
    expert = 3 * D * Fe
    per_layer = attn + E * D + E * expert + expert + 2 * D  # attention, router, experts, shared, two norms
    total = L * per_layer + D + 2 * V * D  # final norm, embedding, head
    r = estimate(cfg, batch=1, seq=16)
    assert r["params"] == total == Transformer(cfg).num_params()
    assert r["params_active"] == total - L * (E - k) * expert
    assert r["params_by_part"]["experts"] == L * E * expert and r["params_by_part"]["router"] == L * E * D
    # per token: the products with weights, k experts; and with all E (the dense equivalent)
    T = 16
    scores = 4 * L * T * NH  # QKᵀ and weights·V over the full grid, per token
    active = L * (2 * D * (NH + 2 * KH) + 2 * NH * D + 2 * D * E + k * 2 * expert + 2 * expert) + 2 * D * V
    assert r["flops_per_token"] == active + scores
    assert r["flops_per_token_all_experts"] == active + L * (E - k) * 2 * expert + scores
    # one decoded token reads the active weights only
    assert r["decode"]["bytes_per_token"] == r["params_active"] * 2 + r["kv_cache_bytes_per_token"] * T


def test_dense_layers_of_a_mixture_model_and_sliding_layers():
    cfg = ModelConfig.from_preset("tiny", n_layers=3, n_experts=4, n_active_experts=1, moe_layers=[1],
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  sliding_window=4, attention="naive")
    w = weights(cfg)
    assert w["ffn"] == 2 * 3 * 64 * 176 and w["experts"] == 4 * 3 * 64 * 176  # layers 0 and 2 stay dense
    f = forward_flops(cfg, 1, 10, "causal")
    full, window = 10 * 11 // 2, 4 * 5 // 2 + 6 * 4  # causal pairs of the full layer, of each sliding one
    assert f["attn_scores"] == 2 * 64 * (full + 2 * window)


def test_cost_of_a_mixture_checkpoint_prints_total_and_active(tmp_path, capsys):
    from glassformer.checkpoint.folders import save_model

    cfg = config("olmoe")
    save_model(tmp_path / "ckpt", Transformer(cfg))
    assert main(["cost", "--checkpoint", str(tmp_path / "ckpt"), "--seq", "32"]) == 0
    out = capsys.readouterr().out
    r = estimate(cfg, seq=32)
    assert f"{r['params']:,}" in out and f"{r['params_active']:,}" in out and "active per token" in out
    assert "with every expert" in out and r["params_active"] < r["params"]


@pytest.mark.parametrize("kernel", ["naive", "sdpa", "tiled"])
def test_activations_of_each_switch_are_what_autograd_saves(kernel):
    """What each family switch adds to the saved activations, counted (cost.activations) and measured
    (autograd's saved tensors, each storage once), agree exactly on each kernel, the mixtures' router,
    gathered inputs and slot outputs included."""
    from .test_cost import saved_for_backward

    def gap(overrides):
        cfg = ModelConfig.from_preset("tiny", attention=kernel, **overrides)
        torch.manual_seed(0)
        return saved_for_backward(Transformer(cfg).train(), 2, 16)[0] - activations(cfg, 2, 16)["total"]

    base = gap({})  # what the plain model's count leaves out (the same with every switch)
    assert {name: gap(SWITCHES[name]) - base for name in SWITCHES} == {name: 0 for name in SWITCHES}


@pytest.mark.parametrize("name", ["qwen3_moe", "shared_sigmoid", "gemma2"])
def test_lora_trainable_weights_are_the_adapters_apply_lora_makes(name):
    """LoRA on a mixture adapts every expert's products and the shared experts': cost's count of the
    trainable weights is what apply_lora allocates."""
    from glassformer.convert.lora import LoraConfig, apply_lora
    from glassformer.cost.lora import lora_weights

    cfg = config(name)
    targets = ("wq", "wo", "w_gate", "w_up", "w_down")
    model = apply_lora(Transformer(cfg), LoraConfig(r=4, alpha=8.0, targets=targets))
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_weights(cfg, 4, targets)["total"] == adapters
