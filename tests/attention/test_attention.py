"""naive, tiled and sdpa agree, forward and backward, over drawn shapes and masks."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glassformer.attention import KERNELS, naive_attention, tiled_attention

shapes = st.tuples(
    st.integers(1, 2),  # B
    st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (6, 3)]),  # (N, K)
    st.integers(1, 256),  # T
    st.sampled_from([2, 8, 16]),  # H
    st.sampled_from([1, 7, 16, 64, 300]),  # tile
    st.sampled_from([None, 5, 64]),  # sliding window
)


def _inputs(B, N, K, Tq, Tk, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return mk(B, N, Tq, H), mk(B, K, Tk, H), mk(B, K, Tk, H)


def _run(kernel, q, k, v, **kw):
    out = kernel(q, k, v, **kw)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out).to(out)).sum(), (q, k, v))
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_kernels_agree(dtype, shape, seed):
    """Forward and gradients: to 1e-10 in float64, to rtol 1e-4 in float32."""
    B, (N, K), T, H, tile, window = shape
    q, k, v = _inputs(B, N, K, T, T, H, dtype, seed)
    q_pos = torch.arange(T).expand(B, T)
    ref, ref_g = _run(naive_attention, q, k, v, q_pos=q_pos, window=window)
    for name, kernel in KERNELS.items():
        kw = {"tile": tile, "start": 0} if name == "tiled" else {"start": 0}
        out, g = _run(kernel, q, k, v, q_pos=q_pos, window=window, **kw)
        for got, want in zip((out, *g), (ref, *ref_g)):
            if dtype == torch.float64:
                assert (got - want).abs().max() <= 1e-10, name
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_naive_matches_textbook_formula():
    """The grouped naive kernel equals softmax(QKᵀ/√H + causal mask)V with repeated heads."""
    q, k, v = _inputs(2, 4, 2, 9, 9, 8, torch.float64, 0)
    out = naive_attention(q, k, v, q_pos=torch.arange(9).expand(2, 9))
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kr.transpose(-1, -2) / 8**0.5
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(out, torch.softmax(s, -1) @ vr, atol=1e-12)


@pytest.mark.parametrize("name", list(KERNELS))
def test_offsets_and_padding(name):
    """Per-row query positions, a padding mask, and rows that can read nothing (zeros)."""
    q, k, v = _inputs(3, 4, 2, 5, 12, 8, torch.float64, 1)
    q_pos = torch.tensor([[7, 8, 9, 10, 11], [0, 1, 2, 3, 4], [3, 4, 5, 6, 7]])
    key_mask = torch.ones(3, 12, dtype=torch.bool)
    key_mask[2, :6] = False  # row 2: its first six keys are padding
    kw = {"tile": 4} if name == "tiled" else {}
    out = KERNELS[name](q, k, v, q_pos=q_pos, key_mask=key_mask, **kw)
    ref = naive_attention(q, k, v, q_pos=q_pos, key_mask=key_mask)
    assert (out - ref).abs().max() < 1e-12
    # row 2, query at position 3, 4, 5 reads only padding: output is zero
    assert out[2, :, :3].abs().max() == 0 and out[2, :, 3:].abs().max() > 0
    # the row-1 query at position 0 reads exactly key 0 (its value, per group)
    assert torch.allclose(out[1, :, 0], v[1, :, 0].repeat_interleave(2, 0))


@pytest.mark.parametrize("mask", ["causal", "padding", "window"])
def test_decode_rows_at_their_own_positions(mask):
    """One query per row at a per-row position (a continuous-batching step, sdpa's masked two-product
    route on the CPU) equals the naive kernel, forward and backward; a row that can read nothing gets zeros."""
    q, k, v = _inputs(4, 6, 2, 1, 10, 8, torch.float64, 3)
    q_pos = torch.tensor([[9], [0], [4], [6]])
    kw = {}
    if mask == "padding":
        kw["key_mask"] = torch.ones(4, 10, dtype=torch.bool)
        kw["key_mask"][2, :5] = False  # row 2 (position 4) reads only padding
    elif mask == "window":
        kw["window"] = 3
    out, g = _run(KERNELS["sdpa"], q, k, v, q_pos=q_pos, **kw)
    ref, ref_g = _run(naive_attention, q, k, v, q_pos=q_pos, **kw)
    for got, want in zip((out, *g), (ref, *ref_g)):
        assert (got - want).abs().max() < 1e-12
    assert torch.allclose(out[1, :, 0], v.detach()[1, :, 0].repeat_interleave(3, 0))  # position 0 reads key 0 only
    if mask == "padding":
        assert out[2].abs().max() == 0 and out[3].abs().max() > 0


def test_tiled_skips_fully_masked_tiles():
    q, k, v = _inputs(1, 2, 2, 8, 8, 4, torch.float64, 2)
    log = []
    tiled_attention(q, k, v, q_pos=torch.arange(8)[None], tile=2, tile_log=log)
    skipped = [(e["q"], e["k"]) for e in log if e["skipped"]]
    # 4 query tiles x 4 key tiles; the 6 strictly above the diagonal are never computed
    assert len(log) == 16 and len(skipped) == 6
    assert all(kk[0] > qq[1] - 1 for qq, kk in skipped)
