"""Small shared helpers for the tests (tiny random models, Hugging Face twins)."""

from __future__ import annotations

import torch

from glassformer import ModelConfig, Transformer


@torch.no_grad()
def reinit(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Re-draw every weight with a large std: the default init makes logits so small that
    real bugs hide under an absolute tolerance."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return model


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", **overrides)
    return reinit(Transformer(cfg), seed=seed).eval()


def greedy_cached(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens with a KV cache: prefill, then one token at a time."""
    from glassformer import KVCache

    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1] + steps)
    logits, _ = model(ids, cache=cache, pos=0)
    out, pos = [], ids.shape[1]
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(int(nxt[0, 0]))
        logits, _ = model(nxt, cache=cache, pos=pos)
        pos += 1
    return out
