"""Our Transformer against Hugging Face LlamaForCausalLM on the same weights."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer import Transformer  # noqa: E402
from glassformer.convert import config_from_hf_llama, llama_state_from_hf  # noqa: E402

from ..support import greedy_cached, reinit  # noqa: E402

CASES = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mqa-tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "gqa-tied-theta": dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500.0),
    "llama3-scaling": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),
}


def _pair(case):
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        max_position_embeddings=160, rms_norm_eps=1e-6, **CASES[case],
    )
    hf = reinit(transformers.LlamaForCausalLM(hc), std=0.08).eval()
    cfg = config_from_hf_llama(hc.to_dict())
    ours = Transformer(cfg).eval()
    ours.load_state_dict(llama_state_from_hf(hf.state_dict(), cfg))
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_llama(case):
    hf, ours = _pair(case)
    ids = torch.randint(0, 101, (2, 48))
    with torch.no_grad():
        ref = hf(ids).logits
        got, _ = ours(ids)
    assert ref.abs().max() > 0.1  # big enough that a real bug cannot hide under the tolerance
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("case", ["gqa-untied", "mqa-tied"])
def test_greedy_tokens_match_llama(case):
    hf, ours = _pair(case)
    ids = torch.randint(0, 101, (1, 8))
    with torch.no_grad():
        # No end-of-text in this random vocabulary: plain greedy for exactly 20 tokens.
        hf.generation_config.eos_token_id = None
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, 8:].tolist()
        got = greedy_cached(ours, ids, 20)
    assert got == ref
