"""What every family (families.py, families_moe.py) is built from: the Family record, reading a
config.json's fields and RoPE, refusing by name what glassformer does not compute, and matching a
ModelConfig against what a family can hold. No Hugging Face tensor name is spelled here: each
family's key map lives with the family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import ModelConfig
from ..errors import UserError
from .transforms import Rule


@dataclass(frozen=True)
class Family:
    name: str  # the config.json model_type
    architecture: str  # the config.json architectures entry
    prefix: str  # the base model's prefix, absent from checkpoints saved without the LM head
    embed_key: str  # the Hugging Face token embedding (what a tied lm_head.weight must equal)
    global_rules: Callable[[ModelConfig], list[Rule]]
    layer_rules: Callable[[ModelConfig], list[Rule]]
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    ignore: tuple[str, ...] = ()  # regexes of buffers that are recomputed, never weights
    defaults: dict[str, Any] = field(default_factory=dict)
    # What export reads to pick this family: the fields (by ModelConfig name) a model of it must have,
    # each a value or a test of the value; None: never picked for export (named only).
    wants: dict[str, Any] | None = None
    # A last check on export for what `wants` cannot say field by field: the mismatches, in words.
    extra_check: Callable[[ModelConfig], list[str]] | None = None

    def rules(self, cfg: ModelConfig) -> list[Rule]:
        """Every rule with its layer index filled in, in checkpoint order."""
        out = [r for r in self.global_rules(cfg) if not r.hf.startswith("lm_head")]
        for i in range(cfg.n_layers):
            out += [r.at(i) for r in self.layer_rules(cfg)]
        out += [r for r in self.global_rules(cfg) if r.hf.startswith("lm_head")]
        return out

    def ignored(self, key: str) -> bool:
        return any(re.search(p, key) for p in self.ignore)

    def mismatches(self, cfg: ModelConfig) -> list[str]:
        """What in cfg this family cannot hold, as 'field=value' words (empty: it can hold cfg)."""
        if self.wants is None:
            return [f"{self.name} is read, never picked for export"]
        out = []
        for name, ok in self.wants.items():
            value = getattr(cfg, name)
            if not (ok(value) if callable(ok) else value == ok):
                out.append(f"{name}={value!r}")
        return out + (self.extra_check(cfg) if self.extra_check else [])


def ANY(value: Any) -> bool:
    """A `wants` test that every value passes."""
    return True


def need(hf: dict, key: str, family: str) -> Any:
    if hf.get(key) is None:
        raise UserError(f"config.json of a {family} model has no {key!r}: the folder's config is incomplete")
    return hf[key]


def hf_rope(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either era: transformers < 5 writes
    `rope_theta` and `rope_scaling`, transformers >= 5 one `rope_parameters` dict.
    A scaling whose type is 'default' is plain RoPE and comes back as None."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(hf.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(hf.get("rope_scaling") or params)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, scaling


def check_rope_scaling(scaling: dict | None, allowed: tuple[str, ...] = ("llama3", "linear")) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in allowed:
        raise UserError(
            f"config.json asks for RoPE scaling {kind!r}, which glassformer does not implement "
            f"(supported: {', '.join(allowed)}, or none)"
        )


def rope_fields(cfg: ModelConfig) -> dict:
    """Both spellings: transformers < 5 reads rope_theta/rope_scaling, >= 5 reads rope_parameters
    (and converts the old spelling too); an older reader ignores the newer key."""
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        scaling["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))  # old configs say "type"
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": float(cfg.rope_theta)}
    return {"rope_theta": float(cfg.rope_theta), "rope_scaling": scaling, "rope_parameters": params}


def refuse_switches(hf: dict, family: str, offs: dict[str, Any]) -> None:
    """Refuse by name a config.json field that would change the computation in a way glassformer
    does not reproduce: `offs` maps each such field to the one value (or a test) that is harmless;
    an absent or null field is its default."""
    for key, ok in offs.items():
        if key not in hf or hf[key] is None:
            continue
        value = hf[key]
        if not (ok(value) if callable(ok) else value == ok):
            raise UserError(f"config.json: {key}={value!r} in a {family} model is not supported (glassformer "
                            f"would compute something else{'' if callable(ok) else f'; it needs {ok!r}'})")


def partial_rotary(hf: dict, family: str) -> None:
    """Refuse RoPE on part of each head (partial_rotary_factor < 1: Phi-4-mini, StableLM): every
    glassformer head turns all its pairs."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    for where in (hf, params):
        f = where.get("partial_rotary_factor")
        if f is not None and float(f) != 1.0:
            raise UserError(f"config.json: partial_rotary_factor={f} in a {family} model (RoPE on part of each "
                            "head) is not supported; glassformer turns every pair of a head")


def layer_windows(types: Any, window: Any, n: int, family: str) -> tuple[int | None, list | None]:
    """(sliding_window, layer_types) for a ModelConfig from a config.json's per-layer types (None: every
    layer full) and the window its sliding layers use (None: the model does not slide): no window when
    no layer slides, one window and no list when every layer slides, both when they mix."""
    types = ["full_attention"] * n if types is None else types
    if not isinstance(types, list) or len(types) != n or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise UserError(f"config.json: layer_types of a {family} model must list {n} entries, each "
                        f"'full_attention' or 'sliding_attention'; got {str(types)[:80]}")
    sliding = [t == "sliding_attention" for t in types]
    if window is None or not any(sliding):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(f"config.json: sliding_window={window!r} in a {family} model is not a positive whole number")
    return (window, None) if all(sliding) else (window, list(types))


def layer_types_out(cfg: ModelConfig) -> list[str]:
    """Every layer's kind as transformers' layer_types spells it."""
    return ["sliding_attention" if cfg.window_at(i) is not None else "full_attention" for i in range(cfg.n_layers)]


def build(family: str, **fields: Any) -> ModelConfig:
    """ModelConfig(**fields), its own checks (sizes, switches) said as this family's."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise UserError(f"config.json describes a {family} model that glassformer cannot build: {e}") from None
