"""The model module as such: its pure functions against the formulas they stand for, its seams
(where a weight product runs), and probe names taken from the module tree."""

from __future__ import annotations

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.model import RMSNorm, apply_rope, rope_angles, rope_tables, rotate



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
def test_rms_norm_is_the_formula(dim):
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, dim) * 3
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.detach()
    torch.testing.assert_close(norm(x).detach(), want, rtol=1e-6, atol=1e-6)


def test_probe_prefixes_are_module_paths():
    model = Transformer(ModelConfig.from_preset("tiny", n_layers=3))
    named = dict(model.named_modules())
    for i, block in enumerate(model.blocks):
        assert named[f"blocks.{i}"] is block and block.name == f"blocks.{i}"
        assert block.attn.name == f"blocks.{i}.attn" and block.ffn.name == f"blocks.{i}.ffn"
