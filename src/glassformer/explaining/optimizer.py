"""One optimizer update of one weight, explained number by number, equal to training's bitwise.

    explain_update(run, step, param, index) -> UpdateExplanation

run: a run folder (what `glassformer train --out` wrote); step: a checkpoint step S in it
(`step-00000S/`); the update explained is the NEXT one, step S+1. The checkpoint's weights and
optimizer state are loaded as --resume loads them (train/setup.py's functions) and the training
loop's own step runs once (train/loop.py `one_step`: the schedule's rate, the batch drawn from
(seed, step), dropout seeded from them, train_step's micro-batches, accumulation, global norm,
clipping and the optimizer's step), at the run's thread count; hooks note each micro-batch's
gradient of the weight, every weight's gradient before clipping and the micro-batch losses, and
the optimizer is wrapped to note the weight's state around its step, none changing a number.
Then the update of the element `param[index]` is written out with the optimizer's formula in float32:
AdamW (moments, bias corrections 1 − β^t, the schedule's learning rate, decoupled weight decay,
eps) or Muon (momentum buffer, Nesterov's look-ahead, the Newton–Schulz orthogonalisation of
the whole matrix, the shape scale). The formula's value is compared with the optimizer's
bitwise, and the comparison is part of the answer (`bitwise`).

param: a parameter name of the model's state dict (e.g. "blocks.0.attn.wq.weight"; shapes as
torch stores them, (out, in) for a Linear); index: one integer per axis (a list or "i,j").

The answer (`UpdateExplanation.to_dict()`, what POST /api/update sends) is a calculation in
the explain format the explorer's showCalc draws:
    {"title", "probe": param, "index", "label", "value": the new element as the optimizer wrote it,
     "result": the formula's value, "bitwise": bool, "text", "steps": [{"label", "op", "formula",
     "operands": [{"label", "source", "name", "index", "value"}], "value", "text"}],
     "summary": {"step", "update_step", "in_run", "optimizer", "loss", "micro_losses", "accum",
                 "grad_norm", "grad_clip", "clip_scale", "clipping", "lr", "group_lr", "checks",
                 "value_hex", "note", and the optimizer's settings}}
For tests it also holds the full recomputed gradient (`grad`, before clipping), the clipped
gradient (`clipped`) and the new parameter tensor (`new_param`).
Bad input (no such run, step, parameter or index) raises UserError saying what to give.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..checkpoint.folders import complete_checkpoints, step_name
from ..checkpoint.training import load_training
from ..config import TrainConfig
from ..errors import UserError
from ..text.data import load_split
from ..train.distributed import Dist, load_optimizer
from ..train.loader import attach_docs
from ..train.loop import one_step
from ..train.runstate import RunState
from ..train.setup import attach_masks, autocast_for, batch_shape, place_model, read_prepared, resolve_device, resumed_model
from .steps import fmt, operand

DIGITS = 9  # significant digits of a float32 in the text: enough to tell two float32 values apart


# ----------------------------------------------------------------------------- the answer


@dataclass
class UpdateExplanation:
    """The calculation of one element's optimizer update (module docstring), and its tensors."""

    param: str
    index: list[int]
    label: str
    value: float  # the element after the optimizer's step, as torch wrote it
    steps: list[dict]
    summary: dict
    grad: torch.Tensor  # the recomputed gradient of the whole weight, before clipping
    clipped: torch.Tensor  # the gradient the optimizer was given
    new_param: torch.Tensor  # the whole weight after the step

    @property
    def result(self) -> float:
        """The last step's value: the formula's float32 result."""
        return self.steps[-1]["value"]

    @property
    def bitwise(self) -> bool:
        return np.float32(self.result).tobytes() == np.float32(self.value).tobytes()

    @property
    def title(self) -> str:
        return f"{self.label} = {fmt(self.value, DIGITS)}"

    @property
    def text(self) -> str:
        verdict = ("the formula's float32 result equals the optimizer's step bitwise" if self.bitwise else
                   f"the formula gives {fmt(self.result, DIGITS)}, the optimizer wrote {fmt(self.value, DIGITS)} "
                   f"({_ulps(self.result, self.value)} float32 steps apart)")
        return "\n".join([s["text"] for s in self.steps] + [verdict])

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "probe": self.param, "index": self.index, "label": self.label,
                "value": self.value, "result": self.result, "bitwise": self.bitwise, "text": self.text,
                "steps": self.steps, "summary": self.summary}

    def __str__(self) -> str:
        return self.text


# ----------------------------------------------------------------------------- float32, as the kernels round


def f32(x) -> np.float32:
    """x (a number, a NumPy or a one-element torch value of any float type) as a float32, exactly."""
    return np.float32(float(x))


def fma32(a, b, c) -> np.float32:
    """a·b + c rounded once to float32: a fused multiply-add, as torch's vectorised CPU kernels
    (lerp, fused AdamW, add with alpha) compute it.

    >>> bool(fma32(1 + 2**-12, 1 + 2**-12, -1.0) == 2**-11 + 2**-24)  # a plain multiply would round 2**-24 away
    True
    """
    a, b, c = float(a), float(b), float(c)
    if not all(math.isfinite(v) for v in (a, b, c)):
        return f32(a * b + c)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = f32(float(exact))  # within one float32 step of the correctly rounded value
    cands = [near, np.nextafter(near, f32(-np.inf)), np.nextafter(near, f32(np.inf))]
    return min(cands, key=lambda q: (abs(Fraction(float(q)) - exact), int(q.view(np.int32)) & 1))  # ties to even


def lerp32(a, b, w) -> np.float32:
    """torch.lerp(a, b, w) as its CPU kernels compute it: a + w·(b − a) for |w| < 0.5, else
    b + (w − 1)·(b − a), each one fused multiply-add (the exact value is the same; the rounding is not).

    >>> float(lerp32(0.0, 1.0, 0.25)), float(lerp32(0.0, 1.0, 0.75))
    (0.25, 0.75)
    """
    w, d = f32(w), f32(b) - f32(a)
    return fma32(w, d, a) if abs(w) < 0.5 else fma32(w - f32(1), d, b)


def _ulps(a: float, b: float) -> int:
    """How many float32 values lie between a and b (0: the same float32)."""
    def key(x):
        i = int(f32(x).view(np.int32))
        return i if i >= 0 else -(i & 0x7FFFFFFF)
    return abs(key(a) - key(b))


# ----------------------------------------------------------------------------- steps of the calculation


class _Calc:
    """Steps with named operands, each with its value and a line of text (the page's showCalc draws them)."""

    def __init__(self):
        self.steps: list[dict] = []

    def add(self, label: str, formula: str, operands: list[dict], value, op: str = "f32", note: str = "") -> int:
        value = float(value)
        nums = ", ".join(f"{o['label']} = {fmt(o['value'], DIGITS)}" for o in operands)
        text = f"{label} = {formula} = {fmt(value, DIGITS)}" + (f"   with {nums}" if nums else "") + (
            f"   [{note}]" if note else "")
        step = {"label": label, "op": op, "formula": formula, "operands": operands, "value": value, "text": text}
        if note:
            step["reason"] = note  # the page shows a step's reason under its formula
        self.steps.append(step)
        return len(self.steps) - 1

    def ref(self, k: int, label: str | None = None) -> dict:
        s = self.steps[k]
        return operand(label or s["label"], s["value"], "step", None, [k])


WHAT = {"grad": "a gradient, recomputed from the checkpoint", "state": "the optimizer's state in the checkpoint"}


def _op(label: str, value, source: str = "const", name: str | None = None, index=None, what: str = "") -> dict:
    """An operand; `what` (or the source's own words) is what the page shows when it is pointed at."""
    o = operand(label, float(value), source, name, index)
    if what or source in WHAT:
        o["what"] = what or WHAT[source]
    return o


def _same(formula_value, torch_value, what: str) -> str:
    """'' when the two float32 values are the same bits, else a note saying how far apart they are."""
    if f32(formula_value).tobytes() == f32(torch_value).tobytes():
        return ""
    return (f"the optimizer stored {fmt(float(torch_value), DIGITS)} for {what}, "
            f"{_ulps(formula_value, torch_value)} float32 steps away")


# ----------------------------------------------------------------------------- the run at a checkpoint


class _NoBar:
    """What one_step updates on the progress bar, for a step nobody watches."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def checkpoint_folder(run: str | Path, step: int) -> Path:
    """run/step-NNNNNN, a complete training checkpoint, or a UserError listing the steps there are."""
    run = Path(run)
    if not run.is_dir():
        raise UserError(f"--run {run} is not a folder: give a training run's folder (what `glassformer train --out` wrote)")
    found = complete_checkpoints(run)
    if not found:
        raise UserError(f"{run} holds no complete training checkpoint (step-NNNNNN with train_state.json): "
                        "give the folder of a run `glassformer train` wrote")
    try:
        folder = run / step_name(int(step))
    except (TypeError, ValueError):
        raise UserError(f"--step {step!r} is not a whole number: give a checkpoint's step") from None
    if folder not in found:
        steps = ", ".join(str(int(p.name.rpartition("-")[2])) for p in found)
        raise UserError(f"{run} has no complete checkpoint at step {step}: choose one of {steps}")
    return folder


def _device(name: str) -> tuple[torch.device, str]:
    """The run's device where this machine has it, else the CPU (and a note: then not bitwise)."""
    try:
        return resolve_device(name), ""
    except UserError:
        return torch.device("cpu"), (f"the run trained on {name}, which this machine lacks: recomputed on the CPU, "
                                     "so not bitwise")


def _prepared(data: Path) -> dict:
    try:
        return read_prepared(data)
    except UserError as e:
        raise UserError(f"the run's data folder {data} cannot be read here ({e}): pass --data DIR, the prepared "
                        "folder the run trained on") from None


def resume_run(folder: Path, data: str | Path | None = None) -> tuple[RunState, dict, str]:
    """(the run as `start_run` resumes it from `folder`, its train_state, a note): the checkpoint's
    weights and optimizer state, the run's data, batch shape and autocast, through train/setup.py's
    own functions, without touching the run folder (no metrics cut back, no checkpoint written)."""
    model_sd, optim_sd, state, _ = load_training(folder)
    cfg = TrainConfig.from_saved(state["config"])
    d = Dist()
    device, note = _device(cfg.device)
    data = Path(data or cfg.data)
    meta = _prepared(data)
    model = resumed_model(cfg, folder, model_sd)
    seq_len, micro, accum = batch_shape(cfg, model.config, d)
    train_tokens, val_tokens = (load_split(data, split, meta) for split in ("train", "val"))
    net, optimizer = place_model(cfg, model, d, device)
    load_optimizer(net, optimizer, optim_sd)
    run = RunState(cfg=cfg, d=d, device=device, data=data, out=folder.parent, model=model, net=net,
                   optimizer=optimizer, train_tokens=train_tokens, eval_ids=np.zeros(0, np.int64), eval_bytes=0,
                   seq_len=seq_len, micro=micro, accum=accum, autocast=autocast_for(device, cfg.dtype),
                   n_threads=torch.get_num_threads(), step=state["step"], total_steps=state["total_steps"])
    attach_masks(run, meta, len(train_tokens), len(val_tokens), 0)
    attach_docs(run, meta)  # --align-docs: the windows the run drew
    run.bar = _NoBar()
    if state.get("world_size", 1) > 1:
        note = (note + "; " if note else "") + (f"the run trained on {state['world_size']} processes: recomputed "
                                                "in one, so equal only up to the order of the ranks' sums")
    return run, state, note


@contextlib.contextmanager
def _as_trained(threads: int | None):
    """The run's thread count (the same reduction order, the same bits), and the caller's RNG
    and thread count back afterwards (one_step seeds dropout from (seed, step))."""
    before = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            if threads:
                torch.set_num_threads(int(threads))
            yield
        finally:
            torch.set_num_threads(before)


# ----------------------------------------------------------------------------- the weight and its element


def parse_index(index) -> list[int]:
    """'3,5', 7, (3, 5) -> a list of ints; a UserError for anything else.

    >>> parse_index("3, 5"), parse_index(7)
    ([3, 5], [7])
    """
    try:
        if isinstance(index, str):
            return [int(part) for part in index.split(",")]
        if isinstance(index, (int, np.integer)):
            return [int(index)]
        return [int(i) for i in index]
    except (TypeError, ValueError):
        raise UserError(f"--index {index!r} is not a list of whole numbers: write one per axis, e.g. 3,5") from None


def find_param(model: torch.nn.Module, name: str) -> torch.nn.Parameter:
    """The trained parameter `name` (state-dict names; a tied weight under either name)."""
    import difflib

    params = dict(model.named_parameters(remove_duplicate=False))
    trained = [n for n, p in params.items() if p.requires_grad]
    if name not in params:
        near = difflib.get_close_matches(name, list(params), 3)
        raise UserError(f"the model has no parameter {name!r}" + (f"; did you mean {', '.join(near)}?" if near else "")
                        + f" Give one of its weights' names, e.g. {', '.join(trained[:3])}")
    p = params[name]
    if not p.requires_grad:
        raise UserError(f"{name} is frozen in this run, so no optimizer updates it: choose a trained weight, "
                        f"e.g. {', '.join(trained[:3])}")
    return p


def check_index(p: torch.Tensor, index: list[int], name: str) -> None:
    shape = tuple(p.shape)
    if len(index) != len(shape) or not all(0 <= i < n for i, n in zip(index, shape)):
        raise UserError(f"{name} has shape {shape}: give {len(shape)} indices, each from 0 to its size − 1, "
                        f"e.g. --index {','.join('0' for _ in shape)}; got {index}")


def _owner(optimizer, p) -> tuple[torch.optim.Optimizer, dict]:
    """(the optimizer, its param group) that updates p (Muon's or AdamW's under --optimizer muon)."""
    for o in getattr(optimizer, "optimizers", (optimizer,)):
        for g in o.param_groups:
            if any(q is p for q in g["params"]):
                return o, g
    raise UserError("no optimizer of this run updates that weight")


def _snapshot(o: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The weight and its optimizer state, copied."""
    state = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in o.state.get(p, {}).items()}
    return {"param": p.detach().clone(), **state}


class _Recorder:
    """The run's optimizer as train_step sees it (param_groups, step, zero_grad), noting around its
    step the chosen weight's gradient, state and value. Hooks note, without changing a number, each
    micro-batch's gradient of that weight, every weight's accumulated gradient before clipping, and
    each micro-batch's loss."""

    def __init__(self, run: RunState, p: torch.nn.Parameter):
        self.inner, self.p = run.optimizer, p
        self.owner, self.group = _owner(run.optimizer, p)
        self.micro: list[torch.Tensor] = []
        self.losses: list[float] = []
        self.raw: dict[int, torch.Tensor] = {}
        self.before = self.after = self.clipped = None
        self.hooks = [p.register_hook(self._micro_grad), run.model.register_forward_hook(self._loss)]
        self.hooks += [q.register_post_accumulate_grad_hook(self._accumulated)
                       for q in run.model.parameters() if q.requires_grad]

    def _micro_grad(self, grad):
        self.micro.append(grad.detach().clone())

    def _accumulated(self, q):
        self.raw[id(q)] = q.grad.detach().clone()

    def _loss(self, module, args, out):
        if isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
            self.losses.append(float(out[1].detach()))

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def step(self) -> None:
        self.clipped = self.p.grad.detach().clone()
        self.before = _snapshot(self.owner, self.p)
        self.inner.step()
        self.after = _snapshot(self.owner, self.p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


# ----------------------------------------------------------------------------- the gradient


def _loss_step(c: _Calc, rec: _Recorder, run: RunState) -> None:
    """The step's loss from its micro-batches' (a conversation run's masked mean has no per-batch mean)."""
    if len(rec.losses) != run.accum:
        c.add("loss", f"Σ ℓ over the step's unmasked targets / n, their count (the masked mean over {run.accum} "
                      f"micro-batches, drawn from (seed {run.cfg.seed}, step {run.step - 1}))", [], run.last.loss, op="mean")
        return
    ops = [_op(f"ℓ_{m + 1}", v, what=f"micro-batch {m + 1}'s mean cross-entropy") for m, v in enumerate(rec.losses)]
    c.add("loss", f"Σ_m ℓ_m / {run.accum}, the mean over the step's micro-batches of {run.micro} rows × {run.seq_len} "
                  f"tokens, drawn from (seed {run.cfg.seed}, step {run.step - 1})", ops, run.last.loss, op="mean")


def _accumulated_step(c: _Calc, rec: _Recorder, run: RunState, name: str, idx: list[int]) -> tuple[int, bool]:
    """g[i] = Σ_m ∂(ℓ_m/accum)/∂w[i], summed in float32 micro-batch by micro-batch as autograd accumulates."""
    i, raw = tuple(idx), rec.raw[id(rec.p)]
    weigh = f"ℓ_m/{run.accum}" if run.train_mask is None else "(Σ masked ℓ)·W/n"
    ops = [_op(f"∂({weigh})/∂w, m = {m + 1}", g[i], "grad", name, idx, what=f"micro-batch {m + 1}'s gradient")
           for m, g in enumerate(rec.micro)]
    total = f32(0.0)
    for m, g in enumerate(rec.micro):
        total = f32(g[i]) if m == 0 else f32(total + f32(g[i]))
    whole = rec.micro[0].clone()
    for g in rec.micro[1:]:
        whole += g
    k = c.add("g", f"Σ_m ∂({weigh})/∂{name}{idx}, in float32 one micro-batch after another (autograd's accumulation)",
              ops, total, op="sum", note=_same(total, raw[i], "the accumulated gradient"))
    return k, torch.equal(whole, raw)


def _norm_step(c: _Calc, rec: _Recorder, run: RunState) -> tuple[int, bool]:
    """‖g‖ over every trained weight, the largest weights' norms listed (clip_grad_norm_'s total)."""
    names = {id(q): n for n, q in run.model.named_parameters()}
    raws = [(names[id(q)], rec.raw[id(q)]) for q in run.model.parameters() if id(q) in rec.raw]
    total = float(torch.nn.utils.get_total_norm([t for _, t in raws], 2.0))
    norms = sorted(((n, float(torch.linalg.vector_norm(t))) for n, t in raws), key=lambda nv: -nv[1])
    ops = [_op(f"‖g[{n}]‖", v, "grad", n) for n, v in norms[:8]]
    if len(norms) > 8:
        rest = math.sqrt(sum(v * v for _, v in norms[8:]))
        ops.append(_op(f"√Σ‖g‖² of the other {len(norms) - 8} weights", rest))
    k = c.add("‖g‖", "√(Σ over every trained weight of ‖g_weight‖²), before clipping "
                     "(torch.nn.utils.clip_grad_norm_)",
              ops, run.last.grad_norm, op="norm", note=_same(total, run.last.grad_norm, "the global norm"))
    return k, f32(total).tobytes() == f32(run.last.grad_norm).tobytes()


def _clip_steps(c: _Calc, rec: _Recorder, run: RunState, name: str, idx: list[int], g_k: int,
                n_k: int) -> tuple[int, float, bool]:
    """s = min(1, max_norm/(‖g‖ + 1e−6)) in float32 as clip_grad_norm_ computes it, and ĝ[i] = g[i]·s."""
    clip = run.cfg.grad_clip
    max_norm = clip if clip > 0 else math.inf
    scale = torch.clamp(max_norm / (torch.tensor(run.last.grad_norm, dtype=torch.float32) + 1e-6), max=1.0)
    active = float(scale) < 1.0
    formula = (f"min(1, max_norm / (‖g‖ + 1e−6)) with max_norm = --grad-clip {clip:g}" if clip > 0 else
               "1: --grad-clip 0, no clipping")
    s_k = c.add("s", formula, [_op("max_norm", clip), c.ref(n_k)], scale, op="clip",
                note="clipping active: every gradient is scaled by s" if active else "no clipping at this step")
    i, raw = tuple(idx), rec.raw[id(rec.p)]
    ghat = f32(f32(c.steps[g_k]["value"]) * f32(scale))
    k = c.add("ĝ", "g·s, the gradient the optimizer is given", [c.ref(g_k), c.ref(s_k)], ghat, op="mul",
              note=_same(ghat, rec.clipped[i], "the clipped gradient"))
    return k, float(scale), torch.equal(raw * scale, rec.clipped)


def _lr_step(c: _Calc, run: RunState, group: dict) -> int:
    """The schedule's rate at this step, as one_step took it from train/optim.py (and Muon's ratio)."""
    cfg = run.cfg
    ops = [_op("--lr", cfg.lr), _op("--min-lr", cfg.min_lr), _op("--warmup-steps", cfg.warmup_steps),
           _op("steps", run.total_steps or 0, what="the run's step count"), _op("step", run.step - 1, what="0-based")]
    schedule = getattr(cfg, "schedule", "cosine")
    k = c.add("lr", f"the schedule's rate at step {run.step - 1} (train/optim.py lr_at: linear warm-up, then {schedule})",
              ops, run.lr, op="schedule")
    if group.get("lr_ratio", 1.0) != 1.0:
        k = c.add("lr_Muon", "lr · (--muon-lr / --lr)", [c.ref(k), _op("ratio", group["lr_ratio"])], group["lr"], op="mul")
    return k


# ----------------------------------------------------------------------------- the optimizers' formulas


def _decay_step(c: _Calc, w0, lr: float, wd: float, lr_k: int, name: str, idx: list[int]) -> int:
    """w′ = w·(1 − lr·λ), the decoupled weight decay (1 − lr·λ in float64, then float32)."""
    ops = [_op("w", w0, "weight", name, idx, what="the checkpoint's value"), c.ref(lr_k), _op("λ", wd)]
    if wd == 0:
        return c.add("w′", "w (λ = 0: this weight is not decayed, a norm's gain or a bias)", ops, w0, op="f32")
    return c.add("w′", "w · (1 − lr·λ), the decoupled weight decay", ops, f32(f32(w0) * f32(1 - lr * wd)), op="mul")


def _adamw_steps(c: _Calc, rec: _Recorder, name: str, idx: list[int], g_k: int, lr_k: int) -> dict:
    """AdamW's update of one element, in the fused CPU kernel's float32 order (torch's FusedAdamKernel)."""
    grp, b, a, i = rec.group, rec.before, rec.after, tuple(idx)
    lr, (b1, b2), wd, eps = grp["lr"], grp["betas"], grp["weight_decay"], grp["eps"]
    t = float(a["step"])
    g = f32(c.steps[g_k]["value"])
    m0 = f32(b["exp_avg"][i]) if "exp_avg" in b else f32(0)
    v0 = f32(b["exp_avg_sq"][i]) if "exp_avg_sq" in b else f32(0)
    kt = c.add("t", "the weight's update count, this one included", [_op("t − 1", t - 1, "state", f"{name}.step")], t,
               op="count")
    k1 = c.add("1 − β₁ᵗ", "1 − β₁^t in float64 (the bias correction of m)", [_op("β₁", b1), c.ref(kt)],
               1 - b1 ** t, op="f64")
    k2 = c.add("1 − β₂ᵗ", "1 − β₂^t in float64 (the bias correction of v)", [_op("β₂", b2), c.ref(kt)],
               1 - b2 ** t, op="f64")
    kw = _decay_step(c, b["param"][i], lr, wd, lr_k, name, idx)
    m = lerp32(m0, g, 1 - b1)
    km = c.add("m", "m + (1 − β₁)·(ĝ − m), one fused multiply-add (the kernel's lerp)",
               [_op("m", m0, "state", f"{name}.exp_avg", idx), c.ref(g_k), _op("β₁", b1)], m,
               op="fma", note=_same(m, a["exp_avg"][i], "m"))
    v = fma32(f32(f32(1 - b2) * g), g, f32(v0 * f32(b2)))
    kv = c.add("v", "β₂·v + (1 − β₂)·ĝ·ĝ, the last product and the sum one fused multiply-add",
               [_op("v", v0, "state", f"{name}.exp_avg_sq", idx), c.ref(g_k), _op("β₂", b2)], v,
               op="fma", note=_same(v, a["exp_avg_sq"][i], "v"))
    step_size = lr / (1 - b1 ** t)
    ks = c.add("η", "lr / (1 − β₁ᵗ) in float64, used in float32", [c.ref(lr_k), c.ref(k1)], f32(step_size), op="div")
    den = f32(f32(np.sqrt(v)) / f32(math.sqrt(1 - b2 ** t))) + f32(eps)
    kd = c.add("d", "√v / √(1 − β₂ᵗ) + ε", [c.ref(kv), c.ref(k2), _op("ε", eps)], den, op="f32")
    new = f32(f32(c.steps[kw]["value"]) + f32(f32(-step_size) * m) / den)
    fused = bool(grp.get("fused"))
    c.add(_label(name, idx), "w′ − η·m / d", [c.ref(kw), c.ref(ks), c.ref(km), c.ref(kd)], new, op="f32",
          note="" if fused else "this AdamW is not the fused kernel: its rounding order differs from the formula's")
    return {"optimizer": "adamw", "fused": fused, "t": t, "betas": [b1, b2], "eps": eps, "weight_decay": wd,
            "bias_corrections": [1 - b1 ** t, 1 - b2 ** t]}


def _newton_schulz(U: torch.Tensor, grp: dict) -> torch.Tensor:
    """torch.optim.Muon's own orthogonalisation of the whole matrix (bfloat16 Newton–Schulz)."""
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz(U, grp["ns_coefficients"], grp["ns_steps"], grp["eps"])


def _muon_steps(c: _Calc, rec: _Recorder, name: str, idx: list[int], g_k: int, lr_k: int) -> dict:
    """Muon's update of one element: momentum, Nesterov, the whole matrix orthogonalised, the shape scale."""
    from torch.optim import _muon

    grp, b, a, i = rec.group, rec.before, rec.after, tuple(idx)
    mu, lr, wd = grp["momentum"], grp["lr"], grp["weight_decay"]
    G = rec.clipped
    B = (b["momentum_buffer"] if "momentum_buffer" in b else torch.zeros_like(G)).lerp(G, 1 - mu)  # as Muon: buf.lerp_
    U = G.lerp(B, mu) if grp["nesterov"] else B  # (rows, cols)
    O = _newton_schulz(U, grp)  # (rows, cols) bfloat16
    adj = _muon._adjust_lr(lr, grp["adjust_lr_fn"], rec.p.shape)
    g, b0 = f32(c.steps[g_k]["value"]), f32(b["momentum_buffer"][i]) if "momentum_buffer" in b else f32(0)
    kb = c.add("B", "B + (1 − μ)·(ĝ − B), one fused multiply-add (torch.lerp)",
               [_op("B", b0, "state", f"{name}.momentum_buffer", idx), c.ref(g_k), _op("μ", mu)], lerp32(b0, g, 1 - mu),
               op="fma", note=_same(lerp32(b0, g, 1 - mu), a["momentum_buffer"][i], "the momentum buffer"))
    u = lerp32(g, f32(c.steps[kb]["value"]), mu) if grp["nesterov"] else f32(c.steps[kb]["value"])
    ku = c.add("U", "ĝ + μ·(B − ĝ), Nesterov's look-ahead (torch.lerp)" if grp["nesterov"] else "B (no Nesterov)",
               [c.ref(g_k), c.ref(kb), _op("μ", mu)], u, op="fma", note=_same(u, U[i], "U"))
    rows, cols = rec.p.shape
    kn = c.add("‖U‖", f"the Frobenius norm of the whole {rows}×{cols} matrix U, in bfloat16", [],
               float(U.bfloat16().norm()), op="norm")
    (na, nb, nc), steps = grp["ns_coefficients"], grp["ns_steps"]
    ko = c.add("O", f"NS(U)[{', '.join(map(str, idx))}]: X = U/‖U‖ in bfloat16" + (", transposed (taller than wide)" if
               rows > cols else "") + f", then {steps} times X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ, "
               f"(a, b, c) = ({fmt(na, 5)}, {fmt(nb, 5)}, {fmt(nc, 5)}) "
               "(torch.optim.Muon's Newton–Schulz of the whole matrix)",
               [c.ref(ku), c.ref(kn)], float(O[i]), op="newton_schulz")
    kw = _decay_step(c, b["param"][i], lr, wd, lr_k, name, idx)
    ka = c.add("lr′", f"lr · √max(1, rows/cols) with rows, cols = {rows}, {cols} (Muon's shape scale), float64",
               [c.ref(lr_k)], adj, op="mul")
    new = fma32(f32(O[i]), f32(-adj), f32(c.steps[kw]["value"]))
    c.add(_label(name, idx), "w′ − lr′·O, one fused multiply-add", [c.ref(kw), c.ref(ka), c.ref(ko)], new, op="fma")
    whole = b["param"].mul(1 - lr * wd).add(O, alpha=-adj)
    return {"optimizer": "muon", "momentum": mu, "nesterov": grp["nesterov"], "weight_decay": wd, "shape_scale": adj / lr,
            "ns_steps": steps, "ns_coefficients": list(grp["ns_coefficients"]),
            "matrix_equal": torch.equal(whole, a["param"])}


def _label(name: str, idx: list[int]) -> str:
    return f"{name}[{', '.join(map(str, idx))}]"


# ----------------------------------------------------------------------------- entry point


def explain_update(run: str | Path, step: int, param: str, index: Sequence[int] | int | str, *,
                   data: str | Path | None = None) -> UpdateExplanation:
    """The update of `param[index]` by optimizer step `step` + 1 of run folder `run`, recomputed from
    checkpoint step-`step` through the training code's own step (train/loop.py one_step); data: the
    prepared folder when the run's recorded one has moved. See the module docstring for the answer."""
    import json

    folder = checkpoint_folder(run, step)
    idx = parse_index(index)
    threads = json.loads((folder / "train_state.json").read_text()).get("threads")
    with _as_trained(threads):
        rs, state, note = resume_run(folder, data)
        p = find_param(rs.model, param)
        check_index(p, idx, param)
        inner, rec = rs.optimizer, _Recorder(rs, p)
        rs.optimizer = rec
        rs.net.train()
        try:
            one_step(rs)  # the loop's own step: schedule, batch from (seed, step), train_step
        finally:
            rec.remove()
            rs.optimizer = inner
    if rec.after is None:
        raise UserError(f"step {rs.step}'s loss or gradient norm is not finite, so training skipped it "
                        "(--skip-nonfinite): no weight moved; choose another checkpoint")
    return _explanation(rs, rec, param, idx, note)


def _kind(o: torch.optim.Optimizer) -> str:
    if isinstance(o, torch.optim.AdamW):
        return "adamw"
    if type(o).__name__ == "Muon":
        return "muon"
    raise UserError(f"explaining an update of {type(o).__name__} is not supported (AdamW and Muon are)")


def _explanation(rs: RunState, rec: _Recorder, name: str, idx: list[int], note: str) -> UpdateExplanation:
    """The steps (gradient, clipping, rate, the optimizer's formula) and the summary of one update."""
    c = _Calc()
    kind = _kind(rec.owner)
    _loss_step(c, rec, rs)
    g_k, acc_ok = _accumulated_step(c, rec, rs, name, idx)
    n_k, norm_ok = _norm_step(c, rec, rs)
    ghat_k, scale, clip_ok = _clip_steps(c, rec, rs, name, idx, g_k, n_k)
    lr_k = _lr_step(c, rs, rec.group)
    info = (_muon_steps if kind == "muon" else _adamw_steps)(c, rec, name, idx, ghat_k, lr_k)
    value = float(rec.after["param"][tuple(idx)])
    in_run = rs.total_steps is None or rs.step <= rs.total_steps
    if not in_run:  # the last checkpoint: its next update is the one the run would have taken
        note = (note + "; " if note else "") + f"the run ended at step {rs.step - 1}: this is the update it would take next"
    summary = {"in_run": in_run, "run": str(rs.out), "step": rs.step - 1, "update_step": rs.step, "loss": rs.last.loss,
               "micro_losses": list(rec.losses), "accum": rs.accum, "micro_batch": rs.micro, "seq_len": rs.seq_len,
               "grad_norm": rs.last.grad_norm, "grad_clip": rs.cfg.grad_clip, "clip_scale": scale,
               "clipping": scale < 1.0, "lr": rs.lr, "group_lr": rec.group["lr"], "value_hex": float(value).hex(),
               "checks": {"accumulation": acc_ok, "grad_norm": norm_ok, "clipping": clip_ok}, **info,
               "device": str(rs.device), "threads": rs.n_threads,
               "note": note}
    return UpdateExplanation(name, idx, _label(name, idx), value, c.steps, summary, grad=rec.raw[id(rec.p)],
                             clipped=rec.clipped, new_param=rec.after["param"])
