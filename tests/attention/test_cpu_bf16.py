"""Training in bf16 on a CPU: the fused kernel runs in float32 (sdpa._fused), and its output and
gradients are the naive kernel's in float32 on the same bf16 inputs, returned in bf16."""

from __future__ import annotations

import pytest
import torch

from glassformer.attention import naive_attention, sdpa_attention


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_training_attention_is_the_float32_kernels(masked):
    g = torch.Generator().manual_seed(0)
    B, N, K, T, H = 2, 4, 2, 12, 16
    q, k, v = (torch.randn(B, n, T, H, generator=g).bfloat16().requires_grad_() for n in (N, K, K))
    pos = torch.arange(T)[None].expand(B, T)  # (B, T)
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[1, :3] = False  # row 1's first keys are padding: the masked route
    kw = {"q_pos": pos, "key_mask": key_mask if masked else None, "start": None if masked else 0}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_attention(q, k, v, **kw)
    assert out.dtype == torch.bfloat16
    if not masked:  # exactly the float32 kernel's answer, rounded once (bf16's own kernel rounds inside)
        with torch.no_grad():
            f32 = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                                   enable_gqa=True)
        assert torch.equal(out, f32.bfloat16())
    dout = torch.randn(out.shape, generator=g)
    out.float().backward(dout)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = naive_attention(q32, k32, v32, **kw)
    ref.backward(dout)
    rows = slice(None) if not masked else (slice(None), slice(None), slice(3, None))  # padded queries aside
    assert torch.allclose(out.float()[rows], ref[rows], atol=1e-2)  # bf16's output rounding
    for got, want in ((q.grad, q32.grad), (k.grad, k32.grad), (v.grad, v32.grad)):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)
