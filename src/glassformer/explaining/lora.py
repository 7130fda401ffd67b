"""A product with a LoRA adapter (convert/lora.py, docs/lora.md): the base's weight W plus the
adapter's A (in, r) and B (r, out) in math layout, the adapter scaled by α/r, so

    y[o] = Σ_i x[i]·W[i, o] + (α/r) · Σ_j u[j]·B[j, o],   u[j] = Σ_i x[i]·A[i, j]

explained in that order, as LoRALinear computes it: the base term (an int8 base as its scale
times the sum over q), the r sums u, the adapter term, then the two added (and the bias, if any).
The operands name the state dict's tensors: `*.base.weight`, `*.lora_A`, `*.lora_B`.
"""

from __future__ import annotations

from .quantized import is_quantized, product as quantized_product
from .steps import operand


def names(weight: str) -> tuple[str, str, str, str]:
    """(base weight, A, B, base bias) of the adapted product whose plain weight is `weight`.

    >>> names("blocks.0.attn.wq.weight")[:3]
    ('blocks.0.attn.wq.base.weight', 'blocks.0.attn.wq.lora_A', 'blocks.0.attn.wq.lora_B')
    """
    prefix = weight[: -len(".weight")]
    return prefix + ".base.weight", prefix + ".lora_A", prefix + ".lora_B", prefix + ".base.bias"


def is_adapted(ctx, weight: str) -> bool:
    """Whether the trace (or the model) holds an adapter for the product of `weight`."""
    return weight.endswith(".weight") and ctx.has(names(weight)[1])


def rank_and_scale(ctx, weight: str) -> tuple[int, float]:
    """(r, α/r): from the trace's `lora` (written for an adapted model), else the model's module."""
    lora = ctx.tr.lora
    if lora:
        return int(lora["r"]), float(lora["alpha"]) / int(lora["r"])
    m = ctx.model.get_submodule(weight[: -len(".weight")])
    return m.r, m.scale


def product(ctx, label: str, xs: list[dict], weight: str, col: int, W: str, col_name, x: str = "x",
            i: str = "i") -> int:
    """The steps of y[col] = x·W[·,col] + (α/r)·Σ_j u[j]·B[j,col] (+ b) over the operands xs; returns the last."""
    s = ctx.steps
    base_w, A, B, bias = names(weight)
    b = [[ctx.w(bias, [col], f"b[{col}]")]] if ctx.has(bias) else []
    base_label = f"{x}·{W}[·,{col_name}]"
    if is_quantized(ctx, base_w):
        base = quantized_product(ctx, base_label, xs, base_w, col, W, col_name, [], x, i)
    else:
        terms = [[xk, ctx.w(base_w, [k, col], f"{W}[{k},{col_name}]")] for k, xk in enumerate(xs)]
        base = s.sum(base_label, f"Σ_{i} {x}[{i}]·{W}[{i},{col_name}] (the base term)", terms)
    r, scale = rank_and_scale(ctx, weight)
    us = [s.sum(f"u[{j}]", f"Σ_{i} {x}[{i}]·A[{i},{j}]",
                [[xk, ctx.w(A, [k, j], f"{W}.A[{k},{j}]")] for k, xk in enumerate(xs)]) for j in range(r)]
    adapter = s.sum(f"u·{W}.B[·,{col_name}]", f"Σ_j u[j]·B[j,{col_name}] (the adapter term)",
                    [[s.ref(u), ctx.w(B, [j, col], f"{W}.B[{j},{col_name}]")] for j, u in enumerate(us)])
    formula = f"Σ_{i} {x}[{i}]·{W}[{i},{col_name}] + (α/r)·Σ_j u[j]·B[j,{col_name}]" + (" + b" if b else "")
    return s.sum(label, formula, [[s.ref(base)], [operand("α/r", scale), s.ref(adapter)]] + b, wide=False)
