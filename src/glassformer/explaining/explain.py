"""How was this number computed? `explain(trace, probe, index)` answers with the calculation,
as data (steps over operands that name their probe or weight) and as text, e.g.
    q[cats][0] = Σ_i x[i]·W_Q[i,0] = 1·0 + 1·0 + (−1)·0 + (−1)·(−1) = 1
Every step recomputes from its operands to the traced value; wide sums show their largest
terms (docs/explain.md#explain-how-was-this-number-computed). The steps live in steps.py,
each probe's rule in rules.py; this module is the entry point.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from ..errors import UserError
from ..tracing.format import as_trace
from ..tracing.stream import stream_rms
from .rules import RULES, Context, rms_of_stream
from .steps import MAX_TERMS, POST, Explanation, Steps, fmt, operand, step_value  # noqa: F401  (re-exported)


# ----------------------------------------------------------------------------- entry point


def explain(trace, probe: str, index: Sequence[int] | int, model=None, *, max_terms: int = MAX_TERMS) -> Explanation:
    """The calculation of `trace`'s probe `probe` at `index` (the model's indices, token first).

    trace: a Trace, a parsed trace dict or a trace file's path. model: where weights come
    from when the trace has none (`with_weights`). Covers every probe of design.md.
    >>> t = trace(Transformer(ModelConfig.from_preset("tiny")), [0, 2, 3, 5], with_weights=True)
    >>> e = explain(t, "blocks.0.attn.q", (2, 0, 0))   # token 2, head 0, feature 0
    >>> e.result == e.steps[-1]["value"]
    True
    """
    tr = as_trace(trace)
    index = [int(index)] if isinstance(index, int) else [int(i) for i in index]
    leaf = probe.split(".")[-1]
    if probe.startswith("blocks."):
        parts = probe.split(".")
        # an expert's (ffn.experts.3.up) and the shared experts' (ffn.shared.up) probes follow the
        # feed-forward's own rules, which read the module from the probe's name
        leaf = re.sub(r"^ffn\.(experts\.\d+|shared)\.", "ffn.", ".".join(parts[2:]))
    rule = RULES.get(leaf)
    if rule is None:
        raise UserError(f"explain does not know probe {probe!r}; it explains: " + ", ".join(sorted(RULES)))
    p = tr.probe(probe)
    if len(index) != len(p.axes):
        raise UserError(f"{probe} has axes {p.axes}: give {len(p.axes)} indices, got {index}")
    value = tr.value(probe, index)
    ctx = Context(tr, model, Steps(max_terms))
    rule(ctx, probe, index)
    label = ctx.steps.steps[-1]["label"]
    return Explanation(probe, index, label, None if math.isnan(value) else value, ctx.steps.steps)


def explain_rms(trace, probe: str, token: int, model=None, *, max_terms: int = MAX_TERMS) -> Explanation:
    """The calculation of the RMS √(Σ_i x[i]²/D) of token `token`'s vector in `probe` (a stream
    probe: embed, resid_mid, resid_out, or a norm's output), as in glassformer.tracing.analysis.norm_rms.

    Its operands are the probe's numbers, each with its own calculation (`explain`).
    """
    tr = as_trace(trace)
    p = tr.probe(probe)
    if p.axes[0] != "token" or len(p.axes) != 2:
        raise UserError(f"the RMS of a stream needs a (token, feature) probe; {probe} has axes {p.axes}")
    t = int(token)
    if not 0 <= t < p.data.shape[0]:
        raise UserError(f"{probe} has {p.data.shape[0]} tokens; token {t} is out of range")
    value = float(stream_rms(p.data[t]))
    ctx = Context(tr, model, Steps(max_terms))
    rms_of_stream(ctx, probe, t)
    label = ctx.steps.steps[-1]["label"]
    return Explanation(f"rms:{probe}", [t], label, value, ctx.steps.steps)
