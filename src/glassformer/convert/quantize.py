"""int8 weights: per output channel, symmetric (scale = max|row| / 127, q = round(W / scale) in
[-127, 127]). A quantized projection is a module that replaces a model Linear from outside
model.py (the one weight-product seam); the embedding stays in floating point. docs/quantize.md."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

METHODS = ("int8",)
INT8 = {"method": "int8_weight_only", "granularity": "per_channel"}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what _weight_int8pack_mm takes for x
# torch's CPU int8 weight-only kernel takes time in proportion to the rows, where a product over
# a cast copy of q pays the cast once for all of them: past one row the cast is the faster way,
# and many rows (a prefill, an eval batch) are bound by arithmetic, not by reading the weight
# (bench/int8.py --products). So the kernel serves one-row products only: batch-1 decode steps,
# which must not copy the weight (on some CPUs the cast is faster even there; docs/benchmarks.md).
KERNEL_MAX_ROWS = 1


def check_method(name: str | None) -> str | None:
    """`--quantize`'s value, checked: None (float weights) or one of METHODS."""
    if name is not None and name not in METHODS:
        raise UserError(f"--quantize {name!r} is not supported; choose one of: {', '.join(METHODS)}")
    return name


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (q int8 (out, in), scale fp32 (out,)), W ≈ q · scale[:, None]; a zero row gets scale 1."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1)  # (out,)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., in) · (q · scale)^T -> (..., out), without an fp32 copy of the weight where it can be.

    Eagerly on the CPU at one row (a batch-1 decode step): torch's int8 weight-only kernel, which
    reads q as int8. Compiled: a cast of q to x's dtype, which inductor fuses into the product (at
    one row a multiply-and-sum over the rows, like speed.RowsLinear). Elsewhere (many rows, other
    devices or dtypes, gradients wanted) that cast runs eagerly, and makes a float copy of q."""
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES
            or x.numel() > KERNEL_MAX_ROWS * x.shape[-1] or (x.requires_grad and torch.is_grad_enabled())):
        s = scale.to(x.dtype)
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            return ((q.to(x.dtype) * x.reshape(1, -1)).sum(-1) * s).view(*x.shape[:-1], -1)
        return F.linear(x, q.to(x.dtype)) * s
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), q, scale.to(x.dtype))
    return y.view(*x.shape[:-1], -1)


class Int8Linear(nn.Module):
    """A projection with int8 weights per output channel: buffers `weight` (int8, (out, in)) and
    `weight_scale` (fp32, (out,)), and the float bias if the Linear had one."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "Int8Linear":
        w = lin.weight
        m = cls(lin.in_features, lin.out_features, lin.bias is not None, device=w.device)
        q, scale = int8_per_channel(w)
        m.weight, m.weight_scale = q, scale
        if lin.bias is not None:
            m.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        return m

    def _apply(self, fn, recurse=True):
        # The scales stay fp32 whatever .to() makes of the float weights (as the stored format
        # says): in bf16 they would keep 3 digits, a larger error than the int8 rounding itself.
        scale = self.weight_scale
        super()._apply(fn, recurse)
        if self.weight_scale.dtype != torch.float32:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def dequantized(self) -> torch.Tensor:
        """q · scale as a float (out, in) matrix: for explaining and testing, never on the decode path."""
        return self.weight.float() * self.weight_scale[:, None].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_product(x, self.weight, self.weight_scale)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _replace(parent: nn.Module, name: str) -> None:
    lin = getattr(parent, name, None)
    if isinstance(lin, nn.Linear):
        setattr(parent, name, Int8Linear.from_linear(lin))
    elif hasattr(lin, "lora_A"):  # a LoRA adapter (convert/lora.py): its base turns int8, the adapter stays float
        _replace(lin, "base")


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every block projection and an untied head by Int8Linear, in place; the embedding
    (and a tied head, which is the embedding) stays float. Records config.quantization. Works on
    the meta device too (the structure a quantized checkpoint loads into)."""
    for block in model.blocks:
        for part in (block.attn, block.ffn):
            for name in PROJECTIONS:
                _replace(part, name)
    if not model.config.tie_embeddings:
        _replace(model, "lm_head")
    model.config.quantization = dict(INT8)
    return model


def quantize(model: nn.Module, method: str | None) -> nn.Module:
    """The model with its weights stored as `method` (check_method), or as it is when None or
    when it already is."""
    if check_method(method) is None or model.config.quantization == INT8:
        return model
    return quantize_int8(model)


def quantize_stored(model: nn.Module, quantization: dict, where: str) -> nn.Module:
    """The structure a checkpoint whose config says `quantization` was stored from (on the meta device)."""
    if quantization != INT8:
        raise UserError(f"{where}: quantization {quantization} is not supported; this glassformer reads {INT8}")
    return quantize_int8(model)
