"""The LM head over a padded vocabulary on a GPU.

cuBLAS serves a half-precision product whose output rows are not a multiple of 8 elements long with
slower, narrowly aligned kernels, and GPT-2's 50,257-token head is its model's largest product
(nanoGPT and llm.c pad that vocabulary to 50,304 for the same reason). Here the head multiplies a
zero-padded copy of its weight and drops the extra columns: the same logits and gradients, from an
aligned product; the weight keeps its shape. Only over many rows (training, long prompts): the copy
moves twice the weight's bytes, which a decode step's product (bound by reading the weight) would feel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .rows import RowsLinear

HEAD_PAD, HEAD_PAD_MIN_ROWS = 64, 4096


def pads_head(x: torch.Tensor, vocab_size: int) -> bool:
    """Whether the head's product runs over a vocabulary padded to a multiple of HEAD_PAD."""
    return x.is_cuda and vocab_size % HEAD_PAD != 0 and x.numel() >= HEAD_PAD_MIN_ROWS * x.shape[-1]


def head_logits(x: torch.Tensor, weight: torch.Tensor, pad: bool | None = None) -> torch.Tensor:
    """x (..., D) @ weight (V, D)^T -> logits (..., V). pad: force the padded product on or off."""
    V = weight.shape[0]
    if not (pads_head(x, V) if pad is None else pad):
        return F.linear(x, weight)
    padded = F.pad(weight, (0, 0, 0, -V % HEAD_PAD))  # (Vp, D), Vp a multiple of HEAD_PAD
    return F.linear(x, padded)[..., :V]  # (..., Vp) -> (..., V), a view


class PaddedHead(RowsLinear):
    """The LM head: a RowsLinear whose products over many rows on a GPU use the padded vocabulary."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and pads_head(x, self.out_features):
            return head_logits(x, self.weight, pad=True)  # (..., V)
        return super().forward(x)
