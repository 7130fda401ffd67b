"""The dense families of issue 45 (qwen3, gemma2, gemma3_text, olmo2, phi3, smollm3) against
transformers on the same weights: tiny random models with their norms moved off identity, read
through a real folder, compared logit by logit and greedy token by token, and written back.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.cli import main  # noqa: E402
from glassformer.convert import config_from_hf  # noqa: E402
from glassformer.convert.families import family_for  # noqa: E402
from glassformer.convert.hf import save_hf  # noqa: E402
from glassformer.errors import UserError  # noqa: E402

from ..support import reinit  # noqa: E402
from .family_parity import check_family, hf_random, ours_from_hf, tiny  # noqa: E402

W = 8  # a sliding window shorter than the 48 ids compared and the 28 tokens generated
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}

# case -> (transformers config class, its arguments over tiny(), the family to write back by name or None)
CASES = {
    "qwen3": ("Qwen3Config", dict(attention_bias=True, rope_parameters={  # Qwen3's long-context YaRN
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 40, "rope_theta": 10000.0}), None),
    "qwen3-mixed-window": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                               num_hidden_layers=3, tie_word_embeddings=True), None),
    "smollm3-nope": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2, tie_word_embeddings=True,
                                           use_sliding_window=True, sliding_window=W), None),  # windows on NoPE layers
    "olmo2": ("Olmo2Config", {}, None),
    "phi3": ("Phi3Config", dict(sliding_window=W), "phi3"),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=W, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0), None),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=W, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters=GEMMA3_ROPE, tie_word_embeddings=True), None),
}


def hf_config(case: str):
    kind, kw, _ = CASES[case]
    return getattr(transformers, kind)(**tiny(**kw))


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(case, tmp_path):
    """Logits within 1e-4 on ids longer than any window, 20 greedy tokens, and back to 1e-5."""
    check_family(hf_config(case), tmp_path, family=CASES[case][2])


@pytest.mark.parametrize("case", ["gemma2", "olmo2"])
def test_a_norm_read_the_wrong_way_shows(case, tmp_path):
    """The fixtures' norm weights sit off identity, so (1 + w) read as w (or the reverse) changes
    the logits far beyond the tolerance: the parity above is not passing by luck."""
    hf = hf_random(hf_config(case))
    ours = ours_from_hf(hf, tmp_path)
    ids = torch.randint(0, 101, (1, 24))
    with torch.no_grad():
        ref = hf(ids).logits
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(1.0)
        got, _ = ours(ids)
    assert (got - ref).abs().max() > 0.05 * ref.abs().max()


def test_what_each_family_adds_reaches_the_config():
    qwen3 = config_from_hf(hf_config("qwen3-mixed-window").to_dict())
    assert (qwen3.qk_norm, qwen3.sliding_window, qwen3.layer_types) == (
        "head", W, ["full_attention", "sliding_attention", "sliding_attention"])
    gemma3 = config_from_hf(hf_config("gemma3").to_dict())
    assert (gemma3.norm_offset, gemma3.norm_placement, gemma3.ffn, gemma3.embed_scale, gemma3.qk_norm) == (
        True, "sandwich", "geglu", True, "head")
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling["rope_type"]) == (100000.0, 500.0, "linear")
    gemma2 = config_from_hf(hf_config("gemma2").to_dict())
    assert (gemma2.attn_softcap, gemma2.logit_softcap, gemma2.query_pre_attn_scalar) == (5.0, 3.0, 24.0)
    assert gemma2.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]  # Gemma 2 alternates
    olmo2 = config_from_hf(hf_config("olmo2").to_dict())
    assert (olmo2.norm_placement, olmo2.qk_norm) == ("post_branch", "proj")
    smol = config_from_hf(hf_config("smollm3-nope").to_dict())
    assert smol.nope_layers == [1, 3]  # no_rope_layers [1, 0, 1, 0]: every second layer has no RoPE
    assert [smol.window_at(i) for i in range(4)] == [None, W, None, W]  # SmolLM3 slides its NoPE layers only
    assert config_from_hf(hf_config("qwen3").to_dict()).rope_scaling["rope_type"] == "yarn"


def test_export_picks_the_family_and_phi3_is_written_by_name():
    for case, want in (("qwen3", "qwen3"), ("gemma2", "gemma2"), ("gemma3", "gemma3_text"), ("olmo2", "olmo2"),
                       ("smollm3-nope", "smollm3"), ("phi3", "mistral")):
        assert family_for(config_from_hf(hf_config(case).to_dict())).name == want, case
    phi3 = config_from_hf(hf_config("phi3").to_dict())
    assert family_for(phi3, "phi3").name == "phi3"
    with pytest.raises(UserError, match="'gemma2' cannot hold this model: it has .*norm_offset=False"):
        family_for(phi3, "gemma2")


@pytest.mark.parametrize("switches, names", [
    (dict(qk_norm="proj"), ["qk_norm='proj'", "norm_placement='pre'"]),  # OLMo 2's norm needs its placement
    (dict(norm_offset=True), ["norm_offset=True"]),  # (1 + w) without Gemma's other parts
    (dict(attn_sinks=True), ["attn_sinks=True"]),
    (dict(qk_norm="head", rope_local_theta=500.0, sliding_window=4), ["rope_local_theta=500.0"]),
])
def test_export_refuses_what_no_family_holds_by_name(switches, names):
    cfg = ModelConfig.from_preset("tiny", **switches)
    with pytest.raises(UserError) as e:
        family_for(cfg)
    assert "Hugging Face" in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("family, switches", [
    ("qwen3", dict(qk_norm="head", attn_bias=True)),
    ("olmo2", dict(qk_norm="proj", norm_placement="post_branch")),
    ("phi3", dict()),
])
def test_interleaved_pairs_are_reordered_on_export(family, switches, tmp_path):
    """A model trained with Meta's interleaved RoPE pairs: its Q/K rows, their norm weights and
    Phi-3's fused rows are reordered into transformers' halves, and transformers computes our logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=64,
                      rope_pairs="interleaved", **switches)
    ours = reinit(Transformer(cfg), std=0.1).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape))  # a permuted norm weight must show
    folder = save_hf(ours, tmp_path / "hf", family=family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    assert type(hf).__name__.lower().startswith(family)
    ids = torch.randint(0, 101, (1, 32))
    with torch.no_grad():
        ref, (got, _) = hf(ids).logits, ours(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


# ----------------------------------------------------------------------------- refused by name


def _cfg(case: str, **changes) -> dict:
    d = hf_config(case).to_dict()
    d.update(changes)
    return d


REFUSED = {
    "qwen3 gelu": (_cfg("qwen3", hidden_act="gelu"), "hidden_act 'gelu'"),
    "phi3 longrope": (_cfg("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0],
                                                    "long_factor": [1.0]}), "'longrope'"),
    "phi3 su (old name)": (_cfg("phi3", rope_parameters=None, rope_scaling={"type": "su", "short_factor": [1.0]}), "'su'"),
    "phi4-mini partial rotary": (_cfg("phi3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                               "partial_rotary_factor": 0.75}), "partial_rotary_factor=0.75"),
    "qwen3 dynamic rope": (_cfg("qwen3", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
                           "RoPE scaling 'dynamic'"),
    "olmo clip_qkv": (_cfg("olmo2", clip_qkv=8.0), "clip_qkv=8.0"),
    "gemma2 exact gelu": (_cfg("gemma2", hidden_activation="gelu"), "hidden_activation 'gelu'"),
    "gemma3 bidirectional": (_cfg("gemma3", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    "gemma3 scaled local rope": (_cfg("gemma3", rope_parameters={**GEMMA3_ROPE, "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}), "sliding layers"),
    "gemma3 with vision, no text_config": (dict(model_type="gemma3", vision_config={}), "no text_config"),
    "smollm3 no_rope_layers length": (_cfg("smollm3-nope", no_rope_layers=[1, 0]), "no_rope_layers"),
    "qwen3 layer_types": (_cfg("qwen3-mixed-window", layer_types=["full_attention", "chunked_attention", "full_attention"]),
                          "layer_types"),
    "gemma2 window": (_cfg("gemma2", sliding_window=-4), "sliding_window=-4"),
    "gemma2 absurd heads": (_cfg("gemma2", num_attention_heads=3), "n_heads"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_switches_are_refused_by_name(case):
    hf, message = REFUSED[case]
    with pytest.raises(UserError, match=None) as e:
        config_from_hf(hf)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_text_part_of_a_multimodal_gemma3(tmp_path):
    """Gemma3ForConditionalGeneration: its language model is read (the vision tower left unread), gives
    transformers' own text logits, and goes back as a text-only Gemma3ForCausalLM."""
    from .family_parity import move_off_identity

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    hc = transformers.Gemma3Config(text_config=tiny(**CASES["gemma3"][1]), vision_config=vision, mm_tokens_per_image=4,
                                   image_token_index=100, boi_token_index=98, eoi_token_index=99)
    torch.manual_seed(0)
    hf = move_off_identity(transformers.Gemma3ForConditionalGeneration(hc)).eval()
    hf.config._attn_implementation = "eager"
    ours = ours_from_hf(hf, tmp_path)
    assert ours.config == config_from_hf(hf_config("gemma3").to_dict())
    ids = torch.randint(0, 98, (1, 40))  # text only: below the image tokens
    with torch.no_grad():
        ref, (got, _) = hf(input_ids=ids).logits, ours(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    back = transformers.AutoModelForCausalLM.from_pretrained(save_hf(ours, tmp_path / "back"),
                                                             attn_implementation="eager").eval()
    assert type(back).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_hub_multimodal_gemma3_config_takes_the_text_defaults():
    """gemma-3-4b's config.json writes six text fields; the rest are Gemma3TextConfig's defaults."""
    from glassformer.cost.params import weights

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    cfg = config_from_hf({"model_type": "gemma3", "text_config": text})
    assert (cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_local_theta) == (262208, 8, 4, 256, 1e4)
    assert weights(cfg)["total"] == 3_880_263_168  # what transformers builds from the same text_config


# ----------------------------------------------------------------------------- the command line


def test_cli_converts_a_family_both_ways(tmp_path):
    """convert --from-hf, then --to-hf: transformers reads the result as the same family, same logits."""
    hf = hf_random(hf_config("gemma3"))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "gemma3_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    ids = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        ref, got = hf(ids).logits, back(ids).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_cli_writes_phi3_when_named(tmp_path, capsys):
    """A Phi-3 read in comes back as Llama unless --family phi3 asks for its fused layout; a family that
    cannot hold the model is refused by name."""
    hf = hf_random(hf_config("phi3"))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back"), "--family", "phi3"]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "phi3"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    ids = torch.randint(0, 101, (1, 40))
    with torch.no_grad():
        assert (back(ids).logits - hf(ids).logits).abs().max() <= 1e-5 * hf(ids).logits.abs().max()
    capsys.readouterr()
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "g"), "--family", "gemma2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gemma2" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- GGUF (llama.cpp itself: test_llamacpp_families.py)


GGUF = {  # case -> (transformers config over tiny(), the graph), each within what its graph hard-codes
    "qwen3": ("Qwen3Config", {}, "qwen3"),
    "olmo2": ("Olmo2Config", {}, "olmo2"),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4), "smollm3"),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=W, query_pre_attn_scalar=16,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True), "gemma2"),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=7, sliding_window=W, query_pre_attn_scalar=16), "gemma3"),
    "phi3": ("Phi3Config", {}, "llama"),
}


def _gguf_cfg(case: str, **changes) -> ModelConfig:
    kind, kw, _ = GGUF[case]
    return config_from_hf(getattr(transformers, kind)(**tiny(**kw)).to_dict()).replace(**changes)


@pytest.mark.parametrize("case", list(GGUF))
def test_gguf_graph_and_the_way_back(case, tmp_path):
    """Each family goes to its own llama.cpp graph, and --from-gguf gives the same weights back
    (Gemma's norms stored as 1 + w come back as w)."""
    from glassformer.checkpoint.folders import save_model
    from glassformer.convert.gguf import export_gguf, gguf_arch
    from glassformer.convert.gguf_read import read_gguf

    kind, kw, arch = GGUF[case]
    assert gguf_arch(_gguf_cfg(case)) == arch
    hf = hf_random(getattr(transformers, kind)(**tiny(**kw)))
    ours = ours_from_hf(hf, tmp_path)
    save_model(tmp_path / "ckpt", ours)
    export_gguf(tmp_path / "ckpt", tmp_path / "m.gguf", "f32", progress=False)
    cfg, state, _ = read_gguf(tmp_path / "m.gguf")
    want = {k: v for k, v in ours.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    assert cfg == ours.config and state.keys() == want.keys()
    assert all(torch.allclose(state[k], want[k], atol=1e-6, rtol=0) for k in want)


GGUF_REFUSED = {
    "gemma2 pattern": ("gemma2", dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                       "sliding layers [1, 2]"),
    "gemma2 no cap": ("gemma2", dict(attn_softcap=None), "always soft-caps"),
    "gemma2 untied": ("gemma2", dict(tie_embeddings=False), "tie_embeddings=False"),
    "gemma2 query scale": ("gemma2", dict(query_pre_attn_scalar=24.0), "query_pre_attn_scalar=24.0"),
    "gemma3 local base": ("gemma3", dict(rope_local_theta=500.0), "rope_local_theta=500.0"),
    "gemma3 soft cap": ("gemma3", dict(logit_softcap=30.0), "caps neither"),
    "smollm3 nope step": ("smollm3", dict(nope_layers=[1, 3]), "nope_layers=[1, 3]"),
    "qwen3 bias": ("qwen3", dict(attn_bias=True), "attn_bias=True"),
    "qwen3 window": ("qwen3", dict(sliding_window=W), f"sliding_window={W} below the context"),
}


@pytest.mark.parametrize("case", list(GGUF_REFUSED))
def test_gguf_refuses_what_the_graph_hard_codes_otherwise(case):
    from glassformer.convert.gguf import gguf_arch

    family, changes, message = GGUF_REFUSED[case]
    with pytest.raises(UserError) as e:
        gguf_arch(_gguf_cfg(family, **changes))
    assert message in str(e.value) and "llama.cpp" in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- cost presets

# preset -> (its Hugging Face config.json's fields that matter, the weights transformers counts)
PRESETS = {
    "qwen3-0.6b": (dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                        tie_word_embeddings=True), 596_049_920),
    "gemma3-270m": (dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, num_hidden_layers=18,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=2048,
                         max_position_embeddings=32768, query_pre_attn_scalar=256, sliding_window=512,
                         rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True), 268_098_176),
    "smollm3-3b": (dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, num_hidden_layers=36,
                        num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008,
                        max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6,
                        no_rope_layer_interval=4, tie_word_embeddings=True), 3_075_098_624),
    "olmo2-1b": (dict(model_type="olmo2", vocab_size=100352, hidden_size=2048, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, intermediate_size=8192,
                      max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False), 1_484_916_736),
    "phi3-mini": (dict(model_type="phi3", vocab_size=32064, hidden_size=3072, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
                       max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=2047,
                       tie_word_embeddings=False), 3_821_079_552),
    "gemma2-2b": (dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, intermediate_size=9216,
                       max_position_embeddings=8192, query_pre_attn_scalar=256, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True), 2_614_341_888),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_cost_preset_is_the_real_config_counted_exactly(name):
    """`cost --preset NAME` is what --from-hf makes of the model's config.json, and counts the weights
    transformers builds from it (on the meta device: no memory)."""
    from glassformer.cost.params import weights

    hf, count = PRESETS[name]
    cfg = ModelConfig.from_preset(name)
    assert cfg == config_from_hf(hf)
    assert weights(cfg)["total"] == count
    kind = family_for(cfg, hf["model_type"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**kind.config_to_hf(cfg)))
    assert sum(p.numel() for p in model.parameters()) == count
