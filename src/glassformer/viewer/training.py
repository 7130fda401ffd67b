"""The explorer's Training view (`glassformer view --run RUN`): a run folder's curves and checkpoints.

`training_payload(run)` is what GET /api/run answers: the loss and bits-per-byte curves (train and
held-out) and the per-layer statistics' curves, read from metrics.jsonl, and the run's checkpoints
(the snapshots `train --snapshot-every` keeps, and the ones pruning kept) for the slider.
`RunCheckpoints` opens an Explorer for a checkpoint the slider names, after checking the name
against that list (a name is looked up, never joined to a path), and keeps the last few.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.folders import complete_checkpoints, read_pointer, read_snapshots
from ..errors import UserError
from ..train.metrics import read_metrics

STAT_KINDS = ("grad_norm", "update_rms_ratio", "stream_rms", "attn_entropy")  # train/stats.py's keys


class NotFound(UserError):
    """A checkpoint (or a run) this explorer does not have: the server answers 404."""


def _number(x: Any) -> float | None:
    """x as a float, None where it is missing or not finite (a skipped step's loss; JSON has no NaN)."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def loss_curves(records: list[dict]) -> dict:
    """{'train': {'step', 'loss', 'bpb'}, 'val': {'step', 'loss', 'bpb'}, 'bits_per_nat_token'}.

    train: every logged step's training loss (a non-finite or skipped step left out); val: every
    evaluation. Training bits per byte use the held-out text's bytes per token (its bpb / loss),
    the one ratio metrics.jsonl records; the held-out bpb is the evaluation's own.

    >>> c = loss_curves([{"step": 2, "loss": 2.0}, {"step": 2, "val_loss": 4.0, "val_bpb": 1.0}])
    >>> c["train"], c["val"]["bpb"]
    ({'step': [2], 'loss': [2.0], 'bpb': [0.5]}, [1.0])
    """
    train = [(r["step"], _number(r["loss"])) for r in records
             if "loss" in r and not r.get("nonfinite") and not r.get("skipped")]
    train = [(s, v) for s, v in train if v is not None]
    val = [(r["step"], _number(r["val_loss"]), _number(r.get("val_bpb"))) for r in records if "val_loss" in r]
    ratio = next((b / v for _, v, b in val if v and b is not None), None)  # bits per byte per nat per token
    return {
        "train": {"step": [s for s, _ in train], "loss": [v for _, v in train],
                  "bpb": [None if ratio is None else v * ratio for _, v in train]},
        "val": {"step": [s for s, _, _ in val], "loss": [v for _, v, _ in val], "bpb": [b for _, _, b in val]},
        "bits_per_nat_token": ratio,
    }


def _flat(values: dict) -> dict[str, float | None]:
    """One statistic's {name: value}, a per-head list spread into 'name[h]' entries."""
    out: dict[str, float | None] = {}
    for name, v in values.items():
        if isinstance(v, list):
            out.update({f"{name}[{h}]": _number(x) for h, x in enumerate(v)})
        else:
            out[name] = _number(v)
    return out


def stats_curves(records: list[dict]) -> dict:
    """{kind: {'step': [...], 'series': {name: [value at each step, None where absent]}}} of the
    "stats" of metrics.jsonl (train/stats.py: grad_norm, update_rms_ratio, stream_rms, attn_entropy;
    attention entropy per head as 'blocks.i.attn[h]'). One entry per step that has statistics.

    >>> stats_curves([{"step": 1, "stats": {"attn_entropy": {"blocks.0.attn": [0.5, 0.25]}}}])["attn_entropy"]
    {'step': [1], 'series': {'blocks.0.attn[0]': [0.5], 'blocks.0.attn[1]': [0.25]}}
    """
    by_step: dict[int, dict] = {}
    for r in records:
        if isinstance(r.get("stats"), dict):
            by_step[r["step"]] = r["stats"]  # a step logged twice (a resume): its last line
    steps = sorted(by_step)
    out = {}
    kinds = [k for k in STAT_KINDS if any(k in s for s in by_step.values())]
    kinds += sorted({k for s in by_step.values() for k in s} - set(kinds))
    for kind in kinds:
        rows = [_flat(by_step[s].get(kind) or {}) for s in steps]
        names = list(dict.fromkeys(n for row in rows for n in row))
        out[kind] = {"step": steps, "series": {n: [row.get(n) for row in rows] for n in names}}
    return out


def moe_curves(records: list[dict]) -> dict | None:
    """A mixture of experts' training lines (train/loop.py `moe_record`): {'step', 'aux_loss' (None where
    the run trains without one), 'load' (per logged step, per mixture layer, each expert's share of the
    routed slots)}; None for a dense run.

    >>> moe_curves([{"step": 5, "loss": 2.0, "aux_loss": 2.1, "moe_load": [[0.75, 0.25]]}])
    {'step': [5], 'aux_loss': [2.1], 'load': [[[0.75, 0.25]]]}
    """
    rows = [r for r in records if isinstance(r.get("moe_load"), list) and not r.get("nonfinite")]
    if not rows:
        return None
    return {"step": [r["step"] for r in rows], "aux_loss": [_number(r.get("aux_loss")) for r in rows],
            "load": [[[_number(x) for x in layer] for layer in r["moe_load"]] for r in rows]}


def step_of(name: str) -> int:
    """The step of a checkpoint folder name: 'step-000120' -> 120."""
    return int(name.rsplit("-", 1)[1])


def checkpoint_list(run: str | Path, records: list[dict] | None = None) -> list[dict]:
    """The run's complete checkpoints, oldest first: {'name', 'step', 'snapshot', 'best', 'latest',
    'val_loss' (the evaluation at that step, if any)}."""
    run = Path(run)
    snaps, best, latest = set(read_snapshots(run)), read_pointer(run, "best"), read_pointer(run, "latest")
    val = {r["step"]: _number(r["val_loss"]) for r in records or [] if "val_loss" in r}
    out = []
    for p in complete_checkpoints(run):
        step = step_of(p.name)
        out.append({"name": p.name, "step": step, "snapshot": p.name in snaps, "best": p.name == best,
                    "latest": p.name == latest, "val_loss": val.get(step)})
    return out


def run_name(run: Path) -> str:
    """The run folder's name as the page shows it (`--run .` too: the folder's own name)."""
    return run.resolve().name or str(run)


def training_payload(run: str | Path) -> dict:
    """What the Training view draws (GET /api/run): {'run', 'curves', 'stats', 'moe', 'checkpoints'}."""
    run = Path(run)
    path = run / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    return {"run": run_name(run), "curves": loss_curves(records), "stats": stats_curves(records),
            "moe": moe_curves(records), "checkpoints": checkpoint_list(run, records)}


class RunCheckpoints:
    """The checkpoints of one run as the explorer opens them: `explorer(name)` checks `name`
    against the run's list (NotFound otherwise), opens it with `open_one(name, folder)` on first
    use and keeps the last KEPT (each one's own cache of traced sentences comes with it)."""

    KEPT = 4

    def __init__(self, run: str | Path, open_one: Callable[[str, Path], Any], params: dict | None = None):
        self.run, self.open_one, self.params = Path(run), open_one, params or {}
        self.name = run_name(self.run)
        self.opened: OrderedDict = OrderedDict()  # name -> Explorer
        self.pinned: dict = {}  # name -> Explorer: the one the page opened with, never dropped
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return [p.name for p in complete_checkpoints(self.run)]

    def pin(self, name: str, explorer: Any) -> None:
        self.pinned[name] = explorer

    def explorer(self, name: str) -> Any:
        if not isinstance(name, str):
            raise UserError("checkpoint must be a checkpoint's name, e.g. step-000100")
        names = self.names()
        if name not in names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise NotFound(f"run {self.name} has no checkpoint {name!r}: choose one of {shown or 'none yet'}")
        if name in self.pinned:
            return self.pinned[name]
        with self._lock:  # one load per name, even when two asks come together
            if name not in self.opened:
                self.opened[name] = self.open_one(name, self.run / name)
                while len(self.opened) > self.KEPT:
                    self.opened.popitem(last=False)
            self.opened.move_to_end(name)
            return self.opened[name]

    def payload(self) -> dict:
        return {**training_payload(self.run), "params": self.params}
