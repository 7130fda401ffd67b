"""A product whose weight is stored int8 per output channel (convert/quantize.py, docs/quantize.md):
W[i, o] = s[o]·q[i, o], so

    y[o] = Σ_i x[i]·W[i, o] = s[o] · Σ_i x[i]·q[i, o]

explained in that order, as the int8 kernel computes it: the sum over the int8 values q, then
the output channel's scale s (then the bias, if any). Every operand names where it is stored:
q is the weight `*.weight` (whole numbers in [−127, 127]), s is `*.weight_scale`.
"""

from __future__ import annotations


def scale_name(weight: str) -> str:
    """Where the scales of a quantized weight are stored.

    >>> scale_name("blocks.0.attn.wq.weight")
    'blocks.0.attn.wq.weight_scale'
    """
    return weight + "_scale"


def is_quantized(ctx, weight: str) -> bool:
    """Whether the trace (or the model) holds scales for `weight`: then it is int8."""
    return ctx.has(scale_name(weight))


def product(ctx, label: str, xs: list[dict], weight: str, col: int, W: str, col_name, bias: list[list[dict]],
            x: str = "x", i: str = "i") -> int:
    """The steps of y[col] = s[col]·Σ_i x[i]·q[i, col] (+ b) over the operands xs; returns the last."""
    s = ctx.steps
    qs = [ctx.w(weight, [k, col], f"{W}.q[{k},{col_name}]") for k in range(len(xs))]
    dot = s.sum(f"Σ {x}·{W}.q[·,{col_name}]", f"Σ_{i} {x}[{i}]·q[{i},{col_name}] ({W} = s ⊙ q, q int8)",
                [[a, b] for a, b in zip(xs, qs)])
    scale = ctx.w(scale_name(weight), [col], f"{W}.s[{col_name}]")
    formula = f"s[{col_name}]·Σ_{i} {x}[{i}]·q[{i},{col_name}]" + (" + b" if bias else "")
    return s.sum(label, formula, [[scale, s.ref(dot)]] + bias, wide=False)
