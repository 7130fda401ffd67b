"""`convert --to-gguf` / `--from-gguf` without llama.cpp: the round trip gives the source's logits
(f32 to 1e-6; f16/bf16 the source rounded; q8_0 within half a quantization step, against a
q8_0 written out here), the tensor types, the tokenizer metadata and its refusals, the model
refusals by name, nothing half-written, and the Ollama Modelfiles against golden files.
llama.cpp itself: test_llamacpp.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from glassformer.checkpoint.folders import save_model
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.config import ModelConfig
from glassformer.convert import gguf as G
from glassformer.convert.modelfile import chat_style, modelfile
from glassformer.errors import UserError
from glassformer.text.chat_template import CHATML_TEMPLATE
from glassformer.text.tokenizer import Tokenizer

from ..support import TESTS, synthetic_text, tiny_model
from .gguf_fixtures import LLAMA3_CHAT, QWEN2_CHAT, gpt2_tokenizer, llama3_tokenizer, qwen2_tokenizer

gguf = pytest.importorskip("gguf")
GOLDEN = TESTS / "golden"
MISTRAL_CHAT = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + "
    "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GPT2_SHAPE = dict(norm="layer", ffn="gelu_tanh", pos="learned", bias=True, n_kv_heads=4, tie_embeddings=True)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _checkpoint(root: Path, name: str, tok, dtype=torch.float32, **overrides) -> tuple[torch.nn.Module, Path]:
    model = tiny_model(vocab_size=tok.vocab_size, **overrides).to(dtype)
    return model, save_model(root / name, model, tok)


def _to_gguf(src, out, *flags) -> Path:
    assert main(["convert", "--to-gguf", str(src), "--out", str(out), *flags]) == 0
    return Path(out)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0].float()


# ----------------------------------------------------------------------------- the round trip


ROUND_TRIPS = {
    "llama": {}, "interleaved": {"rope_pairs": "interleaved"}, "tied": {"tie_embeddings": True},
    "qwen2": {"qkv_bias": True}, "gpt2": GPT2_SHAPE, "head_dim": {"head_dim": 32},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}},
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_f32_round_trip_gives_the_source_logits(name, root, tok):
    model, ckpt = _checkpoint(root, f"rt-{name}", tok, **ROUND_TRIPS[name])
    path = _to_gguf(ckpt, root / f"rt-{name}.gguf", "--dtype", "f32")
    assert main(["convert", "--from-gguf", str(path), "--out", str(root / f"rt-{name}-back")]) == 0
    back, tok_back = load(root / f"rt-{name}-back")
    assert back.config == model.config
    ids = tok.encode(synthetic_text(4, 5))
    want = _logits(model, ids)
    assert (_logits(back, ids) - want).abs().max() <= 1e-6 * want.abs().max()
    assert (root / f"rt-{name}-back" / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()


def _q8_0_reference(w: torch.Tensor) -> torch.Tensor:
    """q8_0 written out: per block of 32 along a row, d = max|x| / 127 stored in fp16, q = round(x / d)."""
    blocks = w.double().reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / d, torch.zeros_like(blocks))
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # halves away from zero
    return (q * d.half().double()).reshape(w.shape)


def test_q8_0_f16_bf16_round_trips(root, tok):
    model, ckpt = _checkpoint(root, "types", tok)
    state = model.state_dict()
    for dtype in ("f16", "bf16", "q8_0"):
        path = _to_gguf(ckpt, root / f"types-{dtype}.gguf", "--dtype", dtype)
        assert main(["convert", "--from-gguf", str(path), "--out", str(root / f"types-{dtype}-back")]) == 0
        back = load(root / f"types-{dtype}-back", dtype=None)[0].state_dict()
        for key in ("blocks.0.attn.wv.weight", "blocks.1.ffn.w_up.weight"):
            want = {"f16": lambda w: w.half(), "bf16": lambda w: w.bfloat16(), "q8_0": _q8_0_reference}[dtype](state[key])
            assert torch.allclose(back[key].double(), want.double(), rtol=0, atol=1e-6), (dtype, key)


def test_tensor_types(root, tok):
    """q8_0: 1-D tensors stay f32, a matrix whose rows are not a multiple of 32 long becomes f16."""
    Q = gguf.GGMLQuantizationType
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(root / "types-q8_0.gguf").tensors}
    assert types["blk.0.attn_norm.weight"] == Q.F32
    assert types["blk.0.attn_q.weight"] == Q.Q8_0
    assert types["blk.0.ffn_down.weight"] == Q.F16  # its rows are ffn_dim = 176 long
    assert types["token_embd.weight"] == Q.Q8_0
    bf16 = {t.name: t.tensor_type for t in gguf.GGUFReader(root / "types-bf16.gguf").tensors}
    assert bf16["blk.0.attn_q.weight"] == Q.BF16 and bf16["blk.0.ffn_norm.weight"] == Q.F32


def test_default_dtype_is_the_stored_one(root, tok):
    _, ckpt = _checkpoint(root, "half", tok, dtype=torch.float16)
    path = _to_gguf(ckpt, root / "half.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    assert {t.name: t.tensor_type for t in reader.tensors}["blk.0.attn_k.weight"] == gguf.GGMLQuantizationType.F16


def test_int8_checkpoint_is_dequantized(root, tok, capsys):
    from glassformer.convert.quantize import quantize

    model, _ = _checkpoint(root, "float", tok)
    q = quantize(tiny_model(vocab_size=tok.vocab_size), "int8")
    save_model(root / "int8", q, tok)
    path = _to_gguf(root / "int8", root / "int8.gguf", "--dtype", "f32")
    assert "dequantized" in capsys.readouterr().out
    assert main(["convert", "--from-gguf", str(path), "--out", str(root / "int8-back")]) == 0
    back = load(root / "int8-back")[0]
    want = q.blocks[0].attn.wq.dequantized()
    assert torch.equal(back.blocks[0].attn.wq.weight, want)


def test_llama_pairs_are_adjacent_in_the_file(root, tok):
    """llama.cpp's llama graph turns (2i, 2i+1): row 1 of a head in the file is our row H/2."""
    model, _ = _checkpoint(root, "rt-pairs", tok)
    path = _to_gguf(root / "rt-pairs", root / "rt-pairs.gguf", "--dtype", "f32")
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    rows = np.array(t.data)
    wq = model.blocks[0].attn.wq.weight.detach().numpy()
    H = model.config.head_dim
    for i in range(H // 2):
        assert np.array_equal(rows[2 * i], wq[i]) and np.array_equal(rows[2 * i + 1], wq[i + H // 2])


def test_rope_freqs_are_llama_cpps_factors():
    """As llama.cpp's converter computes them for Llama 3.1, written out independently."""
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    cfg = ModelConfig(dim=64, n_heads=2, rope_theta=500000.0, rope_scaling=sc)
    H = cfg.head_dim
    want = []
    for i in range(0, H, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / H)
        if wavelen < 64 / 4.0:
            want.append(1.0)
        elif wavelen > 64 / 1.0:
            want.append(8.0)
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / 8.0 + smooth))
    assert torch.allclose(G.rope_freqs(cfg).double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5)


# ----------------------------------------------------------------------------- tokenizer metadata


def _fields(path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_trained_tokenizer_metadata(root, tok):
    path = root / "rt-llama.gguf"
    f = _fields(path)
    spec = json.loads((root / "rt-llama" / "tokenizer.json").read_text())
    assert (f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert f["tokenizer.ggml.tokens"] == [tok.tk.id_to_token(i) for i in range(tok.vocab_size)]
    assert f["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    assert f["tokenizer.ggml.token_type"][tok.eot_id] == 3 and f["tokenizer.ggml.token_type"][100] == 1
    assert f["tokenizer.ggml.add_bos_token"] is False or f["tokenizer.ggml.add_bos_token"] == 0
    assert f["tokenizer.huggingface.json"] == (root / "rt-llama" / "tokenizer.json").read_text()
    assert f["general.name"] == "rt-llama" and f["general.architecture"] == "llama"


@pytest.mark.parametrize("family,pre,add_bos", [("llama", "llama-bpe", True), ("qwen2", "qwen2", False), ("gpt2", "gpt-2", False)])
def test_imported_tokenizers_by_family(family, pre, add_bos):
    from glassformer.convert.gguf_tokenizer import tokenizer_fields

    text, config = {"llama": llama3_tokenizer, "qwen2": qwen2_tokenizer, "gpt2": gpt2_tokenizer}[family]()
    t = Tokenizer.from_str(text)
    t.chat_templates = {"default": config["chat_template"]} if "chat_template" in config else {}
    t.select_template()
    t.special_tokens = {k: v for k, v in config.items() if k.endswith("_token")}
    f = tokenizer_fields(t, text, t.vocab_size + 3)  # an embedding padded past the tokenizer
    assert f["tokenizer.ggml.pre"] == pre and f["tokenizer.ggml.add_bos_token"] is add_bos
    assert f["tokenizer.ggml.tokens"][-1] == f"[PAD{t.vocab_size + 2}]" and f["tokenizer.ggml.token_type"][-1] == 5
    assert f["tokenizer.ggml.eos_token_id"] == t.tk.token_to_id(config["eos_token"])
    assert f.get("tokenizer.chat_template") == config.get("chat_template")


def test_smollm_and_sentencepiece_layouts():
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, normalizers

    from glassformer.convert.gguf_tokenizer import bpe_pre_name, tokenizer_fields

    smol = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}, "model": {}}
    assert bpe_pre_name(smol) == "smollm"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "\u2581": 259, "a": 260, "b": 261, "\u2581a": 262, "\u2581ab": 263}
    hf = HF(models.BPE(vocab, [("\u2581", "a"), ("\u2581a", "b")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    t = Tokenizer(hf)
    f = tokenizer_fields(t, hf.to_str(), len(vocab))
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.add_space_prefix"] is True
    assert f["tokenizer.ggml.scores"][263] > f["tokenizer.ggml.scores"][0] and f["tokenizer.ggml.scores"][262] > f["tokenizer.ggml.scores"][263]
    assert f["tokenizer.ggml.token_type"][3 + 65] == 6 and f["tokenizer.ggml.token_type"][0] == 2


def test_unknown_pre_tokenizer_is_refused_by_name(root, tok):
    from tokenizers import pre_tokenizers

    tok2 = Tokenizer.from_str(tok.to_str())
    tok2.tk.pre_tokenizer = pre_tokenizers.Whitespace()
    model = tiny_model(vocab_size=tok.vocab_size)
    save_model(root / "ws", model, tok2)
    with pytest.raises(UserError, match="Whitespace.*none that llama.cpp implements"):
        G.export_gguf(root / "ws", root / "ws.gguf", progress=False)
    assert not (root / "ws.gguf").exists()


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides,message", [
    ({"norm_placement": "post"}, "post-norm"),
    ({"norm": "layer"}, "LayerNorm"),
    ({"ffn": "relu"}, "RELU feed-forward"),
    ({"ffn": "gelu", "ffn_dim": 256}, "GELU feed-forward"),
    ({"pos": "learned"}, "learned positions"),
    ({"bias": True}, "biases outside q/k/v"),
    ({"sliding_window": 64}, "sliding_window=64 is below the context"),
    ({**GPT2_SHAPE, "ffn": "gelu", "ffn_dim": 256}, "gpt2 needs 'gelu_tanh'"),
])
def test_refused_by_name(overrides, message):
    with pytest.raises(UserError, match=message):
        G.gguf_arch(ModelConfig.from_preset("tiny", **overrides))


def test_a_later_config_switch_is_refused_by_name():
    @dataclasses.dataclass
    class Later(ModelConfig):
        new_switch: int = 0

    assert G.gguf_arch(Later.from_dict({**ModelConfig.from_preset("tiny").to_dict()})) == "llama"
    with pytest.raises(UserError, match="new_switch=1"):
        G.gguf_arch(Later(**{**ModelConfig.from_preset("tiny").to_dict(), "new_switch": 1}))


def test_lora_adapter_is_merged_first(root, tok, capsys):
    """An adapter checkpoint exports as its base with the adapter folded in: the adapted model's logits."""
    from glassformer.checkpoint.adapters import save_adapter
    from glassformer.convert.lora import LoraConfig, apply_lora, lora_modules

    base, base_ckpt = _checkpoint(root, "lora-base", tok)
    adapted = apply_lora(tiny_model(vocab_size=tok.vocab_size), LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():
        for m in lora_modules(adapted).values():  # B starts at zero: give the adapter something to add
            m.lora_B.normal_(0, 0.1)
    save_adapter(root / "lora", adapted, base_ckpt, tok)
    path = _to_gguf(root / "lora", root / "lora.gguf", "--dtype", "f32")
    assert "merged into its base" in capsys.readouterr().out
    assert main(["convert", "--from-gguf", str(path), "--out", str(root / "lora-back")]) == 0
    ids = tok.encode(synthetic_text(3, 7))
    want = _logits(adapted.eval(), ids)
    assert (_logits(load(root / "lora-back")[0], ids) - want).abs().max() <= 1e-5 * want.abs().max()
    assert (_logits(base, ids) - want).abs().max() > 1e-2 * want.abs().max()  # the adapter did change it


def test_user_errors(root, tok, capsys):
    _, ckpt = _checkpoint(root, "errs", tok)
    (root / "taken.gguf").write_text("x")
    assert main(["convert", "--to-gguf", str(ckpt), "--out", str(root / "taken.gguf")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["convert", "--to-gguf", str(ckpt), "--out", str(root / "model.bin")]) == 2
    assert main(["convert", "--from-gguf", str(root / "taken.gguf"), "--out", str(root / "x")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(ckpt), "--out", str(root / "y"), "--dtype", "q8_0"]) == 2
    assert not (root / "x").exists() and not (root / "y").exists()
    with pytest.raises(SystemExit):
        main(["convert", "--to-gguf", str(ckpt), "--out", str(root / "q4.gguf"), "--dtype", "q4_0"])


def test_nothing_half_written(root, tok, monkeypatch):
    _, ckpt = _checkpoint(root, "half-written", tok)
    calls = []

    def failing(t, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("disk full")
        return real(t, qtype)

    real = G.encode_tensor
    monkeypatch.setattr(G, "encode_tensor", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        main(["convert", "--to-gguf", str(ckpt), "--out", str(root / "hw" / "m.gguf")])
    assert list((root / "hw").iterdir()) == []


# ----------------------------------------------------------------------------- Ollama


@pytest.mark.parametrize("style,template", [
    ("glassformer", CHATML_TEMPLATE), ("chatml", QWEN2_CHAT), ("llama3", LLAMA3_CHAT), ("mistral", MISTRAL_CHAT),
    ("none", None), ("other", "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"),
])
def test_modelfiles_equal_their_golden_files(style, template):
    eos = {"llama3": ["<|eot_id|>"], "mistral": ["</s>"]}.get(style, ["<|im_end|>", "<|endoftext|>"])
    text, note = modelfile("model.gguf", 256, template, eos)
    assert chat_style(template) == (None if style in ("none", "other") else style)
    assert (note is not None) == (style == "other")
    assert text == (GOLDEN / f"gguf_{style}.Modelfile").read_text()


def test_modelfile_beside_the_gguf(root, tok):
    tok2 = Tokenizer.from_str(tok.to_str())
    tok2.add_chat_tokens()
    tok2.chat_templates = {"default": CHATML_TEMPLATE}
    tok2.select_template()
    model = tiny_model(vocab_size=tok2.vocab_size)
    save_model(root / "chat", model, tok2)
    _to_gguf(root / "chat", root / "chat.gguf")
    text = (root / "chat.Modelfile").read_text()
    assert text.startswith("FROM ./chat.gguf\nTEMPLATE") and 'PARAMETER stop "<|im_end|>"' in text
    assert "PARAMETER num_ctx 128" in text
    assert _fields(root / "chat.gguf")["tokenizer.chat_template"] == CHATML_TEMPLATE


@pytest.mark.parametrize("name", ["llama", "tied", "qwen2", "gpt2", "head_dim"])
def test_files_without_our_config_key_read_from_llama_cpps_keys(name, root, tok, monkeypatch):
    """A GGUF file another tool wrote has no glassformer.config: the config comes from llama.cpp's keys."""
    model, ckpt = _checkpoint(root, f"keys-{name}", tok, **ROUND_TRIPS[name])
    monkeypatch.setattr(G, "CONFIG_KEY", "elsewhere.config")  # as if another tool had written the file
    path = _to_gguf(ckpt, root / f"keys-{name}.gguf", "--dtype", "f32")
    monkeypatch.undo()
    assert "glassformer.config" not in _fields(path)
    assert main(["convert", "--from-gguf", str(path), "--out", str(root / f"keys-{name}-back")]) == 0
    back = load(root / f"keys-{name}-back")[0]
    assert back.config.replace(init_std=model.config.init_std) == model.config
    ids = tok.encode(synthetic_text(4, 5))
    want = _logits(model, ids)
    assert (_logits(back, ids) - want).abs().max() <= 1e-6 * want.abs().max()
