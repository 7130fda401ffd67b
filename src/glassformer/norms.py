"""The families' own norm, beside model.py's RMSNorm and LayerNorm (docs/model.md#families)."""

from __future__ import annotations

import torch
import torch.nn as nn


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm (Team et al., 2024): x / sqrt(mean(x²) + eps) · (1 + w), the product taken in
    fp32 before the cast back (Gemma's order; Llama casts first); w is stored and starts at 0, so a
    fresh norm is the identity scale as model.RMSNorm's γ = 1 is."""

    def __init__(self, dim: int, eps: float, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())  # (..., D)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
