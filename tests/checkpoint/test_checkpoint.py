"""checkpoint/: the one model builder, native folders (save, resolve, load), training state."""

from __future__ import annotations

import pytest
import torch

from glassformer import load
from glassformer.checkpoint.builder import model_from_state, model_state
from glassformer.checkpoint.folders import resolve, save_model, step_name, write_pointer
from glassformer.checkpoint.training import load_training, save_training
from glassformer.errors import UserError

from ..support import REPO, tiny_model


@pytest.mark.parametrize("tied", [False, True])
def test_builder_holds_exactly_the_state(tied):
    model = tiny_model(tie_embeddings=tied)
    state = model_state(model)
    assert ("lm_head.weight" in state) is not tied  # a tied head is stored once
    built = model_from_state(model.config, state)
    assert not built.training
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(built(ids)[0], model(ids)[0])
    assert built.embed.weight.data_ptr() == state["embed.weight"].data_ptr()  # assigned, not copied
    if tied:
        assert built.lm_head.weight is built.embed.weight


def test_builder_names_the_source_of_a_bad_state():
    model = tiny_model()
    state = model_state(model)
    missing = {k: v for k, v in state.items() if k != "blocks.0.attn.wq.weight"}
    with pytest.raises(UserError, match=r"here\.safetensors does not match its config: missing \['blocks.0.attn.wq.weight'\]"):
        model_from_state(model.config, missing, where="here.safetensors")
    with pytest.raises(UserError, match=r"unexpected \['extra'\]"):
        model_from_state(model.config, {**state, "extra": torch.zeros(1)}, where="here")
    wrong = {**state, "final_norm.weight": torch.ones(3)}
    with pytest.raises(UserError, match="does not match its config.*final_norm.weight"):
        model_from_state(model.config, wrong, where="here")


def test_native_load_is_float32_whatever_is_stored(tmp_path):
    model = tiny_model().to(torch.bfloat16)
    save_model(tmp_path / "ckpt", model)
    loaded, tok = load(tmp_path / "ckpt")
    assert tok is None and {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert torch.equal(loaded.embed.weight, model.embed.weight.float())
    half, _ = load(tmp_path / "ckpt", dtype=torch.float16)
    assert {p.dtype for p in half.parameters()} == {torch.float16}


def test_training_state_round_trip_and_latest(tmp_path):
    model = tiny_model()
    opt = {"state": {"embed.weight": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
           "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["embed.weight"]}]}
    folder = save_training(tmp_path, 7, model.config, model_state(model), None, opt, {"step": 7},
                           {"rng/cpu": torch.arange(4, dtype=torch.uint8)})
    assert folder.name == step_name(7) and resolve(tmp_path) == folder  # `latest` names it
    sd, optim, state, extra = load_training(folder)
    assert state == {"step": 7} and optim["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(optim["state"]["embed.weight"]["exp_avg"], torch.ones(2))
    assert torch.equal(extra["rng/cpu"], torch.arange(4, dtype=torch.uint8))
    assert torch.equal(sd["embed.weight"], model.embed.weight)


def test_pointer_to_an_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "step-000001").mkdir()
    write_pointer(tmp_path, "latest", "step-000001")
    assert not list(tmp_path.glob(".latest.tmp-*"))  # the pointer was renamed into place
    with pytest.raises(UserError, match="missing or incomplete"):
        resolve(tmp_path)


def test_a_checkpoint_written_before_the_one_forward_change_gives_identical_logits():
    """tests/data/tiny_checkpoint_v1 was saved by the code before the model's forward was rewritten
    (fused RoPE tables, the Linear seam, probe names from the module tree): same keys, same logits."""
    from safetensors.torch import load_file

    import glassformer

    data = REPO / "tests" / "data"
    model, _ = glassformer.load(data / "tiny_checkpoint_v1")
    ref = load_file(data / "tiny_checkpoint_v1_logits.safetensors")
    # The reference logits were computed on another CPU: the library's matrix products pick their
    # kernels by the chip, and another summation order moves float32 logits of magnitude ~4 by a few
    # units in the last place (seen: 1.7e-6 on an AVX-512 chip where the writing machine gave them bit
    # for bit). A change to the forward itself moves them by orders of magnitude more.
    with torch.no_grad():
        logits, _ = model.eval()(ref["ids"])
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)
    with torch.enable_grad():  # the training path's kernels too (the formula RMSNorm, the fused QKV)
        train_logits, _ = model(ref["ids"])
    torch.testing.assert_close(train_logits.detach(), ref["logits"], rtol=0, atol=1e-5)
