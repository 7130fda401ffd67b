"""The trace file: a `Trace` in memory, and its strict-JSON form (docs/trace-format.md).

JSON has no NaN or Infinity, so a masked attention cell is written as null (and read back
as NaN). Numbers are written with a fixed number of significant digits by a small writer
that formats whole rows at once: a trace holds millions of numbers, and `json.dumps` of
float32 values would spend 17 digits on each (bench/trace_size.py times the writer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import UserError

FORMAT = "glassformer-trace"
FORMAT_VERSION = 1
DEFAULT_DIGITS = 7


@dataclass
class Probe:
    """One recorded tensor (float32, NaN where the file says null) and how its axes map to the model's.

    index[axis] lists the model's indices of the stored entries along that axis (absent = all);
    for 'vocab' under top-k it is one list per token.
    """

    data: torch.Tensor
    axes: list[str]
    index: dict[str, list] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def position(self, idx: Sequence[int]) -> tuple[int, ...] | None:
        """Where the model index `idx` sits in `data`, or None if it was not stored."""
        if len(idx) != len(self.axes):
            raise UserError(f"index {list(idx)} has {len(idx)} numbers; this probe has axes {self.axes}")
        out = []
        for a, (axis, i) in enumerate(zip(self.axes, idx)):
            i = int(i)
            sub = self.index.get(axis)
            if sub is not None and sub and isinstance(sub[0], list):  # one list per token
                sub = sub[int(idx[0])]
            if sub is None:
                if not 0 <= i < self.data.shape[a]:
                    return None
                out.append(i)
            elif i in sub:
                out.append(sub.index(i))
            else:
                return None
        return tuple(out)


@dataclass
class Trace:
    """Everything one traced text shows: metadata, probes, optional weights, tiles and analysis."""

    tokens: list[str]
    ids: list[int]
    positions: list[int]
    config: dict[str, Any]
    layers: list[int]
    heads: list[int]
    probes: dict[str, Probe]
    tiles: dict[int, dict] = field(default_factory=dict)
    weights: dict[str, Probe] = field(default_factory=dict)
    rope_inv_freq: list[float] | None = None
    top_k: int | None = None
    query: int | None = None
    analysis: dict[str, Any] = field(default_factory=dict)
    lora: dict[str, Any] | None = None  # an adapted model's LoraConfig.to_dict() (docs/lora.md), else None
    rope_local_inv_freq: list[float] | None = None  # the sliding layers' RoPE table (rope_local_theta), else None

    # ---- reading --------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.probe(name).data

    def __contains__(self, name: str) -> bool:
        return name in self.probes

    def probe(self, name: str) -> Probe:
        if name not in self.probes:
            near = ", ".join(sorted(self.probes)[:8])
            raise UserError(f"the trace has no probe {name!r} (traced layers: {self.layers}); probes include: {near}, …")
        return self.probes[name]

    def value(self, name: str, index) -> float:
        """The number at the model's index `index` of probe `name` (NaN for a masked cell)."""
        p = self.probe(name)
        at = p.position(index)
        if at is None:
            raise UserError(f"{name}{list(index)} is not in this trace (shape {list(p.data.shape)}, kept {p.index or 'all'})")
        return float(p.data[at])

    def has_weight(self, name: str) -> bool:
        return name in self.weights

    def weight_value(self, name: str, index) -> float:
        p = self.weights[name]
        at = p.position(index)
        if at is None:
            raise UserError(f"weight {name}{list(index)} is not stored in this trace")
        return float(p.data[at])

    @property
    def T(self) -> int:
        return len(self.ids)

    # ---- writing --------------------------------------------------------------------
    def to_json(self, path: str | Path | None = None, digits: int = DEFAULT_DIGITS) -> str | None:
        """Write the trace as strict JSON to `path` (or return the text when path is None)."""
        if not 1 <= digits <= 17:
            raise UserError(f"digits must be between 1 and 17, got {digits}")
        parts = ["{"]
        head = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "tokens": self.tokens, "ids": self.ids, "positions": self.positions, "config": self.config,
            "rope_inv_freq": self.rope_inv_freq, "layers": self.layers, "heads": self.heads,
            "top_k": self.top_k, "query": self.query,
        }
        if self.rope_local_inv_freq is not None:  # written only where there is one: other files stay as they were
            head["rope_local_inv_freq"] = self.rope_local_inv_freq
        parts.append(",\n".join(f"{json.dumps(k)}: {_strict_dumps(v)}" for k, v in head.items()))
        parts.append(',\n"probes": {')
        entries = [f"\n{json.dumps(n)}: {_entry_text(p, digits)}" for n, p in self.probes.items()]
        for i, t in self.tiles.items():
            entries.append(f"\n{json.dumps(f'blocks.{i}.attn.tiles')}: {_strict_dumps(_tiles_json(t))}")
        parts.append(",".join(entries))
        parts.append("}")
        if self.weights:
            parts.append(',\n"weights": {')
            parts.append(",".join(f"\n{json.dumps(n)}: {_entry_text(p, digits)}" for n, p in self.weights.items()))
            parts.append("}")
        if self.analysis:
            parts.append(f',\n"analysis": {_strict_dumps(self.analysis)}')
        if self.lora:
            parts.append(f',\n"lora": {_strict_dumps(self.lora)}')
        parts.append("}\n")
        text = "".join(parts)
        if path is None:
            return text
        Path(path).write_text(text, encoding="utf-8")
        return None

    def to_dict(self, digits: int = DEFAULT_DIGITS) -> dict[str, Any]:
        """The file's content as Python objects (what json.loads of to_json gives)."""
        return json.loads(self.to_json(digits=digits))

    # ---- reading a file -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trace":
        if d.get("format", FORMAT) != FORMAT:
            raise UserError(f"not a glassformer trace (format {d.get('format')!r})")
        if int(d.get("format_version", 1)) > FORMAT_VERSION:
            raise UserError(f"trace format_version {d['format_version']} is newer than this glassformer reads ({FORMAT_VERSION}): upgrade glassformer")
        for key in ("tokens", "ids", "positions", "config", "probes"):
            if key not in d:
                raise UserError(f"the trace has no {key!r}: it is not a complete trace file")
        probes, tiles = {}, {}
        for name, e in d["probes"].items():
            if name.endswith(".tiles"):
                tiles[int(name.split(".")[1])] = _tiles_from_json(e)
            else:
                probes[name] = _entry_from_json(e)
        weights = {n: _entry_from_json(e) for n, e in d.get("weights", {}).items()}
        cfg = d["config"]
        return cls(
            tokens=list(d["tokens"]), ids=[int(i) for i in d["ids"]], positions=[int(p) for p in d["positions"]],
            config=cfg, layers=list(d.get("layers", range(cfg["n_layers"]))),
            heads=list(d.get("heads", range(cfg["n_heads"]))), probes=probes, tiles=tiles, weights=weights,
            rope_inv_freq=d.get("rope_inv_freq"), top_k=d.get("top_k"), query=d.get("query"),
            analysis=d.get("analysis", {}), lora=d.get("lora"), rope_local_inv_freq=d.get("rope_local_inv_freq"),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"no trace file at {path}: write one with `glassformer trace ... --out FILE.json`")
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


def as_trace(t) -> Trace:
    """A Trace from a Trace, a dict (parsed JSON) or a path to a trace file."""
    if isinstance(t, Trace):
        return t
    if isinstance(t, dict):
        return Trace.from_dict(t)
    if isinstance(t, (str, Path)):
        return Trace.load(t)
    raise TypeError(f"expected a Trace, a trace dict or a path, got {type(t).__name__}")


# ----------------------------------------------------------------------------- numbers


def numbers_text(a: np.ndarray, digits: int = DEFAULT_DIGITS) -> str:
    """Nested JSON lists of the numbers in `a`, `digits` significant digits, NaN/±inf as null.

    >>> numbers_text(np.array([[1.0, np.nan], [0.5, -2.0]]))
    '[[1,null],[0.5,-2]]'
    """
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 0:
        x = float(a)
        return f"%.{digits}g" % x if math.isfinite(x) else "null"
    fmt = f"%.{digits}g"
    rows = a.reshape(-1, a.shape[-1]) if a.shape[-1] else np.zeros((int(np.prod(a.shape[:-1])), 0))
    finite = np.isfinite(rows)
    items = []
    for r, ok, all_ok in zip(rows.tolist(), finite, finite.all(-1)):
        if all_ok:
            items.append("[" + ",".join([fmt % x for x in r]) + "]")
        else:
            items.append("[" + ",".join([fmt % x if f else "null" for x, f in zip(r, ok)]) + "]")
    for n in reversed(a.shape[:-1]):
        items = ["[" + ",".join(items[i:i + n]) + "]" for i in range(0, len(items), n)] if n else ["[]"]
    return items[0]


def _entry_text(p: Probe, digits: int) -> str:
    head = {"shape": list(p.data.shape), "axes": p.axes}
    if p.index:
        head["index"] = p.index
    head.update(p.extra)
    inner = ", ".join(f"{json.dumps(k)}: {_strict_dumps(v)}" for k, v in head.items())
    return "{" + inner + ', "data": ' + numbers_text(p.data.numpy(), digits) + "}"


def _entry_from_json(e: dict) -> Probe:
    data = torch.tensor(np.array(e["data"], dtype=np.float64).reshape(e["shape"]), dtype=torch.float32)
    extra = {k: v for k, v in e.items() if k not in ("shape", "axes", "data", "index")}
    return Probe(data, list(e["axes"]), dict(e.get("index", {})), extra)


def json_ready(v):
    """JSON-ready Python objects: tensors to lists, non-finite floats to None."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().double().tolist()
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): json_ready(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_ready(x) for x in v]
    return v


def _strict_dumps(v) -> str:
    return json.dumps(json_ready(v), ensure_ascii=False, allow_nan=False)


def _tiles_json(t: dict) -> dict:
    return {"shape": [len(t["steps"])], "axes": ["tile"], "query": t["query"], "position": t["position"],
            "tile_size": t["tile_size"], "heads": t["heads"], "data": t["steps"]}


def _tiles_from_json(e: dict) -> dict:
    steps = []
    for s in e["data"]:
        s = dict(s)
        for k in ("scores", "m", "l", "alpha", "o"):
            if k in s:
                s[k] = torch.tensor(np.array(s[k], dtype=np.float64), dtype=torch.float32)
        steps.append(s)
    return {"query": e["query"], "position": e["position"], "tile_size": e["tile_size"], "heads": e["heads"], "steps": steps}
