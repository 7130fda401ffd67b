"""Hugging Face folders in and out, checked against transformers on the same weights.

Every model here is a tiny random one built with transformers in a temporary folder
(no network), re-initialised with std 0.15 so that logits are large enough for a real bug
to show above the tolerance.
"""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from glassformer import Transformer  # noqa: E402
from glassformer.checkpoint.folders import save_model  # noqa: E402
from glassformer.checkpoint.loading import load  # noqa: E402
from glassformer.cli import main  # noqa: E402

from ..support import greedy_cached, reinit, tiny_model  # noqa: E402

V = 101
# No end-of-text id: generate() would stop at it (or, with min_new_tokens, ban it) and so differ from plain greedy.
NO_EOS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA_LIKE = dict(vocab_size=V, hidden_size=64, intermediate_size=112, num_hidden_layers=2, max_position_embeddings=96, **NO_EOS)

# One tiny model per family and variant the importer must handle.
HF_CASES = {
    "llama2-mha": ("LlamaConfig", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5)),
    "llama3.1-scaling": ("LlamaConfig", dict(
        LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32})),
    "llama-linear-scaling": ("LlamaConfig", dict(
        LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "smollm-tied-gqa": ("LlamaConfig", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "tinyllama-mqa": ("LlamaConfig", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=1)),
    "llama-wide-heads": ("LlamaConfig", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "mistral-window": ("MistralConfig", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)),
    "qwen2-tied": ("Qwen2Config", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-window": ("Qwen2Config", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2,
                                         use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    "qwen2-mixed-window": ("Qwen2Config", dict(LLAMA_LIKE, num_attention_heads=4, num_key_value_heads=2,
                                               use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=96, **NO_EOS)),
}
_ARCH = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
         "Qwen2Config": "Qwen2ForCausalLM", "GPT2Config": "GPT2LMHeadModel"}


def hf_model(case: str, seed: int = 0):
    kind, kw = HF_CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, _ARCH[kind])(getattr(transformers, kind)(**kw))
    return reinit(model, std=0.15, seed=seed).eval()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case saved by transformers and converted by the CLI once: case -> (hf model, hf dir, our dir)."""
    root = tmp_path_factory.mktemp("hf")
    cache = {}

    def get(case):
        if case not in cache:
            hf = hf_model(case)
            src, dst = root / f"{case}-hf", root / f"{case}-ours"
            hf.save_pretrained(src)
            assert main(["convert", "--from-hf", str(src), "--out", str(dst)]) == 0
            cache[case] = hf, src, dst
        return cache[case]

    return get


def assert_close_logits(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert ref.abs().max() > 0.1  # large enough that a real bug cannot hide under the tolerance
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def our_logits(model, ids):
    with torch.no_grad():
        return model(ids)[0]


# ----------------------------------------------------------------------------- Hugging Face -> ours


@pytest.mark.parametrize("case", list(HF_CASES))
def test_from_hf_logits_and_greedy_match(case, converted):
    hf, _, dst = converted(case)
    ours, _ = load(dst)
    ids = torch.randint(0, V, (2, 48))  # longer than the sliding windows (8), so they matter
    assert_close_logits(hf_logits(hf, ids), our_logits(ours, ids))
    prompt = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, 8:]
    assert len(ref) == 20 and greedy_cached(ours, prompt, 20) == ref.tolist()


def test_sliding_window_is_imported(converted):
    """The window is really on: the same weights without it give other logits."""
    _, _, dst = converted("mistral-window")
    ours, _ = load(dst)
    assert ours.config.sliding_window == 8
    ids = torch.randint(0, V, (1, 48))
    windowed = our_logits(ours, ids)
    unwindowed = Transformer(ours.config.replace(sliding_window=None)).eval()  # each layer takes its window when built
    unwindowed.load_state_dict(ours.state_dict())
    assert (our_logits(unwindowed, ids) - windowed).abs().max() > 1e-2


def test_hf_folder_loads_directly_wherever_a_checkpoint_is_accepted(converted):
    hf, src, _ = converted("qwen2-tied")
    model, tok = load(src)  # what `generate --checkpoint HF_DIR` calls
    assert tok is None and model.config.qkv_bias and model.config.tie_embeddings
    assert model.lm_head.weight is model.embed.weight
    ids = torch.randint(0, V, (1, 32))
    assert_close_logits(hf_logits(hf, ids), our_logits(model, ids))


def test_sharded_input_converts_identically(converted, tmp_path):
    hf, _, dst = converted("llama2-mha")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert main(["convert", "--from-hf", str(tmp_path / "sharded"), "--out", str(tmp_path / "out")]) == 0
    a, b = load_file(str(dst / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_half_precision_weights_keep_or_change_dtype(stored, converted, tmp_path):
    hf, _, _ = converted("smollm-tied-gqa")
    hf_half = hf_model("smollm-tied-gqa").to(stored)
    hf_half.save_pretrained(tmp_path / "hf")
    ref = hf_half.state_dict()
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "keep")]) == 0
    kept = load_file(str(tmp_path / "keep" / "model.safetensors"))
    assert {t.dtype for t in kept.values()} == {stored}
    assert torch.equal(kept["blocks.1.ffn.w_gate.weight"], ref["model.layers.1.mlp.gate_proj.weight"])
    model, _ = load(tmp_path / "hf", dtype=None)  # a Hugging Face folder loads in its stored dtype
    assert model.embed.weight.dtype == stored
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    f32, _ = load(tmp_path / "f32")
    assert f32.embed.weight.dtype == torch.float32
    assert torch.equal(f32.blocks[0].attn.wk.weight, ref["model.layers.0.self_attn.k_proj.weight"].float())


def test_tokenizer_json_is_carried_along_every_way(tmp_path):
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.train(["to be or not to be, that is the question"] * 20, vocab_size=300)
    save_model(tmp_path / "ours", tiny_model(), tok)
    original = (tmp_path / "ours" / "tokenizer.json").read_bytes()
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == original
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eot_id is not None and cfg["bos_token_id"] is None
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert main(["convert", "--kv-heads", "1", "--checkpoint", str(tmp_path / "back"), "--out", str(tmp_path / "mqa")]) == 0
    for folder in ("hf", "back", "mqa"):
        assert (tmp_path / folder / "tokenizer.json").read_bytes() == original
        _, loaded = load(tmp_path / folder)
        assert loaded.eot_id == tok.eot_id and loaded.encode("to be or not") == tok.encode("to be or not")


def test_gpt2_hub_layout_without_prefix_and_with_mask_buffers(converted, tmp_path):
    """The hub's gpt2 was saved from the base model: no 'transformer.' prefix, causal-mask buffers kept."""
    _, src, dst = converted("gpt2")
    folder = tmp_path / "hub"
    shutil.copytree(src, folder)
    sd = load_file(str(folder / "model.safetensors"))
    hub = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for i in range(2):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 96, 96))
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(hub, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ours")]) == 0
    a, b = load_file(str(dst / "model.safetensors")), load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_pickled_bin_refused_unless_allowed(converted, tmp_path, capsys):
    hf, src, _ = converted("tinyllama-mqa")
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(src / "config.json", folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and "--allow-pickle" in err and not (tmp_path / "a").exists()
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "b"), "--allow-pickle"]) == 0
    ours, _ = load(tmp_path / "b")
    ids = torch.randint(0, V, (1, 24))
    assert_close_logits(hf_logits(hf, ids), our_logits(ours, ids))


# ----------------------------------------------------------------------------- ours -> Hugging Face

GPT2_LIKE = dict(norm="layer", ffn="gelu_tanh", pos="learned", bias=True, n_kv_heads=4)
OUR_CASES = {
    "llama": ({}, "llama"),
    "llama-tied-scaled": (dict(tie_embeddings=True, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}), "llama"),
    "llama-interleaved-rope": (dict(rope_pairs="interleaved"), "llama"),
    "llama-linear-old-spelling": (dict(rope_scaling={"type": "linear", "factor": 4.0}), "llama"),  # Q/K rows permuted on the way out
    "mistral": (dict(sliding_window=8), "mistral"),
    "qwen2": (dict(qkv_bias=True, tie_embeddings=True), "qwen2"),
    "qwen2-window": (dict(qkv_bias=True, sliding_window=8), "qwen2"),
    "gpt2-tied": (dict(GPT2_LIKE, tie_embeddings=True), "gpt2"),
    "gpt2-untied-gelu": (dict(GPT2_LIKE, ffn="gelu"), "gpt2"),
}


@pytest.mark.parametrize("case", list(OUR_CASES))
def test_round_trip_through_transformers(case, tmp_path, capfd):
    overrides, family = OUR_CASES[case]
    ours = tiny_model(**overrides)
    save_model(tmp_path / "ours", ours)
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == family
    capfd.readouterr()
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert "MISSING" not in capfd.readouterr().err
    ids = torch.randint(0, 512, (2, 40))
    ref = our_logits(ours, ids)
    assert_close_logits(ref, hf_logits(hf.eval(), ids))
    # And back again: the same weights, bit for bit (our default RoPE layout needs no permutation).
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back, _ = load(tmp_path / "back")
    assert_close_logits(ref, our_logits(back, ids))
    if ours.config.rope_pairs == "half":
        a, b = ours.state_dict(), back.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_to_hf_dtype(tmp_path):
    ours = tiny_model(qkv_bias=True)
    save_model(tmp_path / "ours", ours)
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.bias"], ours.blocks[0].attn.wq.bias.detach().bfloat16())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    # Without --dtype the stored dtype is kept, both ways and through --kv-heads.
    save_model(tmp_path / "half", ours.to(torch.float16))
    assert main(["convert", "--to-hf", str(tmp_path / "half"), "--out", str(tmp_path / "hf16")]) == 0
    assert {t.dtype for t in load_file(str(tmp_path / "hf16" / "model.safetensors")).values()} == {torch.float16}
    assert main(["convert", "--kv-heads", "1", "--checkpoint", str(tmp_path / "half"), "--out", str(tmp_path / "mqa")]) == 0
    assert {t.dtype for t in load_file(str(tmp_path / "mqa" / "model.safetensors")).values()} == {torch.float16}


@pytest.mark.parametrize("overrides, named", [
    (dict(norm_placement="post"), "norm_placement='post'"),
    (dict(ffn="relu"), "ffn='relu'"),
    (dict(pos="none"), "pos='none'"),
    (dict(GPT2_LIKE, n_kv_heads=2), "n_kv_heads=2"),
])
def test_to_hf_refuses_what_no_family_holds(overrides, named, tmp_path, capsys):
    save_model(tmp_path / "ours", tiny_model(**overrides))
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and named in err and not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- --kv-heads


def test_kv_heads_identity_and_pooling_by_hand(tmp_path):
    mha = tiny_model(n_kv_heads=4)
    save_model(tmp_path / "mha", mha)
    assert main(["convert", "--kv-heads", "4", "--checkpoint", str(tmp_path / "mha"), "--out", str(tmp_path / "same")]) == 0
    same, _ = load(tmp_path / "same")
    a, b = mha.state_dict(), same.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert main(["convert", "--kv-heads", "2", "--checkpoint", str(tmp_path / "mha"), "--out", str(tmp_path / "gqa")]) == 0
    gqa, _ = load(tmp_path / "gqa")
    assert gqa.config.n_kv_heads == 2
    H = mha.config.head_dim
    for old, new in zip(mha.blocks, gqa.blocks):
        for name in ("wk", "wv"):
            w = getattr(old.attn, name).weight.detach()
            rows = [(w[(2 * g) * H:(2 * g + 1) * H] + w[(2 * g + 1) * H:(2 * g + 2) * H]) / 2 for g in range(2)]
            assert torch.allclose(getattr(new.attn, name).weight, torch.cat(rows), atol=1e-7, rtol=0)
        assert torch.equal(old.attn.wq.weight, new.attn.wq.weight)
    ids = torch.randint(0, 512, (1, 16))
    assert our_logits(gqa, ids).shape == (1, 16, 512)


# ----------------------------------------------------------------------------- bad input


def _edit(folder, fn):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def _edit_weights(folder, fn):
    sd = load_file(str(folder / "model.safetensors"))
    fn(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _rope_yarn(c):
    c["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    c.pop("rope_scaling", None)


def _broken_index(folder):
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    sd.pop("model.norm.weight")
    save_file(sd, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in sd}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


BAD = {
    "no config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "unknown model_type": (lambda f: _edit(f, lambda c: c.update(model_type="bert")), "'bert' is not supported"),
    "missing key": (lambda f: _edit_weights(f, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
                    "missing weights model.layers.1.mlp.up_proj.weight"),
    "unexpected key": (lambda f: _edit_weights(f, lambda sd: sd.update({"model.layers.0.extra.weight": torch.zeros(3)})),
                       "unexpected weights model.layers.0.extra.weight"),
    "wrong shape": (lambda f: _edit(f, lambda c: c.update(intermediate_size=96)),
                    "model.safetensors: model.layers.0.mlp.gate_proj.weight has shape [112, 64], but config.json implies [96, 64]"),
    "too few layers": (lambda f: _edit(f, lambda c: c.update(num_hidden_layers=1)), "unexpected weights model.layers.1."),
    "rope yarn": (lambda f: _edit(f, _rope_yarn), "RoPE scaling 'yarn'"),
    "llama attention_bias": (lambda f: _edit(f, lambda c: c.update(attention_bias=True)), "attention_bias"),
    "missing shard": (_broken_index, "names model-00002-of-00002.safetensors, which is not in"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "holds no weights"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_clear_error(case, converted, tmp_path, capsys):
    break_it, message = BAD[case]
    _, src, _ = converted("tinyllama-mqa")
    folder = tmp_path / "hf"
    shutil.copytree(src, folder)
    break_it(folder)
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_qwen2_sliding_on_some_layers_converts_both_ways(converted, tmp_path):
    """max_window_layers between 0 and the layers: the first layers full, the rest sliding (layer_types),
    with transformers' logits on ids longer than the window, and written back the same way."""
    hf, _, dst = converted("qwen2-mixed-window")
    ours, _ = load(dst)
    assert ours.config.layer_types == ["full_attention", "sliding_attention"] and ours.config.sliding_window == 8
    ids = torch.randint(0, V, (1, 48))
    assert_close_logits(hf_logits(hf, ids), our_logits(ours, ids))
    assert main(["convert", "--to-hf", str(dst), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert back.config.layer_types == ["full_attention", "sliding_attention"]
    assert_close_logits(hf_logits(hf, ids), hf_logits(back, ids))


def test_cli_argument_errors(converted, tmp_path, capsys):
    _, src, dst = converted("gpt2")
    assert main(["convert", "--from-hf", str(src), "--out", str(dst)]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "--kv-heads", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["convert", "--kv-heads", "3", "--checkpoint", str(dst), "--out", str(tmp_path / "x")]) == 2
    assert "divisor" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: two modes at once
        main(["convert", "--from-hf", str(src), "--to-hf", str(dst), "--out", str(tmp_path / "x")])


def test_tied_head_stored_anyway_must_equal_the_embedding(converted, tmp_path, capsys):
    _, src, dst = converted("qwen2-tied")
    for name, head in (("same", None), ("differs", torch.zeros(V, 64))):
        folder = tmp_path / name
        shutil.copytree(src, folder)
        _edit_weights(folder, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone() if head is None else head}))
        rc = main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / f"{name}-out")])
        if head is None:
            assert rc == 0
            a, b = load_file(str(dst / "model.safetensors")), load_file(str(tmp_path / "same-out" / "model.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        else:
            assert rc == 2 and "lm_head.weight differs" in capsys.readouterr().err


def test_config_of_either_transformers_era_reads_the_same(converted, tmp_path):
    """transformers >= 5 writes rope_parameters; < 5 wrote rope_theta and rope_scaling."""
    from glassformer.convert import config_from_hf

    _, src, _ = converted("llama3.1-scaling")
    new = json.loads((src / "config.json").read_text())
    old = dict(new)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    a, b = config_from_hf(new), config_from_hf(old)
    assert a == b and a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    plain = dict(old, rope_scaling={"rope_type": "default"})
    assert config_from_hf(plain).rope_scaling is None


# ----------------------------------------------------------------------------- the one key map


def test_llama_key_map_is_the_families_rules():
    """keymap.LLAMA_KEYS and llama_state_from_hf are read off families.py's rules: no second map."""
    from glassformer.convert.families import LLAMA
    from glassformer.convert.keymap import LLAMA_KEYS

    assert LLAMA_KEYS["blocks.{i}.attn.wq.weight"] == "model.layers.{i}.self_attn.q_proj.weight"
    assert LLAMA_KEYS["blocks.{i}.attn.wk.bias"] == "model.layers.{i}.self_attn.k_proj.bias"
    assert LLAMA_KEYS["lm_head.weight"] == "lm_head.weight"
    cfg = tiny_model(qkv_bias=True).config
    assert {r.hf for r in LLAMA.rules(cfg)} == {
        hf.replace("{i}", str(i)) for i in range(cfg.n_layers) for hf in LLAMA_KEYS.values()} | {
        hf for hf in LLAMA_KEYS.values() if "{i}" not in hf}
    from ..support import REPO

    spelled = [p.name for p in (REPO / "src" / "glassformer" / "convert").glob("*.py") if "q_proj" in p.read_text()]
    assert spelled == ["families.py"], f"Hugging Face Llama names spelled outside families.py: {spelled}"


@pytest.mark.parametrize("pairs", ["half", "interleaved"])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_state_from_hf_inverts_export(pairs, tied):
    """A state dict exported by the Llama rules comes back exactly, RoPE rows permuted when interleaved."""
    from glassformer.checkpoint.builder import model_state
    from glassformer.convert.families import LLAMA
    from glassformer.convert.hf import hf_state_from_model
    from glassformer.convert.keymap import llama_state_from_hf

    model = tiny_model(rope_pairs=pairs, tie_embeddings=tied)
    hf_state = hf_state_from_model(model, LLAMA)
    if tied:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]  # transformers' state_dict keeps both
    hf_state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # a recomputed buffer: ignored
    ours, want = llama_state_from_hf(hf_state, model.config), model_state(model)
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
    q = hf_state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(ours["blocks.0.attn.wq.weight"], q) == (pairs == "half")
    with pytest.raises(ValueError, match="unexpected keys.*model.extra"):
        llama_state_from_hf({**hf_state, "model.extra": torch.ones(1)}, model.config)
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        llama_state_from_hf({k: v for k, v in hf_state.items() if k != "model.norm.weight"}, model.config)
