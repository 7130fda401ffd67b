"""Our trace probes against TransformerLens's hooks on the same weights, for every family: the bridge
(TransformerLens 3's TransformerBridge) wraps the transformers model, glassformer reads the folder
transformers wrote, and the stream entering each block, each attention pattern, each head's z and
each block's attention and feed-forward outputs agree (docs/convert.md#families)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
model_bridge = pytest.importorskip("transformer_lens.model_bridge")

from glassformer.probes import stream_probes  # noqa: E402
from glassformer.tracing.trace import trace  # noqa: E402

from .family_parity import hf_random, ours_from_hf  # noqa: E402
from .test_families_dense import CASES, hf_config  # noqa: E402
from .test_families_moe import CONFIGS  # noqa: E402

FAMILIES = {**{case: (lambda case=case: hf_config(case)) for case in CASES}, **CONFIGS}


def _bridge(hf, folder):
    """The bridge over transformers' own model; a word-level tokenizer stands in for the hub's (none here)."""
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(hf.config.vocab_size)}, unk_token="t0"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0")
    return model_bridge.TransformerBridge.boot_transformers(str(folder), device="cpu", hf_model=hf, tokenizer=tok)


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rel: float = 1e-4) -> None:
    theirs = theirs.detach().float()
    scale = max(float(theirs.abs().max()), 1e-6)
    err = float((ours.float() - theirs).abs().max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} against {scale:.3g}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_probes_match_transformer_lens_hooks(name, tmp_path):
    hf = hf_random(FAMILIES[name]())
    ours = ours_from_hf(hf, tmp_path)
    bridge = _bridge(hf, tmp_path / "hf")
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))  # > any window
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
    tr = trace(ours, ids[0])
    cfg = ours.config
    _close(tr["logits"], logits[0], "logits")
    for i in range(cfg.n_layers):
        wiring = stream_probes(i, cfg.norm_placement, cfg.ffn)
        _close(tr[wiring["in"]], cache[f"blocks.{i}.hook_resid_pre"][0], f"block {i}: the stream entering it")
        # TransformerLens's pattern is (batch, head, query, key); ours (query, head, key), masked cells NaN
        pattern = cache[f"blocks.{i}.attn.hook_pattern"][0].transpose(0, 1)
        _close(torch.nan_to_num(tr[f"blocks.{i}.attn.weights"]), pattern, f"block {i}: attention pattern")
        z = cache[f"blocks.{i}.attn.hook_z"][0]
        _close(tr[f"blocks.{i}.attn.z"], z.reshape(tr[f"blocks.{i}.attn.z"].shape), f"block {i}: z")
