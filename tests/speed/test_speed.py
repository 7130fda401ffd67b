"""glassformer.speed: speed put on from outside the model by re-classing its modules in place.

Install and remove must leave the model as it was (objects, parameters, state-dict keys, paths,
hooks); eagerly the numbers are the plain model's to the bit; compiled, a one-row product is the
multiply-and-sum inductor streams, equal to the plain product within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from glassformer import KVCache, speed

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
    h2 = model.blocks[0].ffn.w_down.register_forward_hook(lambda m, i, o: seen.append("after"))
    _steps(model, torch.randint(0, 512, (1, 8)))
    assert seen.count("before") == 4 and seen.count("after") == 4  # prefill + three one-row steps, each
    speed.install(model)  # idempotent
    speed.remove(model)
    assert not speed.installed(model) and dict(model.named_modules()) == before_mods
    assert type(model.blocks[0].attn.wq) is nn.Linear and type(model.lm_head) is nn.Linear
    seen.clear()
    model(torch.randint(0, 512, (1, 8)))
    assert seen == ["before", "after"]  # hooks registered before and after install still fire
    h.remove(), h2.remove()


@pytest.mark.parametrize("over", [dict(), dict(norm="layer", ffn="gelu", pos="learned", bias=True, tie_embeddings=True)])
def test_eager_numbers_are_the_plain_models_to_the_bit(over):
    plain = tiny_model(**over)
    fast = speed.install(tiny_model(**over))
    ids = torch.randint(0, 512, (1, 9))
    assert torch.equal(_steps(plain, ids), _steps(fast, ids))  # one-row steps included


def test_an_installed_model_keeps_an_adapter_and_an_int8_module_their_class():
    from glassformer.convert.lora import LoraConfig, LoRALinear, apply_lora
    from glassformer.convert.quantize import Int8Linear, quantize_int8

    model = speed.install(apply_lora(tiny_model(), LoraConfig(r=2, targets=("wq",))))
    wq = model.blocks[0].attn.wq
    assert type(wq) is LoRALinear and type(wq.base) is speed.RowsLinear
    q = speed.install(quantize_int8(tiny_model()))
    assert type(q.blocks[0].attn.wk) is Int8Linear


@pytest.mark.slow
def test_a_compiled_one_row_product_is_the_row_sum():
    """Compiled, a one-row product is a multiply-and-sum over the weight's rows (one streaming loop
    in inductor's code) and agrees with F.linear; many rows and gradients keep F.linear."""
    from torch._dynamo.utils import counters

    lin = speed.install(nn.Sequential(nn.Linear(64, 48)))[0]
    f = torch.compile(lambda x: lin(x), dynamic=False)
    x = torch.randn(1, 1, 64)
    counters.clear()
    with torch.no_grad():
        got = f(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    products = ("aten.addmm", "aten.mm", "aten.baddbmm")
    assert sum(n for k, n in counters["aten_mm_info"].items() if k.startswith(products)) == 0


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
