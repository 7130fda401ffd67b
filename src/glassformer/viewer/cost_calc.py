"""The calculation behind each cost figure the page lists: its formula, the formula with the
config's numbers put in, and the result, so a click on a cost shows how it was reached.

The formulas restate glassformer.cost for the case the page prices (B rows of T tokens, the
naive kernel's full grid for FLOPs; sums of parts list cost's own parts); tests/viewer checks
every result against `cost.estimate`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..config import ModelConfig

SYMBOLS = {  # symbol -> what it stands for
    "L": "layers", "D": "model width", "N": "query heads", "K": "KV heads", "H": "head size",
    "F": "feed-forward width", "V": "vocabulary", "S": "context (max_seq_len)", "B": "rows in the batch",
    "T": "tokens per row", "m": "feed-forward matrices (3 SwiGLU, 2 otherwise)", "b": "bytes per number",
    "g": "weights per norm (γ, and β with biases)", "E": "layers with a value embedding (value_embeddings)",
    "Ld": "layers with a dense feed-forward", "Lm": "layers with a mixture of experts", "Ex": "experts per mixture layer",
    "k": "experts each token is routed to", "Fe": "feed-forward width of one expert",
    "Fs": "feed-forward width of the shared experts together",
}


def _formulas(cfg: ModelConfig, r: dict) -> dict[str, str]:
    """key -> formula in the symbols above or in other keys' names (the terms a config lacks left out)."""
    from ..cost.params import ffn_bias, norms_per_block

    qkv_bias = cfg.bias or cfg.qkv_bias or cfg.attn_bias
    attn_bias = " + ".join(([("N·H + 2·K·H")] if qkv_bias else []) + (["D"] if cfg.bias or cfg.attn_bias else [])) or "0"
    two = "2·" if cfg.bias else ""  # a norm with biases holds β beside γ
    qk = {"head": f"L·{two}2·H", "proj": f"L·{two}(N·H + K·H)"}.get(cfg.qk_norm, "0")
    moe, fb = cfg.n_experts > 0, ffn_bias(cfg)
    dense = "Ld" if moe else "L"  # the layers a dense feed-forward is on
    parts = list(r["params_by_part"])
    ffn_flops = [f"2·{dense}·m·B·T·D·F"] if not moe or r["params_by_part"]["ffn"] else []
    if moe:
        ffn_flops += ["2·Lm·B·T·D·Ex", "2·Lm·k·m·B·T·D·Fe"] + (["2·Lm·m·B·T·D·Fs"] if cfg.n_shared_experts else [])
    per_token = [f"{dense}·m·D·F"] if not moe or r["params_by_part"]["ffn"] else []
    if moe:
        per_token.append("Lm·(D·Ex + k·m·D·Fe" + (" + m·D·Fs)" if cfg.n_shared_experts else ")"))
    crossover = ("ceil(m·D·F / (2·N·H))" if not moe
                 else f"ceil(({' + '.join(per_token)}) / (2·L·N·H))")
    f = {
        "params_by_part.embedding": "V·D",
        "params_by_part.positions": "S·D" if cfg.pos == "learned" else "0",
        "params_by_part.value_embeddings": "E·V·K·H",
        "params_by_part.attn_q": "L·D·N·H",
        "params_by_part.attn_k": "L·D·K·H",
        "params_by_part.attn_v": "L·D·K·H",
        "params_by_part.attn_o": "L·N·H·D",
        "params_by_part.attn_bias": f"L·({attn_bias})" if attn_bias != "0" else "0",
        "params_by_part.attn_sinks": "L·N" if cfg.attn_sinks else "0",
        "params_by_part.qk_norms": qk,
        "params_by_part.ffn": f"{dense}·m·D·F",
        "params_by_part.ffn_bias": f"{dense}·((m - 1)·F + D)" if fb else "0",
        "params_by_part.router": ("Lm·(Ex·D + Ex)" if cfg.ffn_bias else "Lm·Ex·D") if moe else "0",
        "params_by_part.experts": "Lm·Ex·m·D·Fe" if moe else "0",
        "params_by_part.experts_bias": "Lm·Ex·((m - 1)·Fe + D)" if moe and fb else "0",
        "params_by_part.shared_experts": (("Lm·(m·D·Fs + (m - 1)·Fs + D)" if fb else "Lm·m·D·Fs")
                                          if moe and cfg.n_shared_experts else "0"),
        "params_by_part.norms": "(L + 1)·g" if norms_per_block(cfg) == 1 else f"({norms_per_block(cfg)}·L + 1)·g",
        "params_by_part.lm_head": "0" if cfg.tie_embeddings else "V·D",
        "params": " + ".join(parts),
        "params_non_embedding": "params - embedding - positions",
        "flops_forward": " + ".join(["2·L·B·T·D·(N·H + 2·K·H)", "2·L·B·T·N·H·D", "2·(2·L·B·T·T·N·H)"] + ffn_flops
                                    + ["2·B·T·D·V"]),
        "flops_per_token": "flops_forward / (B·T)",
        "flops_train_step": "3·flops_forward",
        "crossover_seq": crossover,
        "activations": " + ".join(k for k in r["activations_by_part"] if k not in ("fp32", "mask_bytes")),
        "train_memory_bytes": " + ".join(r["train_memory_by_part"]),
        "kv_cache_bytes_per_token": "2·L·K·H·b",
        "kv_cache_numbers_per_token_per_layer": "2·K·H",
        "kv_cache_bytes": "B·T·2·L·K·H·b",
    }
    return f


def _values(cfg: ModelConfig, r: dict) -> dict[str, Any]:
    """Every name a formula may use, with its number."""
    from ..cost.memory import dtype_bytes
    from ..cost.params import ffn_matrices, moe_layers, norm_weights, shared_width

    inp = r["inputs"]
    v: dict[str, Any] = {
        "L": cfg.n_layers, "D": cfg.dim, "N": cfg.n_heads, "K": cfg.n_kv_heads, "H": cfg.head_dim,
        "F": cfg.ffn_dim, "V": cfg.vocab_size, "S": cfg.max_seq_len, "B": inp["batch"], "T": inp["seq"],
        "m": ffn_matrices(cfg), "b": dtype_bytes(inp["dtype"]), "g": norm_weights(cfg), "E": len(cfg.value_embed_layers),
        "params": r["params"], "flops_forward": r["flops_forward"],
        "Lm": len(moe_layers(cfg)), "Ld": cfg.n_layers - len(moe_layers(cfg)), "Ex": cfg.n_experts,
        "k": cfg.n_active_experts, "Fe": cfg.expert_width, "Fs": shared_width(cfg),
    }
    return v


def _parts(r: dict, key: str) -> dict[str, Any]:
    """The parts a sum-of-parts formula adds (each figure's parts have their own names)."""
    if key in ("params", "params_non_embedding"):
        return dict(r["params_by_part"])
    if key == "activations":
        return {k: x for k, x in r["activations_by_part"].items() if k not in ("fp32", "mask_bytes")}
    if key == "train_memory_bytes":
        return dict(r["train_memory_by_part"])
    return {}


def _pattern(names) -> re.Pattern:
    return re.compile(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")


def _evaluate(expr: str) -> float:
    # Our own formula strings with numbers put in: digits, + - * / ( ) and ceil only.
    py = expr.replace("·", "*")
    if not re.fullmatch(r"[0-9+\-*/(). ceil]*", py):
        raise ValueError(f"unexpected characters in a cost formula: {expr!r}")
    return eval(py, {"__builtins__": {}, "ceil": math.ceil})  # noqa: S307 (checked above)


def _plain(x: Any) -> str:
    return str(int(x)) if isinstance(x, int) or (isinstance(x, float) and x.is_integer()) else repr(x)


def cost_calc(key: str, formula: str, values: dict[str, Any], figure: Any, what: str = "") -> dict:
    """One cost figure's calculation, in the page's calculation format (title, text, operands,
    value = the figure from glassformer.cost, result = the formula evaluated)."""
    pat = _pattern(values)
    used = list(dict.fromkeys(pat.findall(formula)))
    filled = pat.sub(lambda mt: _plain(values[mt.group(1)]), formula)
    result = _evaluate(filled)
    if isinstance(result, float) and isinstance(figure, int) and result.is_integer():
        result = int(result)
    shown_result = f"{result:,}" if isinstance(result, int) else f"{result:.6g}"
    return {
        "title": f"{key} = {shown_result}", "key": key, "formula": formula,
        "substituted": filled, "value": figure, "result": result,
        "text": f"{key} = {formula}\n = {filled}\n = {shown_result}",
        "operands": [{"label": u, "source": "const", "value": values[u],
                      "what": SYMBOLS.get(u) or f"the cost figure {u}"} for u in used],
        **({"what": what} if what else {}),
    }


def figure(r: dict, key: str) -> Any:
    """A figure of the estimate by its dotted key ('params_by_part.ffn')."""
    x: Any = r
    for part in key.split("."):
        x = x[part]
    return x


def cost_calcs(cfg: ModelConfig, r: dict) -> dict[str, dict]:
    """key -> calculation, for every figure the page lists that has a formula here."""
    values = _values(cfg, r)
    out = {}
    for key, formula in _formulas(cfg, r).items():
        try:
            fig = figure(r, key)
        except (KeyError, TypeError):
            continue
        if fig is None:  # e.g. no crossover with a sliding window
            continue
        out[key] = cost_calc(key, formula, {**values, **_parts(r, key)}, fig)
    return out
