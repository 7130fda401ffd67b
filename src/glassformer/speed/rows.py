"""One-row products: what a batch-1 decode step spends most of its time on.

A decode step at batch 1 multiplies one row by every weight, so it is bound by how fast the weights
stream from memory. The library's product over one row runs on one thread (bench/matvec.py); here
the weight is held as a copy transposed to (in, out) and seen as one block of consecutive rows per
thread, (P, in/P, out), so that one batched product runs P partial products on P threads and their
sum is the row's product. The copy is rebuilt when the weight changes (its data pointer or version),
or when the thread count does.

The copy's sums run in another order than F.linear's, so its last bits differ: it is used only inside
`decoding()`, which a session enters for its eager decode steps, so that every other caller (the
explorer, traces, eval, prefill) gets the plain model's numbers whatever ran before on the model.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

_state = threading.local()  # per thread: the serve engine steps in its own thread beside the explorer's


@contextlib.contextmanager
def decoding():
    """Within it, on this thread, RowsLinear's eager one-row products read their row-block copies."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def one_row(x: torch.Tensor) -> bool:
    """x is one row for an inference product on the CPU (no gradient wanted)."""
    return x.numel() == x.shape[-1] and x.device.type == "cpu" and not torch.is_grad_enabled()


def row_blocks(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """(key, blocks, bias): the weight (out, in) transposed to (in, out) and seen as P blocks of
    in/P consecutive rows, (P, in/P, out), P the thread count (one block where in does not divide)."""
    P = torch.get_num_threads()
    key = (weight.data_ptr(), weight._version, P)  # _version counts in-place writes (an optimizer step)
    io = weight.detach().t().contiguous()  # (in, out)
    P = P if io.shape[0] % P == 0 else 1
    return key, io.view(P, io.shape[0] // P, io.shape[1]), None if bias is None else bias.detach()


def held_product(held: tuple, x: torch.Tensor) -> torch.Tensor:
    """x (..., in), one row, times a row_blocks copy: (..., out)."""
    _, blocks, bias = held
    P = blocks.shape[0]
    if P == 1:
        y = x.reshape(1, -1) @ blocks[0]  # (1, in) @ (in, out)
    else:  # one batched call, a block per thread
        y = torch.bmm(x.reshape(P, 1, -1), blocks).sum(0)  # (P, 1, out) partial sums -> (1, out)
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], -1)


class RowsLinear(nn.Linear):
    """nn.Linear whose one-row products read a faster layout of the weight (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_row(x):
            if torch.compiler.is_compiling():
                # (out, in) * (1, in) summed over in: inductor makes this one loop streaming the weight's
                # rows (bench/decode_parts.py), where its product template would call a one-row GEMM
                y = (self.weight * x.reshape(1, -1)).sum(-1)  # (out,)
                return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], -1)
            if getattr(_state, "on", False):
                return held_product(self.rows(), x)
        return F.linear(x, self.weight, self.bias)

    def rows(self) -> tuple:
        """The row-block copy of the weight as it is now (built on first use, rebuilt when stale)."""
        held = self.__dict__.get("held")
        w = self.weight
        if held is None or held[0] != (w.data_ptr(), w._version, torch.get_num_threads()):
            held = self.__dict__["held"] = row_blocks(w, self.bias)
        return held
