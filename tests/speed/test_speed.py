"""glassformer.speed: speed put on from outside the model by re-classing its modules in place.

Install and remove must leave the model as it was (objects, parameters, state-dict keys, paths,
hooks); outside `decoding()` the numbers are the plain model's to the bit; inside it the one-row
products read row-block copies that agree with the plain products and follow the weights."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from glassformer import KVCache, speed
from glassformer.model import RMSNorm

from ..support import tiny_model


def _steps(model, ids: torch.Tensor, n_prefill: int = 5) -> torch.Tensor:
    """Prefill n_prefill tokens, then one step per token: the logits (B, T, V)."""
    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1])
    with torch.no_grad():
        got = [model(ids[:, :n_prefill], cache=cache)[0]]
        got += [model(ids[:, t:t + 1], cache=cache, pos=t)[0] for t in range(n_prefill, ids.shape[1])]
    return torch.cat(got, 1)


def test_install_and_remove_keep_objects_parameters_keys_and_hooks():
    model = tiny_model()
    before_mods = dict(model.named_modules())
    before_state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    seen = []
    h = model.blocks[0].attn.wq.register_forward_hook(lambda m, i, o: seen.append("before"))
    speed.install(model)
    assert speed.installed(model)
    assert dict(model.named_modules()) == before_mods  # the same objects at the same paths
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before_state
    assert type(model.blocks[0].attn.wq) is speed.RowsLinear and type(model.lm_head) is speed.PaddedHead
    assert type(model.blocks[0].attn_norm) is speed.FusedRMSNorm
    h2 = model.blocks[0].ffn.w_down.register_forward_hook(lambda m, i, o: seen.append("after"))
    ids = torch.randint(0, 512, (1, 8))
    with speed.decoding():
        _steps(model, ids)
    assert seen.count("before") == 4 and seen.count("after") == 4  # prefill + three one-row steps, each
    speed.install(model)  # idempotent
    speed.remove(model)
    assert not speed.installed(model) and dict(model.named_modules()) == before_mods
    assert type(model.blocks[0].attn.wq) is nn.Linear and type(model.blocks[0].attn_norm) is RMSNorm
    assert all("held" not in m.__dict__ for m in model.modules())  # the copies are dropped
    seen.clear()
    model(ids)
    assert seen == ["before", "after"]  # hooks registered before and after install still fire
    h.remove(), h2.remove()


@pytest.mark.parametrize("over", [dict(), dict(norm="layer", ffn="gelu", pos="learned", bias=True, tie_embeddings=True)])
def test_outside_decoding_the_numbers_are_the_plain_models_to_the_bit(over):
    plain = tiny_model(**over)
    fast = speed.install(tiny_model(**over))
    ids = torch.randint(0, 512, (1, 9))
    assert torch.equal(_steps(plain, ids), _steps(fast, ids))  # one-row steps included
    with torch.no_grad():
        assert torch.equal(plain(ids[:, :1])[0], fast(ids[:, :1])[0])
    with speed.decoding():
        held = _steps(fast, ids)
    ref = _steps(plain, ids)
    assert (held - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_decoding_is_per_thread():
    """The serve engine steps in its own thread while the explorer reads the same model in another."""
    model = speed.install(tiny_model())
    plain = tiny_model()
    ids = torch.randint(0, 512, (1, 7))
    inside, go = threading.Event(), threading.Event()

    def stepper():
        with speed.decoding():
            inside.set()
            go.wait(10)

    t = threading.Thread(target=stepper)
    t.start()
    inside.wait(10)
    try:
        assert torch.equal(_steps(model, ids), _steps(plain, ids))
    finally:
        go.set()
        t.join()


def test_a_held_copy_follows_the_weight_and_gradients_use_the_weight():
    lin = speed.install(nn.Sequential(nn.Linear(12, 5)))[0]
    x = torch.randn(1, 1, 12)
    with torch.no_grad(), speed.decoding():
        first = lin(x)
        torch.testing.assert_close(first, x @ lin.weight.T + lin.bias)
        lin.weight.mul_(-1)  # in place: the held copy is stale and must be rebuilt
        second = lin(x)
    torch.testing.assert_close(second, x @ lin.weight.T + lin.bias)
    key, _, _ = lin.held
    assert key[:2] == (lin.weight.data_ptr(), lin.weight._version)
    with speed.decoding():  # gradients wanted: the weight itself
        y = lin(x.requires_grad_())
    assert y.grad_fn is not None


def test_a_hook_that_changes_a_product_changes_a_decode_step():
    model = speed.install(tiny_model())
    ids = torch.randint(0, 512, (1, 8))
    with speed.decoding():
        base = _steps(model, ids)
    h = model.blocks[1].attn.wv.register_forward_hook(lambda m, i, o: o * 0)
    try:
        with speed.decoding():
            zeroed = _steps(model, ids)
    finally:
        h.remove()
    assert (zeroed[:, 5:] - base[:, 5:]).abs().max() > 1e-3  # the one-row steps ran the hook too


@pytest.mark.parametrize("dim", [8, 64, 384, 1000])
def test_fused_rms_norm_equals_the_formula_to_the_bit(dim):
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, dim) * 3
    formula = norm(x).detach()
    speed.install(nn.Sequential(norm))
    with torch.no_grad():
        assert torch.equal(norm(x), formula)


def test_a_compiled_steps_key_sees_modules_re_classed():
    """A compiled session keeps no guard on the model: its step_key must change when speed is put on
    or taken off, so the step is traced anew rather than run with the other classes' code."""
    from glassformer.generation.compiled import step_key

    model = tiny_model()
    plain = step_key(model)
    speed.install(model)
    fast = step_key(model)
    assert fast != plain and step_key(model) == fast
    speed.remove(model)
    assert step_key(model) == plain
