"""The rule for each probe: which operands make it, and how (used by glassformer.explain).
Each rule adds steps to ctx.steps, the last the explained number, following model.py for pre-
and post-norm; the stream wiring comes from probes.STREAM_WIRING (docs/trace-format.md#probe-entries):
    x → (norm) → q,k,v → q_rot,k_rot → scores → weights → z → out;  resid_mid = x + out
    mid → (norm) → up,gate → act → down;  resid_out = mid + down
The speedrun switches (docs/model.md#speedrun-switches) add q_norm,k_norm between q,k and their
rotation (qk_norm), ve into v (value_embeddings), and head.uncapped before logits (logit_softcap).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import UserError
from ..probes import final_norm_reads, stream_probes
from ..tracing.trace import weight_matrix
from . import lora, quantized
from .steps import Steps, fmt, operand

_SYMBOL = {"attn.out": "attn_out", "attn.scores": "s", "attn.weights": "w", "logits": "logit", "probs": "p",
           "ffn.up": "up", "ffn.gate": "gate", "ffn.act": "act", "ffn.down": "down", "head.uncapped": "raw"}


class Context:
    """The trace (and model) that a rule reads, with labelled operands."""

    def __init__(self, tr, model, steps: Steps):
        self.tr, self.model, self.steps = tr, model, steps
        self.cfg = tr.config
        self.H = int(self.cfg["head_dim"])
        self.n_rep = int(self.cfg["n_heads"]) // int(self.cfg["n_kv_heads"])
        self._weights: dict = {}
        names = [_clean(s) for s in tr.tokens]
        self.names = [n if names.count(n) == 1 and n else (f"{n}@{t}" if n else f"#{t}") for t, n in enumerate(names)]

    # ---- labels ---------------------------------------------------------------------
    def vocab(self, v: int) -> str:
        for t, i in enumerate(self.tr.ids):
            if i == v:
                return self.names[t].split("@")[0]
        return f"#{v}"

    def lab(self, probe: str, idx) -> str:
        parts = probe.split(".")
        layer, leaf = (parts[1], ".".join(parts[2:])) if parts[0] == "blocks" else (None, probe)
        sym = _SYMBOL.get(leaf, leaf.split(".")[-1])
        if layer is not None and int(self.cfg["n_layers"]) > 1:
            sym = f"L{layer}.{sym}"
        axes = self.tr.probe(probe).axes if probe in self.tr.probes else ["token"] + ["feature"] * (len(idx) - 1)
        out = sym
        for axis, i in zip(axes, idx):
            if axis in ("token", "key"):
                out += f"[{self.names[i]}]"
            elif axis == "head":
                out += f"[h{i}]" if int(self.cfg["n_heads"]) > 1 else ""
            elif axis == "kv_head":
                out += f"[kv{i}]" if int(self.cfg["n_kv_heads"]) > 1 else ""
            elif axis == "vocab":
                out += f"[{self.vocab(i)}]"
            else:
                out += f"[{i}]"
        return out

    # ---- operands -------------------------------------------------------------------
    def p(self, probe: str, idx) -> dict:
        return operand(self.lab(probe, idx), self.tr.value(probe, idx), "probe", probe, idx)

    def w(self, name: str, idx, label: str) -> dict:
        if self.tr.has_weight(name):
            return operand(label, self.tr.weight_value(name, idx), "weight", name, idx)
        if self.model is None:
            raise UserError(f"this calculation needs the weight {name}, which the trace does not hold: "
                            "trace with --with-weights (with_weights=True) or pass model=")
        if name not in self._weights:
            sd = self.model.state_dict()
            if name not in sd and name != "lm_head.weight":
                raise UserError(f"the model has no weight {name}")
            self._weights[name] = weight_matrix(self.model, name)
        return operand(label, float(self._weights[name][tuple(idx)]), "weight", name, idx)

    def has(self, name: str) -> bool:
        if self.tr.has_weight(name):
            return True
        return self.model is not None and name in self.model.state_dict()

    # ---- where each tensor comes from ------------------------------------------------
    def wire(self, i: int) -> dict[str, str]:
        """Block i's stream wiring for this trace's norm placement (probes.stream_probes)."""
        return stream_probes(i, self.cfg["norm_placement"], self.cfg.get("ffn", "swiglu"))

    def block_input(self, i: int) -> str:
        return self.wire(i)["in"]

    def attn_input(self, i: int) -> str:
        return self.wire(i)["attn_reads"]

    def ffn_input(self, i: int) -> str:
        return self.wire(i)["ffn_reads"]


def _clean(tok: str) -> str:
    return tok.replace("Ġ", " ").replace("▁", " ").strip()


def _layer(probe: str) -> int:
    return int(probe.split(".")[1])


# ----------------------------------------------------------------------------- rules


def product(ctx: Context, label: str, xs: list[dict], wname: str, col: int, W: str, col_name=None, bias: str = "",
            x: str = "x", i: str = "i") -> None:
    """y[col] = Σ_i x[i]·W[i,col] (+ b) over the operands xs; an int8 weight as its scale times q
    (quantized.py). col_name: how the column reads in labels (a vocabulary entry's text)."""
    col_name = col if col_name is None else col_name
    if lora.is_adapted(ctx, wname):  # base term + (α/r)·adapter term (lora.py)
        lora.product(ctx, label, xs, wname, col, W, col_name, x, i)
        return
    b = [[ctx.w(bias, [col], f"b[{col}]")]] if bias and ctx.has(bias) else []
    if quantized.is_quantized(ctx, wname):
        quantized.product(ctx, label, xs, wname, col, W, col_name, b, x, i)
        return
    terms = [[xk, ctx.w(wname, [k, col], f"{W}[{k},{col_name}]")] for k, xk in enumerate(xs)]
    ctx.steps.sum(label, f"Σ_{i} {x}[{i}]·{W}[{i},{col_name}]" + (" + b" if b else ""), terms + b)


def linear(ctx: Context, label: str, x_probe: str, t: int, width: int, wname: str, col: int, W: str, bias: str):
    product(ctx, label, [ctx.p(x_probe, [t, i]) for i in range(width)], wname, col, W, bias=bias)


def rule_embed(ctx, probe, idx):
    t, j = idx
    tok = ctx.tr.ids[t]
    terms = [[ctx.w("embed.weight", [tok, j], f"E[{ctx.names[t]}][{j}]")]]
    formula = f"E[{ctx.names[t]}][{j}]"
    if ctx.cfg["pos"] == "learned":
        p = ctx.tr.positions[t]
        terms.append([ctx.w("pos_embed.weight", [p, j], f"P[{p}][{j}]")])
        formula += f" + P[{p}][{j}]"
    ctx.steps.sum(ctx.lab(probe, idx), formula, terms, wide=False)


def rms_of_stream(ctx: Context, probe: str, t: int) -> None:
    """RMS √(Σ_i x[i]²/D) of token t's stream vector `probe` (no ε: the stream itself, as
    glassformer.tracing.analysis.norm_rms measures it, not a norm's denominator)."""
    D = int(ctx.tr.probe(probe).data.shape[-1])
    xs = [ctx.p(probe, [t, i]) for i in range(D)]
    inv_d = operand("D", D, power=-1)
    ctx.steps.sum(f"RMS({ctx.lab(probe, [t])})", "√(Σ_i x[i]²/D)", [[x, x, inv_d] for x in xs], post="sqrt")


def norm(ctx: Context, probe: str, idx, x_probe: str, wname: str):
    """RMSNorm: x[j] / √(mean(x²) + ε) · γ[j]; LayerNorm: (x[j] − μ) / √(var + ε) · γ[j] + β[j]."""
    t, j = idx
    D = int(ctx.cfg["dim"])
    eps = float(ctx.cfg["norm_eps"])
    s = ctx.steps
    xs = [ctx.p(x_probe, [t, i]) for i in range(D)]
    inv_d = operand("D", D, power=-1)
    eps_op = operand("ε", eps)
    gamma = ctx.w(wname + ".weight", [j], f"γ[{j}]")
    bname = wname + ".bias"
    beta = [[ctx.w(bname, [j], f"β[{j}]")]] if ctx.has(bname) else []
    row = ctx.lab(x_probe, [t])  # e.g. resid_mid[cats]: whose RMS
    if ctx.cfg["norm"] == "rms":
        r = s.sum(f"RMS({row})", "√(Σ_i x[i]²/D + ε)", [[x, x, inv_d] for x in xs], post="sqrt", fixed=[[eps_op]])
        s.sum(ctx.lab(probe, idx), f"x[{j}] / RMS · γ[{j}]" + (" + β" if beta else ""),
              [[xs[j], s.ref(r, power=-1), gamma]] + beta, wide=False)
        return
    mu = s.sum(f"μ({row})", "Σ_i x[i]/D", [[x, inv_d] for x in xs])
    m = s.ref(mu)
    sd = s.sum(f"σ({row})", "√(Σ_i x[i]²/D − μ² + ε)", [[x, x, inv_d] for x in xs], post="sqrt",
               fixed=[[m, m, operand("−1", -1.0)], [eps_op]])
    inv = s.ref(sd, power=-1)
    s.sum(ctx.lab(probe, idx), f"(x[{j}] − μ) / σ · γ[{j}]" + (" + β" if beta else ""),
          [[xs[j], inv, gamma], [m, operand("−1", -1.0), inv, gamma]] + beta, wide=False)


def rule_attn_norm(ctx, probe, idx):
    i = _layer(probe)
    x = ctx.wire(i)["attn_norm_reads"]
    norm(ctx, probe, idx, x, f"blocks.{i}.attn_norm")


def rule_ffn_norm(ctx, probe, idx):
    i = _layer(probe)
    x = ctx.wire(i)["ffn_norm_reads"]
    norm(ctx, probe, idx, x, f"blocks.{i}.ffn_norm")


def rule_final_norm(ctx, probe, idx):
    x = final_norm_reads(int(ctx.cfg["n_layers"]), ctx.cfg["norm_placement"], ctx.cfg.get("ffn", "swiglu"))
    norm(ctx, probe, idx, x, "final_norm")


def _qkv(which: str, W: str):
    def rule(ctx, probe, idx):
        i = _layer(probe)
        t, h, j = idx
        label = ctx.lab(probe, idx)
        ve = f"blocks.{i}.attn.ve"
        with_ve = which == "wv" and ve in ctx.tr.probes
        if with_ve:  # v = x·W_V + ve: the product first, then the value embedding's row added
            label = f"x·W_V{label[len(ctx.lab(probe, [])):]}"
        linear(ctx, label, ctx.attn_input(i), t, int(ctx.cfg["dim"]),
               f"blocks.{i}.attn.{which}.weight", h * ctx.H + j, W, f"blocks.{i}.attn.{which}.bias")
        if with_ve:
            s = ctx.steps
            s.sum(ctx.lab(probe, idx), "x·W_V + ve", [[s.ref(len(s.steps) - 1)], [ctx.p(ve, idx)]], wide=False)
    return rule


def rule_ve(ctx, probe, idx):
    """A value embedding: the token's row of layer i's table, at kv head h's feature j."""
    i = _layer(probe)
    t, h, j = idx
    c = h * ctx.H + j
    ctx.steps.sum(ctx.lab(probe, idx), f"E_ve[{ctx.names[t]}][{c}]",
                  [[ctx.w(f"blocks.{i}.attn.ve.weight", [ctx.tr.ids[t], c], f"E_ve[{ctx.names[t]}][{c}]")]], wide=False)


def rule_qk_norm(ctx, probe, idx):
    """QK norm: q[j] / √(Σ_d q[d]²/H + ε) over the head's H features, no weight (model.head_rms_norm)."""
    t, h, j = idx
    src = probe[: -len("_norm")]  # blocks.i.attn.q or .k
    s = ctx.steps
    xs = [ctx.p(src, [t, h, d]) for d in range(ctx.H)]
    inv_h = operand("H", ctx.H, power=-1)
    r = s.sum(f"RMS({ctx.lab(src, [t, h])})", "√(Σ_d x[d]²/H + ε)", [[x, x, inv_h] for x in xs], post="sqrt",
              fixed=[[operand("ε", float(ctx.cfg["norm_eps"]))]])
    s.sum(ctx.lab(probe, idx), f"x[{j}] / RMS", [[xs[j], s.ref(r, power=-1)]], wide=False)


def rule_rope(ctx, probe, idx):
    t, h, j = idx
    src = probe[: -len("_rot")]  # blocks.i.attn.q or .k
    if ctx.cfg.get("qk_norm"):  # the rotation turns the normalised q, k
        src += "_norm"
    half = ctx.H // 2
    if ctx.cfg["rope_pairs"] == "half":
        p, ia, ib, first = j % half, j % half, j % half + half, j < half
    else:
        p, ia, ib, first = j // 2, j - j % 2, j - j % 2 + 1, j % 2 == 0
    if ctx.tr.rope_inv_freq is None:
        raise UserError("the trace has no rope_inv_freq: it was not written by glassformer.trace")
    omega = float(ctx.tr.rope_inv_freq[p])
    pos = ctx.tr.positions[t]
    s = ctx.steps
    th = s.sum(f"θ[{ctx.names[t]}][pair {p}]", f"position·ω[{p}]", [[operand("position", pos), operand(f"ω[{p}]", omega)]],
               wide=False)
    # The model forms the angle in float32; cos and sin are taken of that same angle.
    angle = float(np.float32(pos) * np.float32(omega))
    cos, sin = operand("cos θ", math.cos(angle)), operand("sin θ", math.sin(angle))
    a, b = ctx.p(src, [t, h, ia]), ctx.p(src, [t, h, ib])
    sym = "q" if src.rsplit(".", 1)[-1].startswith("q") else "k"
    if first:
        # The minus belongs to sin θ: one factor −sin θ, not sin θ times a separate −1.
        s.sum(ctx.lab(probe, idx), f"{sym}[{ia}]·cos θ + {sym}[{ib}]·(−sin θ)",
              [[a, cos], [b, operand("−sin θ", -sin["value"])]], wide=False)
    else:
        s.sum(ctx.lab(probe, idx), f"{sym}[{ia}]·sin θ + {sym}[{ib}]·cos θ", [[a, sin], [b, cos]], wide=False)
    s.steps[th]["text"] += f" rad (cos θ = {fmt(cos['value'])}, sin θ = {fmt(sin['value'])})"


def _qk(ctx, i):
    if ctx.cfg["pos"] == "rope":
        return f"blocks.{i}.attn.q_rot", f"blocks.{i}.attn.k_rot"
    if ctx.cfg.get("qk_norm"):
        return f"blocks.{i}.attn.q_norm", f"blocks.{i}.attn.k_norm"
    return f"blocks.{i}.attn.q", f"blocks.{i}.attn.k"


def rule_scores(ctx, probe, idx):
    i = _layer(probe)
    t, h, j = idx
    qn, kn = _qk(ctx, i)
    kv = h // ctx.n_rep
    s = ctx.steps
    terms = [[ctx.p(qn, [t, h, d]), ctx.p(kn, [j, kv, d])] for d in range(ctx.H)]
    dot = s.sum(f"q·k[{ctx.names[t]}][{ctx.names[j]}]", "Σ_d q[d]·k[d]", terms)
    s.sum(ctx.lab(probe, idx), "(q·k) · 1/√H", [[s.ref(dot), operand("1/√H", 1.0 / math.sqrt(ctx.H))]], wide=False)


def _readable(ctx, i, t, h):
    """Keys that query t of head h may read: the cells of .weights that are not null."""
    w = f"blocks.{i}.attn.weights"
    return [k for k in range(ctx.tr.probe(w).data.shape[-1]) if not math.isnan(ctx.tr.value(w, [t, h, k]))]


def rule_weights(ctx, probe, idx):
    i = _layer(probe)
    t, h, j = idx
    sp = f"blocks.{i}.attn.scores"
    ok = _readable(ctx, i, t, h)
    if j not in ok:
        qp = ctx.tr.positions[t]
        why = (f"key {ctx.names[j]} (index {j}) comes after query {ctx.names[t]} (position {qp})" if j > qp
               else f"key {ctx.names[j]} is outside the sliding window of {ctx.cfg['sliding_window']}")
        ctx.steps.masked(ctx.lab(probe, idx), why)
        return
    over = [ctx.p(sp, [t, h, k]) for k in ok]
    s = ctx.steps
    m = s.max(f"m[{ctx.names[t]}]", over)
    hidden = len(ctx.tr.probe(sp).data[0, 0]) - len(ok)
    note = f"  ({hidden} masked key{'s get' if hidden > 1 else ' gets'} weight 0)" if hidden else ""
    s.softmax(ctx.lab(probe, idx), over[ok.index(j)], over, s.steps[m]["value"],
              "exp(s[j] − m) / Σ_k exp(s[k] − m)", note=note)


def rule_z(ctx, probe, idx):
    i = _layer(probe)
    t, h, j = idx
    kv = h // ctx.n_rep
    ok = _readable(ctx, i, t, h)
    terms = [[ctx.p(f"blocks.{i}.attn.weights", [t, h, k]), ctx.p(f"blocks.{i}.attn.v", [k, kv, j])] for k in ok]
    ctx.steps.sum(ctx.lab(probe, idx), f"Σ_k w[k]·v[k][{j}]", terms)


def rule_out(ctx, probe, idx):
    i = _layer(probe)
    t, d = idx
    H, N = ctx.H, int(ctx.cfg["n_heads"])
    z = f"blocks.{i}.attn.z"
    zs = [ctx.p(z, [t, c // H, c % H]) for c in range(N * H)]
    product(ctx, ctx.lab(probe, idx), zs, f"blocks.{i}.attn.wo.weight", d, "W_O", bias=f"blocks.{i}.attn.wo.bias",
            x="z", i="c")


def rule_resid_mid(ctx, probe, idx):
    i = _layer(probe)
    x, a = ctx.p(ctx.block_input(i), idx), ctx.p(f"blocks.{i}.attn.out", idx)
    ctx.steps.sum(ctx.lab(probe, idx), "x + attn_out", [[x], [a]], wide=False)


def rule_resid_out(ctx, probe, idx):
    i = _layer(probe)
    h = ctx.p(ctx.wire(i)["mid"], idx)
    ctx.steps.sum(ctx.lab(probe, idx), "h + down", [[h], [ctx.p(f"blocks.{i}.ffn.down", idx)]], wide=False)


def _ffn_in(which: str, W: str):
    def rule(ctx, probe, idx):
        i = _layer(probe)
        t, f = idx
        linear(ctx, ctx.lab(probe, idx), ctx.ffn_input(i), t, int(ctx.cfg["dim"]),
               f"blocks.{i}.ffn.{which}.weight", f, W, f"blocks.{i}.ffn.{which}.bias")
    return rule


def rule_act(ctx, probe, idx):
    i = _layer(probe)
    kind = ctx.cfg["ffn"]
    up = ctx.p(f"blocks.{i}.ffn.up", idx)
    s = ctx.steps
    if kind == "swiglu":
        g = s.sum(f"silu(gate[{ctx.names[idx[0]]}][{idx[1]}])", "gate·σ(gate)",
                  [[ctx.p(f"blocks.{i}.ffn.gate", idx)]], post="silu", wide=False)
        s.sum(ctx.lab(probe, idx), "silu(gate)·up", [[s.ref(g), up]], wide=False)
    elif kind == "relu2":
        s.sum(ctx.lab(probe, idx), "relu(up)²", [[up]], post="relu2", wide=False)
    else:
        s.sum(ctx.lab(probe, idx), f"{kind}(up)", [[up]], post=kind, wide=False)


def rule_down(ctx, probe, idx):
    i = _layer(probe)
    t, d = idx
    linear(ctx, ctx.lab(probe, idx), f"blocks.{i}.ffn.act", t, int(ctx.cfg["ffn_dim"]),
           f"blocks.{i}.ffn.w_down.weight", d, "W_down", f"blocks.{i}.ffn.w_down.bias")


def rule_head(ctx, probe, idx):
    """The head's product f·W_U: the logits themselves, or with logit_softcap what the cap squashes."""
    t, v = idx
    fs = [ctx.p("final_norm", [t, i]) for i in range(int(ctx.cfg["dim"]))]
    product(ctx, ctx.lab(probe, idx), fs, "lm_head.weight", v, "W_U", ctx.vocab(v), x="f")


def rule_logits(ctx, probe, idx):
    cap = ctx.cfg.get("logit_softcap")
    if cap is None:
        rule_head(ctx, probe, idx)
        return
    s = ctx.steps  # logit = C·tanh(raw / C) (model.softcap)
    th = s.sum(f"tanh(raw / C)[{ctx.names[idx[0]]}][{ctx.vocab(idx[1])}]", "tanh(raw · 1/C)",
               [[ctx.p("head.uncapped", idx), operand("1/C", 1.0 / float(cap))]], post="tanh", wide=False)
    s.sum(ctx.lab(probe, idx), "C · tanh(raw / C)", [[operand("C", float(cap)), s.ref(th)]], wide=False)


def rule_probs(ctx, probe, idx):
    t, v = idx
    lp = ctx.tr.probe("logits")
    sub = lp.index.get("vocab")
    ids = sub[t] if sub is not None else list(range(lp.data.shape[-1]))
    if v not in ids:
        raise UserError(f"token {v} is not among the logits kept for this position (top {len(ids)})")
    over = [ctx.p("logits", [t, u]) for u in ids]
    s = ctx.steps
    m = s.max(f"max logit[{ctx.names[t]}]", over)
    mv = s.steps[m]["value"]
    rest_value, rest_count = None, 0
    if sub is not None:  # the rest of the vocabulary, from the stored log Σ exp(logits)
        lse = lp.extra["logsumexp"][t]
        rest_value = math.exp(lse - mv) - sum(math.exp(o["value"] - mv) for o in over)
        rest_count = int(ctx.cfg["vocab_size"]) - len(ids)
    s.softmax(ctx.lab(probe, idx), over[ids.index(v)], over, mv, "exp(logit[v] − m) / Σ_u exp(logit[u] − m)",
              rest_value=rest_value, rest_count=rest_count)


RULES = {
    "embed": rule_embed,
    "attn_norm": rule_attn_norm,
    "attn.q": _qkv("wq", "W_Q"),
    "attn.k": _qkv("wk", "W_K"),
    "attn.v": _qkv("wv", "W_V"),
    "attn.ve": rule_ve,
    "attn.q_norm": rule_qk_norm,
    "attn.k_norm": rule_qk_norm,
    "attn.q_rot": rule_rope,
    "attn.k_rot": rule_rope,
    "attn.scores": rule_scores,
    "attn.weights": rule_weights,
    "attn.z": rule_z,
    "attn.out": rule_out,
    "resid_mid": rule_resid_mid,
    "ffn_norm": rule_ffn_norm,
    "ffn.up": _ffn_in("w_up", "W_up"),
    "ffn.gate": _ffn_in("w_gate", "W_gate"),
    "ffn.act": rule_act,
    "ffn.down": rule_down,
    "resid_out": rule_resid_out,
    "final_norm": rule_final_norm,
    "logits": rule_logits,
    "uncapped": rule_head,
    "probs": rule_probs,
}
