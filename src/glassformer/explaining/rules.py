"""The rule for each probe: which operands make it, and how (used by glassformer.explain).
Each rule adds steps to ctx.steps, the last the explained number, following model.py for pre-
and post-norm; the stream wiring comes from probes.STREAM_WIRING (docs/trace-format.md#probe-entries):
    x → (norm) → q,k,v → q_rot,k_rot → scores → weights → z → out;  resid_mid = x + out
    mid → (norm) → up,gate → act → down;  resid_out = mid + down
The speedrun switches (docs/model.md#speedrun-switches) add q_norm,k_norm between q,k and their
rotation (qk_norm), ve into v (value_embeddings), and head.uncapped before logits (logit_softcap).
The families add Gemma's (1 + w) norms, sandwich and post-branch norms (attn_post_norm, ffn_post_norm;
what each addition adds is STREAM_WIRING's attn_adds/ffn_adds), QK norms with weights, √D on the
embedding, query_pre_attn_scalar and the soft cap in the scores, a sink per head in the softmax
(sink_weight), GeGLU and the clamped SwiGLU, and mixtures of experts:
    x → router_logits → router_probs → expert_ids, expert_weights;  experts.{e}: up,gate → act → down
    expert_out[slot] = experts.{id}.down;  down = Σ_slot weight·expert_out (+ shared)
"""

from __future__ import annotations

import math

import numpy as np

from ..config import ModelConfig
from ..errors import UserError
from ..probes import final_norm_reads, stream_probes
from ..rope_scaling import attention_factor
from ..tracing.trace import expert_of, score_inputs, weight_matrix
from . import lora, quantized
from .steps import Steps, fmt, operand

_SYMBOL = {"attn.out": "attn_out", "attn.scores": "s", "attn.weights": "w", "logits": "logit", "probs": "p",
           "ffn.up": "up", "ffn.gate": "gate", "ffn.act": "act", "ffn.down": "down", "head.uncapped": "raw",
           "attn.sink_weight": "w_sink", "ffn.router_logits": "r", "ffn.router_probs": "p_r", "ffn.expert_ids": "expert",
           "ffn.expert_weights": "g", "ffn.expert_out": "y", "ffn.shared": "shared"}


class Context:
    """The trace (and model) that a rule reads, with labelled operands."""

    def __init__(self, tr, model, steps: Steps):
        self.tr, self.model, self.steps = tr, model, steps
        self.cfg = tr.config
        self.mc = ModelConfig.from_dict(tr.config)  # the config's per-layer answers (window_at, rope_kind, is_moe)
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
        if expert_of(probe) is not None:  # one expert's own probe: E3.up
            sym = f"E{parts[4]}.{parts[-1]}"
        elif leaf.startswith("ffn.shared."):
            sym = f"shared.{parts[-1]}"
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
            elif axis == "expert":
                out += f"[e{i}]"
            elif axis == "slot":
                out += f"[slot {i}]"
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
    e = ctx.w("embed.weight", [tok, j], f"E[{ctx.names[t]}][{j}]")
    formula = f"E[{ctx.names[t]}][{j}]"
    terms = [[e]]
    if ctx.mc.embed_scale:  # Gemma: times √D, rounded to the weights' dtype (float32 here) as the model rounds it
        terms = [[e, operand("√D", float(np.float32(math.sqrt(ctx.mc.dim))))]]
        formula += "·√D"
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


def gain(ctx: Context, wname: str, j: int) -> dict:
    """A norm's gain at feature j: γ[j], or with norm_offset (Gemma) the step 1 + w[j] (w is stored)."""
    if not ctx.mc.norm_offset:
        return ctx.w(wname + ".weight", [j], f"γ[{j}]")
    s = ctx.steps
    return s.ref(s.sum(f"1 + w[{j}]", f"1 + w[{j}]", [[operand("1", 1.0)], [ctx.w(wname + ".weight", [j], f"w[{j}]")]],
                       wide=False))


def rms_norm(ctx: Context, label: str, xs: list[dict], j: int, wname: str | None, row: str) -> None:
    """x[j] / √(Σ_i x[i]²/n + ε) · γ[j] (+ β[j]) over the n operands xs; wname None: no weight (the
    weightless QK norm); with norm_offset the gain is 1 + w[j] and there is no β (model.OffsetRMSNorm)."""
    s = ctx.steps
    n = "D" if len(xs) == int(ctx.cfg["dim"]) else "n"
    inv_n = operand(n, len(xs), power=-1)
    r = s.sum(f"RMS({row})", f"√(Σ_i x[i]²/{n} + ε)", [[x, x, inv_n] for x in xs], post="sqrt",
              fixed=[[operand("ε", float(ctx.cfg["norm_eps"]))]])
    if wname is None:
        s.sum(label, f"x[{j}] / RMS", [[xs[j], s.ref(r, power=-1)]], wide=False)
        return
    g = gain(ctx, wname, j)
    bname = wname + ".bias"
    beta = [[ctx.w(bname, [j], f"β[{j}]")]] if ctx.has(bname) and not ctx.mc.norm_offset else []
    word = "(1 + w)" if ctx.mc.norm_offset else f"γ[{j}]"
    s.sum(label, f"x[{j}] / RMS · {word}" + (" + β" if beta else ""), [[xs[j], s.ref(r, power=-1), g]] + beta,
          wide=False)


def norm(ctx: Context, probe: str, idx, x_probe: str, wname: str):
    """RMSNorm: x[j] / √(mean(x²) + ε) · γ[j] (Gemma: · (1 + w[j])); LayerNorm: (x[j] − μ) / √(var + ε) · γ[j] + β[j]."""
    t, j = idx
    D = int(ctx.cfg["dim"])
    eps = float(ctx.cfg["norm_eps"])
    s = ctx.steps
    xs = [ctx.p(x_probe, [t, i]) for i in range(D)]
    row = ctx.lab(x_probe, [t])  # e.g. resid_mid[cats]: whose RMS
    if ctx.cfg["norm"] == "rms":
        rms_norm(ctx, ctx.lab(probe, idx), xs, j, wname, row)
        return
    inv_d = operand("D", D, power=-1)
    gamma = ctx.w(wname + ".weight", [j], f"γ[{j}]")
    bname = wname + ".bias"
    beta = [[ctx.w(bname, [j], f"β[{j}]")]] if ctx.has(bname) else []
    mu = s.sum(f"μ({row})", "Σ_i x[i]/D", [[x, inv_d] for x in xs])
    m = s.ref(mu)
    sd = s.sum(f"σ({row})", "√(Σ_i x[i]²/D − μ² + ε)", [[x, x, inv_d] for x in xs], post="sqrt",
               fixed=[[m, m, operand("−1", -1.0)], [operand("ε", eps)]])
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


def _post_norm(part: str):
    def rule(ctx, probe, idx):
        """A sandwich norm on the sublayer's output, before the addition (Gemma 2/3)."""
        i = _layer(probe)
        norm(ctx, probe, idx, ctx.wire(i)[f"{part}_post_norm_reads"], f"blocks.{i}.{part}_post_norm")
    return rule


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
    """QK norm: q[j] / √(Σ_d q[d]²/H + ε) over the head's H features, no weight (model.head_rms_norm);
    'head': times the gain γ[j] shared by every head (Qwen3, Gemma 3); 'proj': over all N·H features of
    the token's queries (K·H of its keys) with a gain per feature (OLMo 2)."""
    t, h, j = idx
    src = probe[: -len("_norm")]  # blocks.i.attn.q or .k
    i = _layer(probe)
    kind = ctx.mc.qk_norm
    wname = f"blocks.{i}.attn.{src.rsplit('.', 1)[-1]}_norm"
    if kind == "proj":
        heads = int(ctx.cfg["n_heads"] if src.endswith(".q") else ctx.cfg["n_kv_heads"])
        xs = [ctx.p(src, [t, g, d]) for g in range(heads) for d in range(ctx.H)]
        rms_norm(ctx, ctx.lab(probe, idx), xs, h * ctx.H + j, wname, ctx.lab(src, [t]))
        return
    xs = [ctx.p(src, [t, h, d]) for d in range(ctx.H)]
    rms_norm(ctx, ctx.lab(probe, idx), xs, j, wname if kind == "head" else None, ctx.lab(src, [t, h]))


def rule_rope(ctx, probe, idx):
    t, h, j = idx
    src = probe[: -len("_rot")]  # blocks.i.attn.q or .k
    i = _layer(probe)
    if ctx.cfg.get("qk_norm"):  # the rotation turns the normalised q, k
        src += "_norm"
    half = ctx.H // 2
    if ctx.cfg["rope_pairs"] == "half":
        p, ia, ib, first = j % half, j % half, j % half + half, j < half
    else:
        p, ia, ib, first = j // 2, j - j % 2, j - j % 2 + 1, j % 2 == 0
    local = ctx.mc.rope_kind(i) == "local"  # Gemma 3's sliding layers: their own base, no scaling
    table = ctx.tr.rope_local_inv_freq if local else ctx.tr.rope_inv_freq
    if table is None:
        name = "rope_local_inv_freq" if local else "rope_inv_freq"
        raise UserError(f"the trace has no {name}: it was not written by glassformer.trace")
    omega = float(table[p])
    pos = ctx.tr.positions[t]
    s = ctx.steps
    th = s.sum(f"θ[{ctx.names[t]}][pair {p}]", f"position·ω[{p}]", [[operand("position", pos), operand(f"ω[{p}]", omega)]],
               wide=False)
    # The model forms the angle in float32; cos and sin are taken of that same angle.
    angle = float(np.float32(pos) * np.float32(omega))
    cos, sin = operand("cos θ", math.cos(angle)), operand("sin θ", math.sin(angle))
    f = 1.0 if local else attention_factor(ctx.cfg.get("rope_scaling"))
    scale = [operand("f", f)] if f != 1.0 else []  # YaRN's factor on cos and sin (rope_scaling.attention_factor)
    fx = "·f" if scale else ""
    a, b = ctx.p(src, [t, h, ia]), ctx.p(src, [t, h, ib])
    sym = "q" if src.rsplit(".", 1)[-1].startswith("q") else "k"
    if first:
        # The minus belongs to sin θ: one factor −sin θ, not sin θ times a separate −1.
        s.sum(ctx.lab(probe, idx), f"{sym}[{ia}]·cos θ{fx} + {sym}[{ib}]·(−sin θ){fx}",
              [[a, cos] + scale, [b, operand("−sin θ", -sin["value"])] + scale], wide=False)
    else:
        s.sum(ctx.lab(probe, idx), f"{sym}[{ia}]·sin θ{fx} + {sym}[{ib}]·cos θ{fx}", [[a, sin] + scale, [b, cos] + scale],
              wide=False)
    s.steps[th]["text"] += f" rad (cos θ = {fmt(cos['value'])}, sin θ = {fmt(sin['value'])}" + (f", f = {fmt(f)})" if scale else ")")


def _qk(ctx, i):
    return score_inputs(ctx.mc, i)


def rule_scores(ctx, probe, idx):
    """s = q·k · 1/√H (Gemma: query_pre_attn_scalar^−½), then C·tanh(s/C) with attn_softcap (Gemma 2)."""
    i = _layer(probe)
    t, h, j = idx
    qn, kn = _qk(ctx, i)
    kv = h // ctx.n_rep
    s = ctx.steps
    terms = [[ctx.p(qn, [t, h, d]), ctx.p(kn, [j, kv, d])] for d in range(ctx.H)]
    dot = s.sum(f"q·k[{ctx.names[t]}][{ctx.names[j]}]", "Σ_d q[d]·k[d]", terms)
    qs, cap = ctx.mc.query_pre_attn_scalar, ctx.mc.attn_softcap
    scale = operand("1/√H", ctx.H ** -0.5) if qs is None else operand("1/√s_q", qs ** -0.5)
    label = ctx.lab(probe, idx)
    scaled = s.sum(label if cap is None else f"raw {label}", f"(q·k) · {scale['label']}", [[s.ref(dot), scale]],
                   wide=False)
    if cap is not None:  # C·tanh(s/C) (the model: attention.show.scores_of)
        th = s.sum("tanh(raw/C)", "tanh(raw · 1/C)", [[s.ref(scaled), operand("1/C", 1.0 / cap)]], post="tanh", wide=False)
        s.sum(label, "C · tanh(raw / C)", [[operand("C", cap), s.ref(th)]], wide=False)


def _readable(ctx, i, t, h):
    """Keys that query t of head h may read: the cells of .weights that are not null."""
    w = f"blocks.{i}.attn.weights"
    return [k for k in range(ctx.tr.probe(w).data.shape[-1]) if not math.isnan(ctx.tr.value(w, [t, h, k]))]


def _softmax_over(ctx, i, t, h):
    """(readable keys, the logits query t's softmax in head h reads, the sink operand or None): the
    readable keys' scores, and the head's sink logit where the model has attention sinks (gpt-oss: it
    joins the denominator, takes weight and adds no value)."""
    sp = f"blocks.{i}.attn.scores"
    ok = _readable(ctx, i, t, h)
    over = [ctx.p(sp, [t, h, k]) for k in ok]
    sink = ctx.w(f"blocks.{i}.attn.sinks", [h], f"sink[h{h}]") if ctx.mc.attn_sinks else None
    return ok, over + ([sink] if sink else []), sink


def rule_weights(ctx, probe, idx):
    i = _layer(probe)
    t, h, j = idx
    sp = f"blocks.{i}.attn.scores"
    ok, over, sink = _softmax_over(ctx, i, t, h)
    if j not in ok:
        qp = ctx.tr.positions[t]
        why = (f"key {ctx.names[j]} (index {j}) comes after query {ctx.names[t]} (position {qp})" if j > qp
               else f"key {ctx.names[j]} is outside the sliding window of {ctx.mc.window_at(i)}")
        ctx.steps.masked(ctx.lab(probe, idx), why)
        return
    s = ctx.steps
    m = s.max(f"m[{ctx.names[t]}]", over)
    hidden = len(ctx.tr.probe(sp).data[0, 0]) - len(ok)
    note = f"  ({hidden} masked key{'s get' if hidden > 1 else ' gets'} weight 0)" if hidden else ""
    if sink is not None:
        note += "  (the sink's logit joins the denominator: it takes weight and adds no value)"
    s.softmax(ctx.lab(probe, idx), over[ok.index(j)], over, s.steps[m]["value"],
              "exp(s[j] − m) / Σ_k exp(s[k] − m)" + (" + exp(sink − m)" if sink else ""), note=note)


def rule_sink_weight(ctx, probe, idx):
    """The weight the sink took from query t in head h: exp(sink − m) / (Σ_k exp(s[k] − m) + exp(sink − m));
    the keys' weights sum to 1 minus it."""
    i = _layer(probe)
    t, h = idx
    _, over, sink = _softmax_over(ctx, i, t, h)
    s = ctx.steps
    m = s.max(f"m[{ctx.names[t]}]", over)
    s.softmax(ctx.lab(probe, idx), sink, over, s.steps[m]["value"], "exp(sink − m) / (Σ_k exp(s[k] − m) + exp(sink − m))")


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
    x, a = ctx.p(ctx.block_input(i), idx), ctx.p(ctx.wire(i)["attn_adds"], idx)  # attn.out, or the norm on it
    ctx.steps.sum(ctx.lab(probe, idx), f"x + {_symbol(a)}", [[x], [a]], wide=False)


def rule_resid_out(ctx, probe, idx):
    i = _layer(probe)
    h, f = ctx.p(ctx.wire(i)["mid"], idx), ctx.p(ctx.wire(i)["ffn_adds"], idx)  # ffn.down, or the norm on it
    ctx.steps.sum(ctx.lab(probe, idx), f"h + {_symbol(f)}", [[h], [f]], wide=False)


def _symbol(o: dict) -> str:
    """An operand's symbol without its layer and indices: 'L1.attn_out[cats][3]' -> 'attn_out'."""
    return o["label"].split("[")[0].split(".")[-1]


def _module(probe: str) -> str:
    """The feed-forward module a probe belongs to: blocks.i.ffn, blocks.i.ffn.experts.e or blocks.i.ffn.shared."""
    return probe.rsplit(".", 1)[0]


def _ffn_in(which: str, W: str):
    def rule(ctx, probe, idx):
        """up or gate of a feed-forward (an expert's, the shared one's): x·W (+ b) of the token's input to it."""
        i = _layer(probe)
        t, f = idx
        mod = _module(probe)
        linear(ctx, ctx.lab(probe, idx), ctx.ffn_input(i), t, int(ctx.cfg["dim"]),
               f"{mod}.{which}.weight", f, W, f"{mod}.{which}.bias")
    return rule


def rule_act(ctx, probe, idx):
    mod = _module(probe)
    kind = ctx.cfg["ffn"]
    up = ctx.p(f"{mod}.up", idx)
    s = ctx.steps
    t, f = idx
    if kind in ("swiglu", "geglu"):
        name, post, form = ("silu", "silu", "gate·σ(gate)") if kind == "swiglu" else ("gelu", "gelu_tanh", "gelu_tanh(gate)")
        g = s.sum(f"{name}(gate[{ctx.names[t]}][{f}])", form, [[ctx.p(f"{mod}.gate", idx)]], post=post, wide=False)
        s.sum(ctx.lab(probe, idx), f"{name}(gate)·up", [[s.ref(g), up]], wide=False)
    elif kind == "swiglu_clamp":  # gpt-oss: (clamp(up, −L, L) + 1) · g·σ(1.702·g), g = min(gate, L)
        L = float(ctx.mc.swiglu_limit)
        g = s.clamp(f"g[{ctx.names[t]}][{f}]", ctx.p(f"{mod}.gate", idx), None, L)
        sig = s.sum("σ(1.702·g)", "σ(1.702·g)", [[operand("1.702", 1.702), s.ref(g)]], post="sigmoid", wide=False)
        glu = s.sum("g·σ(1.702·g)", "g·σ(1.702·g)", [[s.ref(g), s.ref(sig)]], wide=False)
        u = s.clamp(f"u[{ctx.names[t]}][{f}]", up, -L, L)
        s.sum(ctx.lab(probe, idx), "(u + 1)·g·σ(1.702·g)", [[s.ref(u), s.ref(glu)], [operand("1", 1.0), s.ref(glu)]],
              wide=False)
    elif kind == "relu2":
        s.sum(ctx.lab(probe, idx), "relu(up)²", [[up]], post="relu2", wide=False)
    else:
        s.sum(ctx.lab(probe, idx), f"{kind}(up)", [[up]], post=kind, wide=False)


def rule_down(ctx, probe, idx):
    i = _layer(probe)
    mod = _module(probe)
    if mod == f"blocks.{i}.ffn" and ctx.mc.is_moe(i):
        rule_mixture(ctx, probe, idx)
        return
    t, d = idx
    width = int(ctx.tr.probe(f"{mod}.act").data.shape[-1])  # F, an expert's F_e, or the shared experts' width
    linear(ctx, ctx.lab(probe, idx), f"{mod}.act", t, width, f"{mod}.w_down.weight", d, "W_down", f"{mod}.w_down.bias")


# ----------------------------------------------------------------------------- mixtures of experts


def _chosen(ctx, i: int, t: int) -> list[int]:
    """The experts token t was routed to in layer i, slot by slot (the traced expert_ids)."""
    ids = f"blocks.{i}.ffn.expert_ids"
    return [int(ctx.tr.value(ids, [t, j])) for j in range(ctx.mc.n_active_experts)]


def rule_router_logits(ctx, probe, idx):
    i = _layer(probe)
    t, e = idx
    linear(ctx, ctx.lab(probe, idx), ctx.ffn_input(i), t, int(ctx.cfg["dim"]), f"blocks.{i}.ffn.router.weight", e,
           "W_r", f"blocks.{i}.ffn.router.bias")


def rule_router_probs(ctx, probe, idx):
    """softmax over the E router logits (Mixtral, Qwen3-MoE, OLMoE, gpt-oss), or sigmoid of each."""
    i = _layer(probe)
    t, e = idx
    lp = f"blocks.{i}.ffn.router_logits"
    s = ctx.steps
    if ctx.mc.router == "sigmoid":
        s.sum(ctx.lab(probe, idx), "σ(r)", [[ctx.p(lp, [t, e])]], post="sigmoid", wide=False)
        return
    over = [ctx.p(lp, [t, u]) for u in range(ctx.mc.n_experts)]
    m = s.max(f"max r[{ctx.names[t]}]", over)
    s.softmax(ctx.lab(probe, idx), over[e], over, s.steps[m]["value"], "exp(r[e] − m) / Σ_u exp(r[u] − m)")


def rule_expert_ids(ctx, probe, idx):
    """Slot j's expert: the most probable expert not taken by an earlier slot (top-k, best first)."""
    i = _layer(probe)
    t, j = idx
    taken = _chosen(ctx, i, t)[:j]
    left = [e for e in range(ctx.mc.n_experts) if e not in taken]
    over = [ctx.p(f"blocks.{i}.ffn.router_probs", [t, e]) for e in left]
    formula = "the most probable expert" + (f" besides {', '.join(map(str, taken))}" if taken else "")
    ctx.steps.argmax(ctx.lab(probe, idx), over, left, formula)


def rule_expert_weights(ctx, probe, idx):
    """Slot j's weight: its expert's router probability, divided by the k chosen ones' sum with router_renorm."""
    i = _layer(probe)
    t, j = idx
    chosen = _chosen(ctx, i, t)
    ps = [ctx.p(f"blocks.{i}.ffn.router_probs", [t, e]) for e in chosen]
    s = ctx.steps
    if not ctx.mc.router_renorm:
        s.sum(ctx.lab(probe, idx), f"p_r[e{chosen[j]}]", [[ps[j]]], wide=False)
        return
    total = s.sum(f"Σ chosen p_r[{ctx.names[t]}]", "Σ_slot p_r[expert]", [[p] for p in ps], wide=False)
    s.sum(ctx.lab(probe, idx), f"p_r[e{chosen[j]}] / Σ", [[ps[j], s.ref(total, power=-1)]], wide=False)


def rule_expert_out(ctx, probe, idx):
    """Slot j's output: the down projection of the expert the slot chose, run on this token."""
    i = _layer(probe)
    t, j, d = idx
    e = _chosen(ctx, i, t)[j]
    ctx.steps.sum(ctx.lab(probe, idx), f"E{e}.down[{d}]", [[ctx.p(f"blocks.{i}.ffn.experts.{e}.down", [t, d])]],
                  wide=False)


def rule_shared(ctx, probe, idx):
    i = _layer(probe)
    ctx.steps.sum(ctx.lab(probe, idx), "shared.down", [[ctx.p(f"blocks.{i}.ffn.shared.down", idx)]], wide=False)


def rule_mixture(ctx, probe, idx):
    """A mixture's output: Σ_slot g[slot]·y[slot][d] (+ shared[d])."""
    i = _layer(probe)
    t, d = idx
    n = f"blocks.{i}.ffn"
    terms = [[ctx.p(n + ".expert_weights", [t, j]), ctx.p(n + ".expert_out", [t, j, d])]
             for j in range(ctx.mc.n_active_experts)]
    shared = [[ctx.p(n + ".shared", [t, d])]] if n + ".shared" in ctx.tr.probes else []
    ctx.steps.sum(ctx.lab(probe, idx), "Σ_slot g[slot]·y[slot]" + (" + shared" if shared else ""), terms + shared,
                  wide=False)


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
    "attn.sink_weight": rule_sink_weight,
    "attn_post_norm": _post_norm("attn"),
    "ffn_post_norm": _post_norm("ffn"),
    "ffn.router_logits": rule_router_logits,
    "ffn.router_probs": rule_router_probs,
    "ffn.expert_ids": rule_expert_ids,
    "ffn.expert_weights": rule_expert_weights,
    "ffn.expert_out": rule_expert_out,
    "ffn.shared": rule_shared,
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
