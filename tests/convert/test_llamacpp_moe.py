"""llama.cpp runs the GGUF files of the mixture-of-experts families as glassformer does: tiny random
transformers models of qwen3_moe (llama.cpp's qwen3moe graph), olmoe (olmoe), gpt_oss (gpt-oss: sinks,
biases, the clamped SwiGLU, every other layer sliding, YaRN) and mixtral (the llama graph with experts),
imported with `convert --from-hf`, exported with `convert --to-gguf`, compared at every position (f32,
within 1e-4 of max |logit|) and over 20 greedy tokens. Each fixture keeps to what its graph hard-codes
(renormalised top-k weights for qwen3moe and llama, raw for olmoe, whose key norm needs as many key heads
as query heads; gpt-oss's clamp at 7). Skipped unless
llama_cpp imports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .gguf_fixtures import exported_families, llama_and_ours, llama_f32

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.llamacpp

W = 8
MOE = dict(num_experts_per_tok=2)
# family -> (transformers config class, arguments over tiny(), the llama.cpp graph it must be written as)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=48, num_experts=6, norm_topk_prob=True, **MOE), "qwen3moe"),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=48, num_experts=8, norm_topk_prob=False, num_key_value_heads=4, **MOE),
              "olmoe"),
    "mixtral": ("MixtralConfig", dict(intermediate_size=40, num_local_experts=4, **MOE), "llama"),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=4, intermediate_size=64, num_local_experts=4, sliding_window=W,
                                     rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                                          beta_slow=1.0, original_max_position_embeddings=16,
                                                          truncate=False), **MOE), "gpt-oss"),
}
STEPS = 20


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (our model, the f32 GGUF file, the f16 one)."""
    files = exported_families(tmp_path_factory.mktemp("moe"), FAMILIES, ("f32", "f16"))
    return {family: (model, paths["f32"], paths["f16"]) for family, (model, _, paths) in files.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_written_as_its_graph(family, exported):
    import gguf

    reader = gguf.GGUFReader(exported[family][1])
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    assert arch == FAMILIES[family][2]
    count = reader.fields[f"{arch}.expert_count"]
    assert int(count.parts[count.data[0]][0]) == exported[family][0].config.n_experts


@pytest.mark.parametrize("family", FAMILIES)
def test_every_position_and_20_greedy_tokens(family, exported):
    model, path, _ = exported[family]
    ids = [int(i) for i in torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(0))]
    got, want, tokens, greedy = llama_and_ours(model, path, ids, STEPS)
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert scale > 0.1 and err <= 1e-4 * scale, (err, scale)
    assert tokens == greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_f16_files_run(family, exported):
    """In f16 the experts' (E, F) biases stay f32 (llama.cpp adds biases only in f32: an f16 one aborted the
    process); the files run and agree with ours on the next token almost everywhere (a near-tie in the
    router can send one position to another expert at f16)."""
    model, _, out = exported[family]
    ids = [int(i) for i in torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(0))]
    llm = llama_f32(out)
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.close()
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0][0].double().numpy()
    assert (got.argmax(-1) == want.argmax(-1)).sum() >= 57
