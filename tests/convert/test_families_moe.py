"""The mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE, gpt-oss) against transformers: tiny random
models through a real folder (logits, 20 greedy tokens, the way back), the other layouts transformers'
loader reads (fused experts, gpt-oss's MXFP4 blocks), and what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.cli import main  # noqa: E402
from glassformer.convert import family_for, load_hf, to_transformers  # noqa: E402
from glassformer.convert.families import family_named  # noqa: E402
from glassformer.convert.families_moe import dequantize_mxfp4  # noqa: E402
from glassformer.errors import UserError  # noqa: E402

from .family_parity import assert_logits_match, check_family, hf_random, tiny  # noqa: E402

# Each family's tiny config: experts of a width of their own, top 2, every switch the family has moved
# off its default where transformers lets it (a window shorter than the 48 ids, dense layers among the
# mixture layers, renormalised or raw top-k weights, attention biases, a clamp that bites).
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**tiny(
        num_hidden_layers=3, mlp_only_layers=[1], moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, attention_bias=True)),
    "mixtral": lambda: transformers.MixtralConfig(**tiny(
        intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    "olmoe": lambda: transformers.OlmoeConfig(**tiny(
        intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
    # 4 layers: sliding, full, sliding, full; YaRN's factor = 512 / 16 as transformers expects; a clamp at
    # 0.3 so that gate and up values (about ±0.6 here) are really clamped.
    "gpt_oss": lambda: transformers.GptOssConfig(**tiny(
        num_hidden_layers=4, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        max_position_embeddings=512, swiglu_limit=0.3,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             original_max_position_embeddings=16, truncate=False))),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_matches_transformers(name, tmp_path):
    hf, ours = check_family(CONFIGS[name](), tmp_path)
    assert family_for(ours.config).name == name
    cfg = ours.config
    assert cfg.n_experts == hf.config.num_local_experts and cfg.n_active_experts == 2


def test_what_each_family_sets(tmp_path):
    """The switches each family turns on, read from transformers' own config.json (beside the parity
    above, which shows they compute what transformers does)."""
    def cfg_of(name):
        hc = CONFIGS[name]()
        return family_named(name).config_from_hf(json.loads(hc.to_json_string()))

    q = cfg_of("qwen3_moe")
    assert (q.qk_norm, q.moe_layers, q.expert_width, q.ffn_dim, q.router_renorm, q.attn_bias) == ("head", [0, 2], 48, 112, True, True)
    m = cfg_of("mixtral")
    assert (m.qk_norm, m.sliding_window, m.layer_types, m.router_renorm) == (False, 24, None, True)
    o = cfg_of("olmoe")
    assert (o.qk_norm, o.router_renorm, o.n_experts) == ("proj", False, 8)
    g = cfg_of("gpt_oss")
    assert (g.attn_sinks, g.attn_bias, g.ffn_bias, g.ffn, g.swiglu_limit) == (True, True, True, "swiglu_clamp", 0.3)
    assert g.layer_types == ["sliding_attention", "full_attention"] * 2 and g.sliding_window == 16
    assert g.rope_scaling["rope_type"] == "yarn"


def test_a_glassformer_mixture_exports_as_mixtral():
    """A mixture trained here (the tiny preset with experts) is a Mixtral to transformers, the same logits."""
    torch.manual_seed(0)
    ours = Transformer(ModelConfig.from_preset("tiny", n_experts=4, n_active_experts=2)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.08)
    assert family_for(ours.config).name == "mixtral"
    hf = to_transformers(ours, attn_implementation="eager").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_logits_match(hf, ours, ids, rel=1e-5)


# ----------------------------------------------------------------------------- other layouts


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_fused_experts_are_read_as_transformers_reads_them(name, tmp_path):
    """transformers' in-memory state dict (experts fused into gate_up_proj (E, 2F, D) and down_proj,
    Mixtral's block_sparse_moe named mlp) written as it is: transformers' loader reads that file, so we do."""
    from safetensors.torch import save_file

    hf = hf_random(CONFIGS[name]())
    state = hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # the fused layout, really
    folder = tmp_path / "fused"
    hf.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ours, _ = load_hf(folder)
    ids = torch.randint(0, 101, (2, 48), generator=torch.Generator().manual_seed(2))
    assert_logits_match(back, ours.eval(), ids)
    assert_logits_match(hf, ours, ids)


def test_experts_stored_twice_are_refused(tmp_path):
    from safetensors.torch import save_file

    hf = hf_random(CONFIGS["olmoe"]())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    state["model.layers.0.mlp.experts.7.up_proj.weight"] = torch.zeros(48, 64)  # beside the fused tensor
    hf.config.save_pretrained(tmp_path / "twice")
    save_file(state, str(tmp_path / "twice" / "model.safetensors"))
    with pytest.raises(UserError, match="holds its experts twice"):
        load_hf(tmp_path / "twice")


def random_mxfp4(shape, seed, exponents=(-2, 3)):
    """Random MXFP4 blocks (…, G, 16) uint8 and scales (…, G): e8m0 bytes 127 + exponents[0] .. 127 + exponents[1] - 1."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(127 + exponents[0], 127 + exponents[1], shape[:-1], generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 10, 2, 16), seed=0)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales, dtype=torch.float32)
    assert got.shape == ref.shape == (3, 64, 10)
    assert torch.equal(got, ref)
    assert got.abs().max() > 1  # not all zeros


def test_a_gpt_oss_folder_of_mxfp4_experts_loads(tmp_path):
    """gpt-oss as its hub folders store it: each layer's experts as MXFP4 _blocks/_scales (quantization_config
    mxfp4). Ours dequantizes them on reading; the model equals transformers' with the dequantized weights."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hc = CONFIGS["gpt_oss"]()
    hf = hf_random(hc)
    E, D, F = hc.num_local_experts, hc.hidden_size, hc.intermediate_size
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            for name, rows, cols in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
                # scales of 2^-7 .. 2^-5: weights up to about ±0.2, like the rest of the model's
                blocks, scales = random_mxfp4((E, rows, cols // 32, 16), seed=10 * i + len(name), exponents=(-7, -4))
                state[p + name + "_blocks"], state[p + name + "_scales"] = blocks, scales
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    folder = tmp_path / "mxfp4"
    config = json.loads(hc.to_json_string())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens", "lm_head"]}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = load_hf(folder, dtype="float32")
    assert torch.equal(ours.blocks[0].ffn.experts[1].w_gate.weight, hf.model.layers[0].mlp.experts.gate_up_proj[1, :, 0::2].t())
    ids = torch.randint(0, 101, (2, 48), generator=torch.Generator().manual_seed(3))
    assert_logits_match(hf, ours.eval(), ids)


# ----------------------------------------------------------------------------- refused by name


def _config(name: str, **changes) -> dict:
    hf = json.loads(CONFIGS[name]().to_json_string())
    return {**hf, **changes}


@pytest.mark.parametrize("name, changes, words", [
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ("gpt_oss", dict(swiglu_alpha=1.5), "swiglu_alpha"),
    ("gpt_oss", dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("qwen3_moe", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "dynamic"),
    ("qwen3_moe", dict(mlp_only_layers=[0, 1, 2]), "no mixture-of-experts layer"),
    ("olmoe", dict(num_experts=100_000), "n_experts"),
    ("mixtral", dict(num_experts_per_tok=5), "n_active_experts"),
    ("olmoe", dict(num_experts=8, num_local_experts=4), "num_local_experts=4"),
    ("gpt_oss", dict(num_local_experts=None), "num_local_experts"),
])
def test_what_we_do_not_compute_is_refused_by_name(name, changes, words):
    with pytest.raises(UserError, match=words):
        family_named(name).config_from_hf(_config(name, **changes))


def test_an_absurd_expert_count_is_refused_before_any_weight(tmp_path):
    folder = tmp_path / "huge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_config("olmoe", num_experts=10**9)))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="n_experts"):
        load_hf(folder)


@pytest.mark.parametrize("changes, words", [
    (dict(router="sigmoid"), "sigmoid"),
    (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(moe_layers=[0]), "moe_layers"),  # only qwen3_moe keeps dense layers, and it has q/k norms
])
def test_an_export_no_family_holds_is_refused_by_name(changes, words):
    cfg = ModelConfig.from_preset("tiny", n_experts=4, n_active_experts=2, **changes)
    with pytest.raises(UserError, match=words):
        family_for(cfg)


def test_convert_both_ways_on_the_command_line(tmp_path):
    """`convert --from-hf` a Qwen3-MoE folder, `--to-hf` it back: transformers reads the same model."""
    hf = hf_random(CONFIGS["qwen3_moe"]())
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    ids = torch.randint(0, 101, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, hf(ids).logits, rtol=0, atol=1e-5 * float(hf(ids).logits.abs().max()))
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mlp_only_layers"] == [1]


# ----------------------------------------------------------------------------- GGUF (llama.cpp itself: test_llamacpp_moe.py)

GRAPHS = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama", "gpt_oss": "gpt-oss"}


def _gguf_ready(name: str, **changes) -> dict:
    """The family's fixture config, kept to what its llama.cpp graph hard-codes, plus changes."""
    keep = {"qwen3_moe": dict(mlp_only_layers=[], attention_bias=False), "olmoe": dict(num_key_value_heads=4),
            "mixtral": dict(sliding_window=None), "gpt_oss": dict(swiglu_limit=7.0)}[name]
    return {**_config(name, **keep), **changes}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_gguf_graph_and_the_way_back(name, tmp_path):
    """Each family goes to its llama.cpp graph; --from-gguf gives back the same config and weights."""
    from glassformer.checkpoint.folders import save_model
    from glassformer.convert.gguf import export_gguf, gguf_arch
    from glassformer.convert.gguf_read import read_gguf

    cfg = family_named(name).config_from_hf(_gguf_ready(name))
    assert gguf_arch(cfg) == GRAPHS[name]
    torch.manual_seed(0)
    model = Transformer(cfg)
    save_model(tmp_path / "ckpt", model)
    export_gguf(tmp_path / "ckpt", tmp_path / "m.gguf", "f32", progress=False)
    back, state, _ = read_gguf(tmp_path / "m.gguf")
    assert back == cfg
    ours = model.state_dict()
    assert sorted(state) == sorted(k for k in ours if not (cfg.tie_embeddings and k == "lm_head.weight"))
    assert all(torch.equal(state[k], ours[k]) for k in state)


@pytest.mark.parametrize("name, changes, words", [
    ("qwen3_moe", dict(norm_topk_prob=False), "router_renorm=False"),
    ("olmoe", dict(norm_topk_prob=True), "router_renorm=True"),
    ("olmoe", dict(num_key_value_heads=2), "n_kv_heads=2"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "moe_layers"),
    ("mixtral", dict(sliding_window=24), "sliding_window=24"),
    ("gpt_oss", dict(swiglu_limit=0.3), "swiglu_limit=0.3"),
    ("gpt_oss", dict(layer_types=["full_attention", "sliding_attention"] * 2), "sliding layers [1, 3]"),
    ("qwen3_moe", dict(attention_bias=True), "attn_bias=True"),
])
def test_gguf_refuses_what_the_graph_hard_codes_otherwise(name, changes, words):
    from glassformer.convert.gguf import gguf_arch

    cfg = family_named(name).config_from_hf(_gguf_ready(name, **changes))
    with pytest.raises(UserError, match="llama.cpp") as e:
        gguf_arch(cfg)
    assert words in str(e.value), str(e.value)
