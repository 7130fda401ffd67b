"""One-row products in a compiled decode step.

A decode step at batch 1 multiplies one row by every weight, so it is bound by how fast the weights
stream from memory. Compiled, the library's product template would call a one-row GEMM; written as
a multiply-and-sum over the weight's (out, in) rows, inductor makes it one loop that streams the
weight once, with the bias and the next ops fused around it: a compiled decode step on the
reference shape ran 1.14x faster this way (bench/speed_compiled.py, docs/architecture.md#speed).

Eagerly the product stays F.linear, to the bit: row-block copies of the weights (one block per
thread, partial products summed) used to serve eager one-row products, but on torch 2.13 they ran
at 0.83x the plain model's decode speed at 2 threads and equal at 1 (timed by hand at 34d0aed), so the
plain product is what runs, and a session's numbers are the plain model's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def one_row(x: torch.Tensor) -> bool:
    """x is one row for an inference product on the CPU (no gradient wanted)."""
    return x.numel() == x.shape[-1] and x.device.type == "cpu" and not torch.is_grad_enabled()


class RowsLinear(nn.Linear):
    """nn.Linear whose one-row products, when compiled on a CPU, are a multiply-and-sum over its rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and one_row(x):
            y = (self.weight * x.reshape(1, -1)).sum(-1)  # (out, in) * (1, in) summed over in -> (out,)
            return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)
