"""LoRA adapters in PEFT's layout, out and in (Llama-family models: llama, mistral, qwen2).

    save_peft(model, out)          DIR/base/ (the base's Hugging Face folder, save_hf) and the adapter
                                   beside it: adapter_config.json + adapter_model.safetensors
    is_peft_folder(path)           whether path holds a PEFT adapter (adapter_config.json)
    read_peft(folder, base=None)   the adapter's config checked, where its base is: a PeftAdapter
    attach_peft(model, adapter)    the base model with the adapter applied (convert/lora.py)
    load_peft(folder, load, ...)   both, with the base loaded by `load` (checkpoint.loading's)

PEFT stores A (r, in) and B (out, r) as our adapter does, under the Hugging Face module's name
(`base_model.model.` + the module's Hugging Face name + `.lora_A.weight`). The names and any row
reordering come from the family's rules (families.py): B's rows are its product's output rows,
so B takes the transform of the weight it adapts (rope_q/rope_k reorder q and k rows when the
model pairs RoPE features the interleaved way); A acts on the input and is copied. GPT-2 fuses
q, k and v into one Conv1D (c_attn), which no per-product adapter maps onto: refused by name.
docs/lora.md#peft.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint.checks import check_adapter_file, header_shapes, json_object, open_safetensors, read_tensors
from ..checkpoint.folders import tensor_bytes
from ..checkpoint.hub import parse_name
from ..errors import UserError
from ..files import atomic_folder, read_json
from .families import Family, family_for, family_named
from .hf import parse_dtype, save_hf
from .lora import (LORA_TARGETS, LoraConfig, adapter_shapes, adapter_state, apply_lora, base_sha256, base_state,
                   load_adapter_state)
from .transforms import Rule

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
BASE = "base"  # the base's folder inside an exported one, as base_model_name_or_path names it
# The families whose attention and feed-forward are one Hugging Face module per product of ours.
PEFT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3", "gemma2", "gemma3_text")
# Options that change what a PEFT adapter computes (or which weights it replaces), each with the
# value plain LoRA has. A folder with any other value is refused, naming them.
PLAIN = {
    "bias": "none", "use_dora": False, "use_rslora": False, "lora_bias": False, "fan_in_fan_out": False,
    "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
    "layer_replication": None, "trainable_token_indices": None, "target_parameters": None,
    "use_qalora": False, "alora_invocation_tokens": None, "use_bdlora": None, "loftq_config": {},
    "megatron_config": None, "arrow_config": None, "kasa_config": None, "velora_config": None,
    "monteclora_config": None,
}
# init_lora_weights values after which the adapter still belongs to the unchanged base (the
# others, PiSSA, OLoRA, CorDA, LoftQ, rewrite the base weights too).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


def _refuse_gpt2(family: Family, what: str) -> None:
    if family.name not in PEFT_FAMILIES:
        raise UserError(f"{what} is a {family.name} model: PEFT LoRA is supported for "
                        f"{', '.join(PEFT_FAMILIES)} only; GPT-2 and Phi-3 fuse q, k and v into one product (c_attn, "
                        "qkv_proj) and the mixtures hold their experts fused, which glassformer's per-product "
                        "adapters do not map onto")


def module_rules(family: Family, cfg) -> dict[str, tuple[str, Rule]]:
    """Our adaptable module ("blocks.0.attn.wq") -> (its Hugging Face module, the weight's rule)."""
    out = {}
    for rule in family.rules(cfg):
        if len(rule.ours) == 1 and rule.ours[0].endswith(".weight") and rule.hf.endswith(".weight"):
            ours = rule.ours[0][: -len(".weight")]
            if ours.rpartition(".")[2] in LORA_TARGETS:
                out[ours] = (rule.hf[: -len(".weight")], rule)
    return out


def hf_target_names(family: Family, cfg) -> dict[str, str]:
    """Our target name -> the Hugging Face module name PEFT's target_modules uses (the last part of
    the family's name for the product, as families.py spells it)."""
    return {ours.rpartition(".")[2]: hf.rpartition(".")[2] for ours, (hf, _) in module_rules(family, cfg).items()}


# ----------------------------------------------------------------------------- export


def peft_state(model: torch.nn.Module, family: Family, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's adapter under PEFT's keys: A copied, B's rows in the Hugging Face order of its weight."""
    cfg, ours = model.config, adapter_state(model)
    out = {}
    for module, (hf, rule) in module_rules(family, cfg).items():
        if module + ".lora_A" not in ours:
            continue
        a, b = ours.pop(module + ".lora_A"), ours.pop(module + ".lora_B")
        out[f"{PREFIX}{hf}.lora_A.weight"] = a  # acts on the input, whose order the export keeps
        out[f"{PREFIX}{hf}.lora_B.weight"] = rule.to_hf({rule.ours[0]: b}, cfg)  # (out, r): W's rows
    assert not ours, f"adapters with no Hugging Face module: {sorted(ours)[:3]}"
    return {k: (v if dtype is None else v.to(dtype)).detach().cpu().contiguous() for k, v in out.items()}


def peft_config(lora: LoraConfig, family: Family, cfg) -> dict:
    """adapter_config.json for `lora`: plain LoRA over the base in the folder's base/."""
    names = hf_target_names(family, cfg)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE, "revision": None,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(names[t] for t in lora.targets), "inference_mode": True,
        "bias": "none", "use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def save_peft(model: torch.nn.Module, out: str | Path, tokenizer=None, dtype: str | torch.dtype | None = None,
              eot_id: int | None = None) -> Path:
    """Write an adapted model (apply_lora) as `out/base/` (save_hf of its base) and the adapter in
    PEFT's layout beside it, atomically. tokenizer and eot_id: as save_hf takes them."""
    from safetensors.torch import save_file

    from ..checkpoint.builder import model_from_state

    lora = getattr(model, "lora_config", None)
    if lora is None:
        raise UserError("this checkpoint has no LoRA adapter: --peft exports an adapter run "
                        "(train --init-from CKPT --lora-r 8); drop --peft to export a plain model")
    family = family_for(model.config)  # refuses, by name, what no family can hold
    _refuse_gpt2(family, "this checkpoint")
    dtype = parse_dtype(dtype)
    base = model_from_state(model.config, base_state(model))  # the same tensors, the plain modules
    adapter = peft_state(model, family, dtype)

    def write(tmp: Path) -> None:
        save_hf(base, tmp / BASE, tokenizer, dtype=dtype, eot_id=eot_id)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, family, model.config), indent=2) + "\n")
        save_file(adapter, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})

    return atomic_folder(out, write, need=tensor_bytes(adapter))  # save_hf checks the base's bytes


# ----------------------------------------------------------------------------- import


@dataclass(frozen=True)
class PeftAdapter:
    """A checked PEFT LoRA folder: its config and where its base is."""

    folder: Path
    base: Path
    r: int
    alpha: float
    dropout: float


def is_peft_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file()


def _off(value, plain) -> bool:
    return value == plain or (not value and not plain)  # [] and {} and None are all "none given"


def check_peft_config(config: dict, folder: Path) -> None:
    """Refuse, naming each, what plain LoRA on a causal LM does not have."""
    json_object(config, folder / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise UserError(f"{folder}: peft_type {config.get('peft_type')!r}; glassformer reads LORA adapters only")
    if config.get("task_type") not in ("CAUSAL_LM", None):
        raise UserError(f"{folder}: task_type {config['task_type']!r}; glassformer reads CAUSAL_LM adapters only")
    bad = [f"{k}={json.dumps(config[k])}" for k, plain in PLAIN.items() if k in config and not _off(config[k], plain)]
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        bad.append(f"init_lora_weights={json.dumps(init)} (it changes the base weights)")
    if bad:
        raise UserError(f"{folder}: unsupported PEFT options {', '.join(bad)}; glassformer reads plain LoRA "
                        "(bias none, no DoRA, no rsLoRA, no per-layer ranks, no modules_to_save)")
    _check_peft_numbers(config, folder / ADAPTER_CONFIG)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_peft_numbers(config: dict, file: Path) -> None:
    """r a whole number of at least 1, lora_alpha above 0, lora_dropout in [0, 1), the base's name text:
    each named with its value. (r against the weights' shapes: attach_peft, before allocating.)"""
    for key in ("r", "lora_alpha"):
        if not _number(config.get(key)):
            raise UserError(f"{file} has no number {key!r} (got {config.get(key)!r})")
    if config["r"] < 1 or not float(config["r"]).is_integer():
        raise UserError(f"{file}: r must be a whole number of at least 1, got {config['r']!r}")
    if not config["lora_alpha"] > 0:
        raise UserError(f"{file}: lora_alpha must be above 0, got {config['lora_alpha']!r}")
    dropout = config.get("lora_dropout")
    if dropout is not None and not (_number(dropout) and 0 <= dropout < 1):
        raise UserError(f"{file}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    name = config.get("base_model_name_or_path")
    if name is not None and not isinstance(name, str):
        raise UserError(f"{file}: base_model_name_or_path must be a folder or a Hub name (text), got {name!r}")


def _base_folder(config: dict, folder: Path, base: str | Path | None) -> Path:
    if base is not None:
        return Path(base)
    name = config.get("base_model_name_or_path")
    if not name:
        raise UserError(f"{folder / ADAPTER_CONFIG} names no base model: pass --base FOLDER")
    path = Path(name) if Path(name).is_absolute() else folder / name
    if not path.exists() and parse_name(name) is not None:
        return Path(name)  # a Hub name (org/name), which load fetches or finds in the cache
    if not path.exists():
        raise UserError(f"{folder}: its base {name!r} is not a folder at {path}: pass --base FOLDER "
                        "(a Hugging Face or glassformer checkpoint of the base model)")
    return path


def _check_base_family(base: Path) -> None:
    """A Hugging Face base must be of a Llama family (read before any weight is)."""
    cfg = base / "config.json"
    if cfg.is_file():
        meta = read_json(cfg)
        if isinstance(meta, dict) and "model_type" in meta:
            _refuse_gpt2(family_named(meta["model_type"], str(cfg)), f"the base {base}")


def read_peft(folder: str | Path, base: str | Path | None = None) -> PeftAdapter:
    """A PEFT LoRA folder's config, checked, and where its base is (`base` overrides the
    base_model_name_or_path, which is read relative to the folder). Reads no weights."""
    folder = Path(folder)
    if not is_peft_folder(folder):
        raise UserError(f"{folder} has no {ADAPTER_CONFIG}: it is not a PEFT adapter folder")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"{folder} has no {ADAPTER_WEIGHTS} (pickled adapter_model.bin is not read): "
                        "save the adapter with safe_serialization")
    config = read_json(folder / ADAPTER_CONFIG)
    check_peft_config(config, folder)
    path = _base_folder(config, folder, base)
    _check_base_family(path)
    return PeftAdapter(folder, path, int(config["r"]), float(config["lora_alpha"]),
                       float(config.get("lora_dropout") or 0.0))


_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def _our_keys(keys, family: Family, cfg, file: Path) -> dict[str, tuple[str, Rule]]:
    """Each PEFT key -> (our key, the rule of the weight it adapts); a key that adapts no product
    glassformer can is refused, naming it."""
    by_hf = {hf: (ours, rule) for ours, (hf, rule) in module_rules(family, cfg).items()}
    out, unknown = {}, []
    for key in keys:
        m = _KEY.match(key)
        if m is None or m["module"] not in by_hf:
            unknown.append(key)
            continue
        ours, rule = by_hf[m["module"]]
        out[key] = (f"{ours}.lora_{m['ab']}", rule)
    if unknown:
        names = ", ".join(sorted(unknown)[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise UserError(f"{file}: {names} adapt no product glassformer can (LoRA on the projections "
                        f"{', '.join(sorted(set(hf_target_names(family, cfg).values())))} only)")
    return out


def _our_tensors(handle, keys: dict[str, tuple[str, Rule]], cfg, file: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors under our keys, B's rows in our order (A acts on the input: copied)."""
    out = {}
    for key, t in read_tensors(handle, file, list(keys)).items():
        ours, rule = keys[key]
        if not t.is_floating_point():
            raise UserError(f"{file.name}: {key} is {t.dtype}, not a floating-point tensor")
        out[ours] = t if ours.endswith(".lora_A") else rule.to_ours(t, cfg)[rule.ours[0]]
    return out


def _targets(state: dict[str, torch.Tensor], cfg, folder: Path) -> tuple[str, ...]:
    """The targets every layer has, in LORA_TARGETS' order; an adapter on some layers only is refused."""
    per_layer = [{k.split(".")[3] for k in state if k.startswith(f"blocks.{i}.")} for i in range(cfg.n_layers)]
    if any(s != per_layer[0] for s in per_layer) or not per_layer[0]:
        raise UserError(f"{folder}: the adapter covers different products in different layers "
                        f"({[sorted(s) for s in per_layer]}); glassformer adapts the same products in every layer")
    return tuple(t for t in LORA_TARGETS if t in per_layer[0])


def attach_peft(model: torch.nn.Module, adapter: PeftAdapter) -> torch.nn.Module:
    """Apply the PEFT adapter to its (loaded) base model, in place: apply_lora then its tensors,
    checked against the model's products (names and shapes), cast to the model's dtype."""
    family = family_for(model.config)
    _refuse_gpt2(family, f"the base of {adapter.folder}")
    file = adapter.folder / ADAPTER_WEIGHTS
    handle = open_safetensors(file)  # the header: names and shapes, checked before any adapter is allocated
    keys = _our_keys(handle.keys(), family, model.config, file)
    header = header_shapes(handle)
    shapes = {ours: header[key] for key, (ours, _) in keys.items()}
    lora = LoraConfig(r=adapter.r, alpha=adapter.alpha, dropout=adapter.dropout,
                      targets=_targets(shapes, model.config, adapter.folder))
    check_adapter_file(adapter_shapes(model, lora), shapes, file, adapter.folder / ADAPTER_CONFIG, lora.r)
    apply_lora(model, lora)
    dtype = next(model.parameters()).dtype
    state = _our_tensors(handle, keys, model.config, file)
    load_adapter_state(model, {k: v.to(dtype) for k, v in state.items()}, where=str(file))
    return model


def load_peft(folder: str | Path, load: Callable, base: str | Path | None = None, **kwargs):
    """(adapted model, the base's tokenizer) from a PEFT folder; `load(path, **kwargs)` loads the
    base (checkpoint.loading.load passes itself: this module cannot import it, which imports this).
    model.lora_base records the base as an adapter checkpoint's config does, so a run that starts
    from the folder (--init-from) writes adapter checkpoints of the same base."""
    adapter = read_peft(folder, base)
    model, tokenizer = load(adapter.base, **kwargs)
    model.lora_base = {"path": str(adapter.base), "sha256": base_sha256(model)}
    return attach_peft(model, adapter), tokenizer
