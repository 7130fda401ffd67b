"""Prefill + one token at a time through the KV cache equals one full forward."""

import pytest
import torch

from glassformer import KVCache

from ..support import tiny_model

HEADS = {"mha": 4, "gqa": 2, "mqa": 1}


@pytest.mark.parametrize("kernel", ["naive", "tiled", "sdpa"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_cached_decoding_equals_full_forward(kernel, heads):
    model = tiny_model(n_kv_heads=HEADS[heads], attention=kernel, attention_tile=5).double()
    ids = torch.randint(0, 512, (2, 23))
    with torch.no_grad():
        full, _ = model(ids)
        cache = KVCache.for_model(model, 2, 32)
        steps = [model(ids[:, :9], cache=cache, pos=0)[0]]  # prefill
        for t in range(9, 23):  # then one token at a time
            steps.append(model(ids[:, t:t + 1], cache=cache, pos=t)[0])
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-10


@pytest.mark.parametrize("kernel", ["naive", "tiled", "sdpa"])
def test_rows_at_different_positions(kernel):
    """Right-padded prompts of lengths 5 and 9 decoded with per-row positions equal each alone."""
    model = tiny_model(n_kv_heads=2, attention=kernel, attention_tile=4).double()
    a, b = torch.randint(0, 512, (1, 7)), torch.randint(0, 512, (1, 11))
    with torch.no_grad():
        alone = [model(a)[0][0], model(b)[0][0]]
        cache = KVCache.for_model(model, 2, 16)
        batch = torch.zeros(2, 9, dtype=torch.long)
        batch[0, :5], batch[1, :] = a[0, :5], b[0, :9]  # row 0 padded after 5 tokens
        first, _ = model(batch, cache=cache, pos=0)
        # each row continues at its own position with its own next token
        pos = torch.tensor([5, 9])
        nxt = torch.stack([a[0, 5:7], b[0, 9:11]])  # (2, 2)
        second, _ = model(nxt, cache=cache, pos=pos)
    assert (first[0, :5] - alone[0][:5]).abs().max() < 1e-10
    assert (first[1] - alone[1][:9]).abs().max() < 1e-10
    assert (second[0] - alone[0][5:7]).abs().max() < 1e-10
    assert (second[1] - alone[1][9:11]).abs().max() < 1e-10


def test_left_padding_mask_equals_unpadded():
    """Pad keys hidden by padding_mask; RoPE scores depend only on relative position, so the
    real tokens sitting 3 positions later change nothing."""
    model = tiny_model().double()
    ids = torch.randint(0, 512, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)  # 3 pad tokens in front
    mask = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        ref, _ = model(ids)
        got, _ = model(padded, padding_mask=mask)
        unmasked, _ = model(padded)
    assert (got[0, 3:] - ref[0]).abs().max() < 1e-10
    assert (unmasked[0, 3:] - ref[0]).abs().max() > 1e-3  # without the mask the pads leak in


def test_cache_overflow_is_a_clear_error():
    model = tiny_model()
    cache = KVCache.for_model(model, 1, 8)
    with pytest.raises(ValueError, match="cache holds 8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache, pos=0)


def test_context_overflow_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="exceed the model's context of 128"):
        model(torch.zeros(1, 4, dtype=torch.long), pos=126)
