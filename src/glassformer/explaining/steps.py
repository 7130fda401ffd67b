"""The steps of a calculation: numbers as text, operands, steps that recompute themselves.

An explanation (glassformer.explain) is a list of steps, each an operation over operands
that name the probe or weight they come from; `step_value` recomputes a step from its
operands (docs/trace-format.md, "explain results"). The rules that build the steps of each
probe are in rules.py; the entry point is explain.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TERMS = 8


# ----------------------------------------------------------------------------- numbers as text


def fmt(x: float | None, digits: int = 4) -> str:
    """A number the way the walkthrough prints it: 4 significant digits, a real minus sign.

    >>> fmt(-0.49312), fmt(1.0), fmt(2e-7)
    ('−0.4931', '1', '2e−07')
    """
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "masked"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    s = f"%.{digits}g" % x
    if s in ("-0", "0"):
        s = "0"
    return s.replace("-", "−")


def _factor_text(v: float) -> str:
    s = fmt(v)
    return f"({s})" if s.startswith("−") else s


# ----------------------------------------------------------------------------- data


def operand(label: str, value: float, source: str = "const", name: str | None = None, index=None, power: int = 1) -> dict:
    """One number a step uses: from a probe, a weight, an earlier step, or a constant."""
    d = {"label": label, "source": source, "name": name, "index": None if index is None else [int(i) for i in index],
         "value": float(value)}
    if power != 1:
        d["power"] = power
    return d


def step_value(step: dict) -> float | None:
    """Recompute a step from its operands (the rule table of docs/trace-format.md), in float64."""
    op = step["op"]
    rest = step.get("rest") or {}
    if op == "masked":
        return None
    if op == "sum":
        total = sum(math.prod(o["value"] ** o.get("power", 1) for o in t) for t in step["terms"])
        total += rest.get("value", 0.0)
        if step.get("post") == "clamp":  # min(max(total, lo), hi); a bound of None is open
            lo, hi = step["bounds"]
            return min(max(total, -math.inf if lo is None else lo), math.inf if hi is None else hi)
        return POST[step.get("post")](total)
    if op == "argmax":  # which entry is the largest: its id (a router's top-k pick)
        vals = [o["value"] for o in step["over"]]
        return float(step["ids"][vals.index(max(vals))])
    if op == "max":
        vals = [o["value"] for o in step["over"]] + ([rest["value"]] if rest else [])
        return max(vals)
    if op == "softmax":
        m = step["max"]
        den = sum(math.exp(o["value"] - m) for o in step["over"]) + rest.get("value", 0.0)
        return math.exp(step["target"]["value"] - m) / den
    raise ValueError(f"unknown step op {op!r}")


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


POST = {
    None: lambda x: x,
    "sqrt": math.sqrt,
    "relu": lambda x: max(x, 0.0),
    "relu2": lambda x: max(x, 0.0) ** 2,
    "tanh": math.tanh,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": lambda x: x / (1.0 + math.exp(-x)) if x > -700 else 0.0,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0,
    "exp": math.exp,
}


@dataclass
class Explanation:
    """The calculation of one traced number: steps (data) and their text."""

    probe: str
    index: list[int]
    label: str
    value: float | None  # the traced value (None for a masked cell)
    steps: list[dict] = field(default_factory=list)

    @property
    def result(self) -> float | None:
        """The last step recomputed from its operands."""
        return self.steps[-1]["value"] if self.steps else None

    @property
    def text(self) -> str:
        return "\n".join(s["text"] for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"probe": self.probe, "index": self.index, "label": self.label, "value": self.value,
                "result": self.result, "steps": self.steps, "text": self.text}

    def __str__(self) -> str:
        return self.text


class Steps:
    """Builds an explanation step by step; each step is recomputed from its operands as it is added."""

    def __init__(self, max_terms: int):
        self.max_terms = max_terms
        self.steps: list[dict] = []

    def ref(self, k: int, label: str | None = None, power: int = 1) -> dict:
        s = self.steps[k]
        return operand(label or s["label"], s["value"], "step", None, [k], power)

    def sum(self, label: str, formula: str, terms: list[list[dict]], post: str | None = None,
            wide: bool = True, fixed: list[list[dict]] = ()) -> int:
        """A sum of products, post(Σ Π); when wide, only the largest max_terms products are listed.

        `fixed` terms (ε, −μ²) are always listed, after the others.
        """
        rest = None
        if wide and len(terms) > self.max_terms:
            prods = [abs(math.prod(o["value"] ** o.get("power", 1) for o in t)) for t in terms]
            keep = sorted(sorted(range(len(terms)), key=lambda i: -prods[i])[: self.max_terms])
            kept = set(keep)
            others = [t for i, t in enumerate(terms) if i not in kept]
            rest = {"count": len(others),
                    "value": sum(math.prod(o["value"] ** o.get("power", 1) for o in t) for t in others)}
            terms = [terms[i] for i in keep]
        terms = list(terms) + list(fixed)
        step = {"label": label, "op": "sum", "post": post, "formula": formula, "terms": terms, "rest": rest}
        step["value"] = step_value(step)
        body = " + ".join(_term_text(t) for t in terms)
        if rest:
            body += f" + [{rest['count']} smaller terms: {fmt(rest['value'])}]"
        if post:
            inner = fmt(terms[0][0]["value"]) if len(terms) == 1 and len(terms[0]) == 1 and not rest else body
            body = f"{post}({inner})"
        step["text"] = f"{label} = {formula} = {body} = {fmt(step['value'])}"
        return self._add(step)

    def clamp(self, label: str, x: dict, lo: float | None, hi: float | None) -> int:
        """min(max(x, lo), hi): a value held inside [lo, hi] (gpt-oss's clamped SwiGLU); None: no bound."""
        bounds = ", ".join("−∞" if b is None and k == 0 else "∞" if b is None else fmt(b) for k, b in enumerate((lo, hi)))
        step = {"label": label, "op": "sum", "post": "clamp", "bounds": [lo, hi], "formula": f"clamp(x, {bounds})",
                "terms": [[x]], "rest": None}
        step["value"] = step_value(step)
        step["text"] = f"{label} = clamp({fmt(x['value'])}, {bounds}) = {fmt(step['value'])}"
        return self._add(step)

    def argmax(self, label: str, over: list[dict], ids: list[int], formula: str) -> int:
        """The id of the largest of `over` (ids[i] names over[i]): which expert a router picks."""
        step = {"label": label, "op": "argmax", "formula": formula, "over": list(over), "ids": [int(i) for i in ids]}
        step["value"] = step_value(step)
        best = step["ids"].index(int(step["value"]))
        shown = ", ".join(f"{i}: {fmt(o['value'])}" for i, o in zip(step["ids"], over))
        step["text"] = f"{label} = {formula} = argmax({shown}) = {int(step['value'])} ({fmt(over[best]['value'])})"
        return self._add(step)

    def max(self, label: str, over: list[dict]) -> int:
        rest = None
        if len(over) > self.max_terms:
            order = sorted(range(len(over)), key=lambda i: -over[i]["value"])
            rest = {"count": len(over) - self.max_terms, "value": over[order[self.max_terms]]["value"]}
            over = [over[i] for i in sorted(order[: self.max_terms])]
        step = {"label": label, "op": "max", "formula": "max_j", "over": over, "rest": rest}
        step["value"] = step_value(step)
        more = f", … {rest['count']} more" if rest else ""
        step["text"] = f"{label} = max({', '.join(fmt(o['value']) for o in over)}{more}) = {fmt(step['value'])}"
        return self._add(step)

    def softmax(self, label: str, target: dict, over: list[dict], m: float, formula: str,
                rest_value: float | None = None, rest_count: int = 0, note: str = "") -> int:
        """exp(target − m) / Σ exp(o − m); when wide, the largest exps are listed and the rest summed."""
        rest = None
        if len(over) > self.max_terms:
            order = sorted(range(len(over)), key=lambda i: -over[i]["value"])
            keep = set(order[: self.max_terms - 1])
            keep.add(next(i for i, o in enumerate(over) if o is target))
            extra = [o for i, o in enumerate(over) if i not in keep]
            rest = {"count": len(extra), "value": sum(math.exp(o["value"] - m) for o in extra)}
            over = [o for i, o in enumerate(over) if i in keep]
        if rest_value is not None:  # entries that are not in the trace (top-k logits)
            rest = {"count": (rest or {}).get("count", 0) + rest_count,
                    "value": (rest or {}).get("value", 0.0) + rest_value}
        step = {"label": label, "op": "softmax", "formula": formula, "target": target, "over": over,
                "max": m, "rest": rest}
        step["value"] = step_value(step)
        den = " + ".join(f"exp({fmt(o['value'])} − {fmt(m)})" for o in over)
        if rest:
            den += f" + [{rest['count']} more: {fmt(rest['value'])}]"
        step["text"] = (f"{label} = {formula} = exp({fmt(target['value'])} − {fmt(m)}) / ({den}) "
                        f"= {fmt(step['value'])}{note}")
        return self._add(step)

    def masked(self, label: str, reason: str) -> int:
        return self._add({"label": label, "op": "masked", "formula": "masked", "reason": reason, "value": None,
                          "text": f"{label} = masked: {reason} (weight 0, shown as null)"})

    def _add(self, step: dict) -> int:
        self.steps.append(step)
        return len(self.steps) - 1


def _term_text(t: list[dict]) -> str:
    """'a·b', with a repeated factor as a square and a factor of power −1 as a division."""
    s, k = "", 0
    while k < len(t):
        o = t[k]
        if o.get("power", 1) == -1:
            s += "/" + _factor_text(o["value"])
        elif k + 1 < len(t) and t[k + 1] is o:
            s += ("·" if k else "") + _factor_text(o["value"]) + "²"
            k += 1
        else:
            s += ("·" if k else "") + _factor_text(o["value"])
        k += 1
    return s
