"""llama.cpp itself (through llama-cpp-python) steered by what `convert --control-vector` writes gives
the same greedy tokens as our steered model, and last-position logits within 1e-3 of max |logit|
(f32 model, f32 KV cache), on a llama-, a qwen2- and a gpt2-graph model of 4 blocks. The control-vector
file is read as llama.cpp's common loader reads it (libllama has no file loader; the loader's rule,
direction.{il} at (il - 1)·n_embd, is in convert/control_vector.read_control_vector) and handed to
llama_set_adapter_cvec over every layer. Skipped unless llama_cpp imports (`make test-llamacpp`)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.convert.control_vector import read_control_vector
from glassformer.research.steering import contrastive, load_vector, save_vector, steer

from ..support import greedy_cached, reinit

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

TEXT = ("The king and queen walk to the castle where the bells ring. A storm came over the hills and the "
        "rain fell hard. The sun rose warm and bright over the fields. ") * 20
PROMPT = "The king and queen walk to the castle where"
SHAPES = {"llama": {}, "qwen2": dict(qkv_bias=True),
          "gpt2": dict(norm="layer", pos="learned", bias=True, ffn="gelu_tanh", n_kv_heads=4)}
STEPS = 16


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("llamacpp_steer")


def _checkpoint(root, arch):
    from glassformer.checkpoint.folders import save_model
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.train([TEXT], vocab_size=300)
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size, n_layers=4, **SHAPES[arch])
    model = reinit(Transformer(cfg), std=0.1).eval()
    save_model(root / arch, model, tok)
    return model, tok


def _llama_steered(path, buf, n_embd, n_layer, ids, steps):
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_batch=128, n_threads=2, n_threads_batch=2, logits_all=True,
                          type_k=f32, type_v=f32, flash_attn=False, verbose=False, seed=0)
    data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    assert llama_cpp.llama_set_adapter_cvec(llm._ctx.ctx, data, buf.size, n_embd, 1, n_layer) == 0
    llm.reset()
    llm.eval(ids)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    llm.close()
    return first, out


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("layer", [2, 3])
def test_llama_cpp_with_the_control_vector_decodes_as_our_steered_model(root, arch, layer):
    model, tok = (_checkpoint(root, arch) if not (root / arch).exists() else _load(root / arch))
    gguf_model = root / f"{arch}.gguf"
    if not gguf_model.exists():
        assert main(["convert", "--to-gguf", str(root / arch), "--out", str(gguf_model), "--dtype", "f32"]) == 0
    vec = contrastive(model, tok, ["the sun rose warm and bright"], ["a storm came and the rain fell"], layer)
    scale = 6 * float(vec.meta["stream_norm"]) / float(vec.direction.norm())  # strong enough to move the tokens
    save_vector(root / f"{arch}{layer}.safetensors", vec)
    cv = root / f"{arch}{layer}.gguf"
    assert main(["convert", "--control-vector", f"{root / f'{arch}{layer}.safetensors'}:{scale}", "--out", str(cv)]) == 0
    ids = tok.encode(PROMPT)
    cfg = model.config
    with torch.no_grad():
        plain = greedy_cached(model, torch.tensor([ids]), STEPS)
        with steer(model, load_vector(f"{root / f'{arch}{layer}.safetensors'}:{scale}")):
            logits = model(torch.tensor([ids]))[0][0, -1].double().numpy()
            ours = greedy_cached(model, torch.tensor([ids]), STEPS)
    assert ours != plain  # the vector moves the tokens, so agreeing below says something
    buf = read_control_vector(cv, cfg.dim, cfg.n_layers)
    first, theirs = _llama_steered(gguf_model, buf, cfg.dim, cfg.n_layers, ids, STEPS)
    err, size = float(np.abs(first - logits).max()), float(np.abs(logits).max())
    assert err <= 1e-3 * size, (err, size)
    assert theirs == ours


def _load(folder):
    from glassformer.checkpoint.loading import load

    model, tok = load(folder)
    return model.eval(), tok
