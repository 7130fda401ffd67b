"""Parity with TransformerLens on the same weights: its TransformerBridge booted from our Hugging Face
export gives the same patching grids (`patching.get_act_patch_*`) and the same direct logit
attribution (`ActivationCache.stack_head_results` / `decompose_resid` with apply_ln) within 1e-4.
Skipped where transformer-lens is not installed (the `research` extra)."""

from __future__ import annotations

import pytest
import torch

from glassformer.research.attribution import direct_logit_attribution
from glassformer.research.patching import patch_sweep
from ..support import run_cli, tiny_checkpoint

pytest.importorskip("transformer_lens", reason="transformer-lens is not installed (the research extra)")
TEXT = "the cat sat on the mat. the dog sat on the log. "


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(our model, its tokenizer, the TransformerBridge over its Hugging Face export)."""
    from transformers import AutoModelForCausalLM
    from transformer_lens.model_bridge import TransformerBridge

    root = tmp_path_factory.mktemp("tl")
    model, tok = tiny_checkpoint(root / "ckpt", TEXT * 20)
    assert run_cli(["convert", "--to-hf", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager", dtype=torch.float32)
    return model, tok, TransformerBridge.boot_transformers(str(root / "hf"), hf_model=hf, device="cpu")


def ids(tok, text):
    return torch.tensor([tok.encode(text)])


SWEEPS = {"resid_pre": "get_act_patch_resid_pre", "attn_out": "get_act_patch_attn_out",
          "mlp_out": "get_act_patch_mlp_out", "z": "get_act_patch_attn_head_out_all_pos"}


@pytest.mark.parametrize("site", SWEEPS)
def test_patching_grids_equal_transformer_lens(twins, site):
    from transformer_lens import patching

    model, tok, bridge = twins
    clean, corrupt = ids(tok, "the cat sat on the"), ids(tok, "the dog sat on the")
    a, w = tok.encode(" mat")[0], tok.encode(" log")[0]
    _, cache = bridge.run_with_cache(clean)
    theirs = getattr(patching, SWEEPS[site])(bridge, corrupt, cache, lambda lg: lg[0, -1, a] - lg[0, -1, w])
    theirs = torch.as_tensor(getattr(theirs, "tensor", theirs)).float()
    ours = patch_sweep(model, clean[0].tolist(), corrupt[0].tolist(), a, w, site).exact
    assert theirs.shape == ours.shape
    assert torch.allclose(theirs, ours, atol=1e-4)


def test_direct_logit_attribution_equals_transformer_lens(twins):
    model, tok, bridge = twins
    text = ids(tok, "the cat sat on the")
    a, w = tok.encode(" mat")[0], tok.encode(" log")[0]
    ours = direct_logit_attribution(model, text[0].tolist(), a, w)["parts"]
    _, cache = bridge.run_with_cache(text)
    # The bridge keeps Hugging Face's weights (no folding): apply_ln divides by the frozen scale, and
    # the final norm's gain is put on by hand, as it sits unfolded in front of W_U.
    read = model.final_norm.weight.detach() * (bridge.W_U[:, a] - bridge.W_U[:, w])
    heads, labels = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True, return_labels=True)
    for label, v in zip(labels, (heads[:, 0] @ read).tolist()):
        layer, head = label[1:].split("H")
        assert ours[f"blocks.{layer}.attn.head{head}"] == pytest.approx(v, abs=1e-4)
    resid, names = cache.decompose_resid(layer=-1, pos_slice=-1, apply_ln=True, return_labels=True)
    theirs = dict(zip(names, (resid[:, 0] @ read).tolist()))
    assert ours["embed"] == pytest.approx(theirs["embed"], abs=1e-4)
    for i in range(model.config.n_layers):
        assert ours[f"blocks.{i}.ffn"] == pytest.approx(theirs[f"{i}_mlp_out"], abs=1e-4)
