"""LoRA adapters in PEFT's layout (convert/peft.py), checked against PEFT itself: an exported
folder that peft.PeftModel loads onto transformers gives our adapted logits, a folder PEFT
saved loads into glassformer with PEFT's logits, and what we cannot express is refused by name."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from glassformer.checkpoint.loading import load
from glassformer.convert.lora import LoraConfig, apply_lora, lora_modules
from glassformer.convert.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft, read_peft, save_peft
from glassformer.errors import UserError

from ..support import tiny_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

HF_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@torch.no_grad()
def randomize_adapters(model, seed: int = 1, std: float = 0.1):
    """Nonzero A and B (B starts at zero, which would make every adapter test pass trivially)."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * std)
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * std)
    return model


def ids(vocab: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def adapted():
    # Interleaved RoPE pairs: the export reorders q and k rows, so B's rows must follow them.
    model = tiny_model(rope_pairs="interleaved")
    apply_lora(model, LoraConfig(r=4, alpha=8.0))
    return randomize_adapters(model).eval()


@pytest.fixture(scope="module")
def exported(adapted, tmp_path_factory):
    return save_peft(adapted, tmp_path_factory.mktemp("peft") / "out")


def test_export_layout(exported, adapted):
    config = json.loads((exported / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["task_type"], config["base_model_name_or_path"]) == ("LORA", "CAUSAL_LM", "base")
    assert (config["r"], config["lora_alpha"], config["bias"]) == (4, 8.0, "none")
    assert sorted(config["target_modules"]) == HF_TARGETS
    from safetensors import safe_open

    with safe_open(str(exported / ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
    assert len(keys) == 2 * 7 * adapted.config.n_layers
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys
    assert torch.equal(a, adapted.blocks[1].attn.wq.lora_A)  # A acts on the input: copied as it is
    assert (exported / "base" / "config.json").is_file() and (exported / "base" / "model.safetensors").is_file()


def test_peft_loads_our_export_with_our_logits(exported, adapted):
    base = transformers.AutoModelForCausalLM.from_pretrained(exported / "base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(exported)).eval()
    x = ids(adapted.config.vocab_size)
    with torch.no_grad():
        ours, _ = adapted(x)
        theirs = hf(input_ids=x).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    with torch.no_grad(), hf.disable_adapter():  # the adapter matters: without it the logits move
        assert (hf(input_ids=x).logits - ours).abs().max() > 1e-2


FAMILY_SWITCHES = {
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(norm_placement="post_branch", qk_norm="proj"),
    "gemma3_text": dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True, qk_norm="head",
                        query_pre_attn_scalar=16.0, tie_embeddings=True, sliding_window=8, rope_local_theta=500.0,
                        layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", list(FAMILY_SWITCHES))
def test_peft_loads_a_newer_familys_export_with_our_logits(family, tmp_path):
    model = tiny_model(**FAMILY_SWITCHES[family])
    apply_lora(model, LoraConfig(r=4, alpha=8.0))
    randomize_adapters(model).eval()
    out = save_peft(model, tmp_path / "out")
    assert json.loads((out / "base" / "config.json").read_text())["model_type"] == family
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, str(out)).eval()
    x = ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, model(x)[0], atol=1e-5, rtol=0)


def test_our_export_imports_back(exported, adapted):
    model, _ = load_peft(exported, load)
    assert model.config.rope_pairs == "half"  # the base came back through the Hugging Face folder
    x = ids(adapted.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], adapted(x)[0], atol=1e-5, rtol=0)
    assert model.lora_config == LoraConfig(r=4, alpha=8.0)


@pytest.fixture(scope="module")
def peft_saved(tmp_path_factory):
    """A folder PEFT itself saved: LoRA on q_proj and v_proj of a tiny random transformers Llama,
    B drawn nonzero; the base saved beside it as base_model_name_or_path names it."""
    root = tmp_path_factory.mktemp("peft_native")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg).eval()
    base.save_pretrained(root / "llama", safe_serialization=True)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    model.peft_config["default"].base_model_name_or_path = "../llama"
    model.save_pretrained(root / "adapter")
    x = ids(96)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return root, x, logits


def test_a_folder_peft_saved_loads_with_its_logits(peft_saved):
    root, x, logits = peft_saved
    model, _ = load_peft(root / "adapter", load)
    assert model.lora_config.targets == ("wq", "wv") and model.lora_config.scale == 3.0
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], logits, atol=1e-5, rtol=0)


def test_base_override(peft_saved, tmp_path):
    root, _, _ = peft_saved
    moved = tmp_path / "moved"
    shutil.copytree(root / "adapter", moved)
    with pytest.raises(UserError, match="--base"):
        read_peft(moved)
    assert read_peft(moved, base=root / "llama").base == root / "llama"


def _bad_copy(root, tmp_path, **changes):
    folder = tmp_path / "bad"
    shutil.copytree(root / "adapter", folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config.update({"base_model_name_or_path": str(root / "llama"), **changes})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, named", [
    ({"use_dora": True}, "use_dora=true"),
    ({"use_rslora": True}, "use_rslora=true"),
    ({"bias": "all"}, 'bias="all"'),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ({"peft_type": "IA3"}, "IA3"),
    ({"task_type": "SEQ_CLS"}, "SEQ_CLS"),
])
def test_unsupported_options_are_named(peft_saved, tmp_path, changes, named):
    folder = _bad_copy(peft_saved[0], tmp_path, **changes)
    with pytest.raises(UserError, match=re.escape(named)):
        read_peft(folder)


def test_an_adapter_on_other_modules_is_refused(peft_saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _bad_copy(peft_saved[0], tmp_path)
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(2, 32)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    with pytest.raises(UserError, match="lm_head"):
        load_peft(folder, load)


def test_gpt2_is_refused_by_name(tmp_path):
    model = tiny_model(norm="layer", ffn="gelu_tanh", pos="learned", bias=True, n_kv_heads=4)
    apply_lora(model, LoraConfig(targets=("wq", "wv")))
    with pytest.raises(UserError, match="gpt2.*c_attn"):
        save_peft(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gpt2_base_is_refused_by_name(peft_saved, tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=96,
                                                                bos_token_id=0, eos_token_id=0))
    gpt2.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    folder = _bad_copy(peft_saved[0], tmp_path, base_model_name_or_path=str(tmp_path / "gpt2"))
    with pytest.raises(UserError, match="gpt2"):
        read_peft(folder)



# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory):
    """A base checkpoint (interleaved RoPE pairs, a tokenizer) and an adapter checkpoint on it with nonzero B."""
    from glassformer.checkpoint.adapters import save_adapter
    from glassformer.checkpoint.folders import save_model
    from glassformer.text.tokenizer import Tokenizer

    from ..support import make_prepared

    root = tmp_path_factory.mktemp("cli")
    tok = Tokenizer.from_file(make_prepared(root / "data", n_train=400, n_val=100) / "tokenizer.json")
    base = tiny_model(vocab_size=tok.vocab_size, rope_pairs="interleaved")
    save_model(root / "base", base, tok)
    model, _ = load(root / "base")
    apply_lora(model, LoraConfig(r=2, alpha=4.0, targets=("wq", "wk", "w_down")))
    randomize_adapters(model, seed=5)
    save_adapter(root / "adapter", model, root / "base", tok)
    return root, model.eval()


def test_convert_to_hf_peft(adapter_run):
    from glassformer.cli import main

    root, model = adapter_run
    out = root / "peft"
    assert main(["convert", "--to-hf", str(root / "adapter"), "--peft", "--out", str(out)]) == 0
    assert (out / "base" / "tokenizer.json").is_file()
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "k_proj", "q_proj"]
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(out / "base"), str(out))
    x = ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(input_ids=x).logits, model(x)[0], atol=1e-5, rtol=0)


def test_convert_refusals(adapter_run, tmp_path):
    from glassformer.cli import main

    root, _ = adapter_run
    # an adapter run without --peft, --peft on a plain checkpoint, --peft without --to-hf: nothing written
    for argv in (["--to-hf", str(root / "adapter")], ["--to-hf", str(root / "base"), "--peft"],
                 ["--quantize", "int8", "--checkpoint", str(root / "base"), "--peft"]):
        assert main(["convert", *argv, "--out", str(tmp_path / "x")]) == 2
        assert not (tmp_path / "x").exists()


def test_a_peft_folder_is_taken_where_an_adapter_run_is(adapter_run, capsys):
    """--checkpoint (generate: the same greedy text as the adapter run's) and --init-from (train
    goes on training the adapter; its checkpoints name the PEFT folder's base)."""
    from glassformer.checkpoint.folders import resolve
    from glassformer.cli import main

    root, _ = adapter_run
    peft_dir = root / "peft"  # test_convert_to_hf_peft's, written again when run alone
    if not peft_dir.exists():
        assert main(["convert", "--to-hf", str(root / "adapter"), "--peft", "--out", str(peft_dir)]) == 0
    texts = []
    for ckpt in (root / "adapter", peft_dir):
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "The king", "--greedy",
                     "--max-new-tokens", "8"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    run = root / "run"
    assert main(["train", "--data", str(root / "data"), "--out", str(run), "--init-from", str(peft_dir),
                 "--lora-r", "2", "--lora-alpha", "4", "--lora-targets", "wq,wk,w_down", "--max-steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--eval-tokens", "64",
                 "--no-progress", "--threads", "1"]) == 0
    meta = json.loads((resolve(run) / "config.json").read_text())
    assert meta["lora"]["r"] == 2 and (run / meta["lora"]["base"]["path"]).resolve() == (peft_dir / "base").resolve()
    model, _ = load(run)
    assert model.lora_config.targets == ("wq", "wk", "w_down")


def test_a_bad_peft_folder_writes_nothing(peft_saved, tmp_path, capsys):
    from glassformer.cli import main

    folder = _bad_copy(peft_saved[0], tmp_path, use_dora=True)
    assert main(["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "merged")]) == 2
    assert "use_dora" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_cost_of_a_peft_folder_is_its_bases(adapter_run, capsys):
    """cost --checkpoint PEFT_DIR prices the base model the folder adapts (not its adapter_config.json)."""
    from glassformer.cli import main

    root, _ = adapter_run
    peft_dir = root / "peft"
    if not peft_dir.exists():
        assert main(["convert", "--to-hf", str(root / "adapter"), "--peft", "--out", str(peft_dir)]) == 0
    reports = []
    for ckpt in (peft_dir, peft_dir / "base"):
        capsys.readouterr()
        assert main(["cost", "--checkpoint", str(ckpt), "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert reports[0] == reports[1] and reports[0]
