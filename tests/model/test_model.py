"""The model module as such: its pure functions against the formulas they stand for, its seams
(where a weight product runs), and probe names taken from the module tree."""

from __future__ import annotations

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.model import Linear, RMSNorm, apply_rope, hooked, rope_angles, rope_tables, rotate

from ..support import batched_step, tiny_model


def pairwise_rope(x, cos, sin, pairs):
    """The rotation written pair by pair: (a cos − b sin, a sin + b cos), the textbook form."""
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, H/2)
    if pairs == "half":
        a, b = x.chunk(2, -1)
        return torch.cat([a * c - b * s, a * s + b * c], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


@pytest.mark.parametrize("pairs", ["half", "interleaved"])
def test_rotate_with_tables_is_the_pairwise_rotation_to_the_bit(pairs):
    x = torch.randn(3, 17, 4, 16)
    cos, sin = rope_angles(torch.arange(17).expand(3, 17) * 3, 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
    want = pairwise_rope(x, cos, sin, pairs)
    assert torch.equal(rotate(x, *rope_tables(cos, sin, pairs), pairs), want)
    assert torch.equal(apply_rope(x, cos, sin, pairs), want)


@pytest.mark.parametrize("dim", [8, 64, 384, 1000])
def test_rms_norm_gives_the_same_numbers_with_and_without_gradients(dim):
    """Without gradients RMSNorm runs the library's fused kernel; it must equal the formula."""
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, dim) * 3
    with torch.no_grad():
        fused = norm(x)
    formula = norm(x.requires_grad_())
    assert torch.equal(fused, formula.detach())
    want = x.detach() / torch.sqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.detach()
    torch.testing.assert_close(fused, want, rtol=1e-6, atol=1e-6)


def test_probe_prefixes_are_module_paths():
    model = Transformer(ModelConfig.from_preset("tiny", n_layers=3))
    named = dict(model.named_modules())
    for i, block in enumerate(model.blocks):
        assert named[f"blocks.{i}"] is block and block.name == f"blocks.{i}"
        assert block.attn.name == f"blocks.{i}.attn" and block.ffn.name == f"blocks.{i}.ffn"


def test_fused_qkv_equals_the_three_projections_and_steps_aside_for_a_hook():
    model = tiny_model()
    attn = model.blocks[0].attn
    x = torch.randn(2, 5, model.config.dim)
    q, k, v = attn.qkv(x)  # one product over the three weights
    torch.testing.assert_close(q, x @ attn.wq.weight.T)
    torch.testing.assert_close(k, x @ attn.wk.weight.T)
    torch.testing.assert_close(v, x @ attn.wv.weight.T)
    seen = []
    handle = attn.wk.register_forward_hook(lambda m, i, o: seen.append(o.shape) or o * 0)
    try:
        assert hooked(attn.wk) and not hooked(attn.wq)
        _, k0, _ = attn.qkv(x)
    finally:
        handle.remove()
    assert seen == [(2, 5, model.config.kv_dim)] and torch.equal(k0, torch.zeros_like(k0))
    assert not hooked(attn.wk)


@pytest.mark.skipif(not __import__("glassformer.model", fromlist=["PACKS"]).PACKS, reason="no oneDNN in this torch")
def test_a_batched_decode_step_reads_a_packed_copy_built_on_demand(monkeypatch):
    """A few sequences' one position (B, 1, D) read the held copy's oneDNN-packed weight, built at
    the first such product and rebuilt when the weight changes; a prompt's rows (1, T, D) and one row
    keep their own products, bit for bit; the model's logits agree with the library's products. A
    weight smaller than PACK_MIN is marked unpacked and multiplied from the held (in, out) copy."""
    import glassformer.model as M

    # oneDNN's packed copy whether or not an engine in this process built the kernel library (whose
    # panels tests/attention/test_cpu_decode.py covers)
    monkeypatch.setattr(M.cpu_decode, "products", False)

    small = Linear(128, 256, bias=True)  # 128 x 256 < PACK_MIN: not worth oneDNN's call
    small.hold_rows()
    xs = torch.randn(16, 1, 128)
    with torch.no_grad():
        got = small(xs)
        assert small.held[4] is False
        assert torch.equal(got, torch.addmm(small.bias, xs.view(16, 128), small.held[1]).view(16, 1, 256))
        torch.testing.assert_close(got, xs @ small.weight.T + small.bias, atol=2e-5, rtol=0)
    monkeypatch.setattr(M, "PACK_MIN", 0)  # below: every few-row product packed, however small
    lin = Linear(384, 96, bias=True)
    lin.hold_rows()
    x, prompt = torch.randn(16, 1, 384), torch.randn(1, 16, 384)
    with torch.no_grad():
        assert lin.held[4] is None
        torch.testing.assert_close(lin(x), (x.double() @ lin.weight.double().T + lin.bias.double()).float(), atol=2e-5, rtol=0)
        assert lin.held[4] is not None  # packed now
        assert torch.equal(lin(prompt), torch.nn.functional.linear(prompt, lin.weight, lin.bias))
        lin.weight.mul_(-1)  # stale: rebuilt, packed again at the next few-row product
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=2e-5, rtol=0)
    model = tiny_model(seed=3).eval()
    model.hold_rows()
    step = batched_step(model)
    packed = step()
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    assert attn.held[4] is not None and attn.wo.held[4] is not None and ffn.held[4] is not None  # each product packed
    monkeypatch.setattr(M, "PACKS", False)
    library = step()
    torch.testing.assert_close(packed, library, atol=1e-5, rtol=0)


def test_one_row_products_read_the_held_copy_only_while_it_is_fresh():
    lin = Linear(12, 5)
    x = torch.randn(1, 1, 12)
    lin.hold_rows()
    with torch.no_grad():
        first = lin(x)
        torch.testing.assert_close(first, x @ lin.weight.T + lin.bias)
        lin.weight.mul_(-1)  # in place: the held copy is stale and must be rebuilt
        second = lin(x)
    torch.testing.assert_close(second, x @ lin.weight.T + lin.bias)
    (ptr, version), = lin.held[0][0]  # the key: ((data pointer, version) of each weight, threads)
    assert ptr == lin.weight.data_ptr() and version == lin.weight._version
    with torch.enable_grad():  # anything needing gradients uses the weight itself
        y = lin(x.requires_grad_())
    assert y.requires_grad and y.grad_fn is not None
