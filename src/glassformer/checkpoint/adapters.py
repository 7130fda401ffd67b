"""Adapter checkpoints: a LoRA adapter without its base's weights (docs/lora.md#the-adapter-checkpoint).

    config.json          {"format": "glassformer", "model": ModelConfig, "lora": {"r", "alpha", "dropout",
                          "targets", "base": {"path", "sha256"}}}
    adapter.safetensors  blocks.{i}.attn.wq.lora_A (r, in), ….lora_B (out, r), ...
    tokenizer.json       as any checkpoint's
    COMPLETE             written last (files.atomic_folder)

The base is found by its path (a relative one from the folder that holds the checkpoint: the run,
for a run's step-NNNNNN) or by `--base CKPT`, and must hash to the sha256 recorded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..convert.lora import (LoraConfig, adapter_part, adapter_shapes, adapter_state, apply_lora, base_sha256,
                           load_adapter_state)
from ..errors import UserError
from ..files import atomic_folder
from .checks import check_adapter_file, header_shapes, open_safetensors, read_tensors
from .folders import FORMAT, FORMAT_VERSION, resolve, tensor_bytes, write_tokenizer
from .hub import parse_name

ADAPTER_FILE = "adapter.safetensors"


def is_adapter(meta: dict) -> bool:
    """Whether a checkpoint's config.json describes an adapter (no weights of its own base)."""
    return meta.get("format") == FORMAT and "lora" in meta


def base_record(base: str | Path, holder: str | Path, sha256: str) -> dict:
    """{"path", "sha256"} for config.json: a relative local path is stored relative to `holder`
    (the folder the adapter checkpoint will sit in); an absolute path or a Hub name as given."""
    p = Path(base)
    if p.is_absolute() or not p.exists():
        return {"path": str(base), "sha256": sha256}
    return {"path": os.path.relpath(p.resolve(), Path(holder).resolve()), "sha256": sha256}


def write_adapter_files(folder: Path, model: torch.nn.Module, base: dict, tokenizer: Any = None,
                        state: dict[str, torch.Tensor] | None = None) -> None:
    """config.json + adapter.safetensors (+ tokenizer.json) of an adapted model into folder.
    state: the adapter's tensors when they come from elsewhere (a whole state dict is cut down)."""
    from safetensors.torch import save_file

    lora = {**model.lora_config.to_dict(), "base": dict(base)}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model.config.to_dict(), "lora": lora}
    tensors = adapter_part(state) if state is not None else adapter_state(model)
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(folder / ADAPTER_FILE),
              metadata={"format": "pt"})
    write_tokenizer(folder, tokenizer)


def save_adapter(dst: str | Path, model: torch.nn.Module, base: str | Path, tokenizer: Any = None) -> Path:
    """Write an adapter checkpoint folder atomically; `base` is the base checkpoint's path."""
    dst = Path(dst)
    record = base_record(base, dst.parent, base_sha256(model))
    return atomic_folder(dst, lambda tmp: write_adapter_files(tmp, model, record, tokenizer),
                         need=tensor_bytes(adapter_state(model)))


def lora_config(folder: Path, meta: dict) -> LoraConfig:
    """The LoraConfig of adapter checkpoint `folder`'s config.json, its "lora" object checked (r, alpha,
    dropout, targets, and the base's path and sha256); a UserError naming the file."""
    file, lora = folder / "config.json", meta.get("lora")
    base = lora.get("base") if isinstance(lora, dict) else None
    if not isinstance(base, dict) or not all(isinstance(base.get(k), str) for k in ("path", "sha256")):
        raise UserError(f"{file}: \"lora\" must be an object with r, alpha and base {{\"path\", \"sha256\"}} (text): "
                        "restore the config.json saved with the adapter")
    r = lora.get("r")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not isinstance(lora.get("alpha", 16.0), (int, float)):
        raise UserError(f"{file}: lora r and alpha must be numbers, got {r!r} and {lora.get('alpha')!r}: "
                        "restore the config.json saved with the adapter")
    try:
        return LoraConfig.from_dict(lora)
    except (UserError, ValueError, TypeError) as e:
        raise UserError(f"{file}: {e}") from None


def base_location(folder: Path, meta: dict, override: str | Path | None = None) -> Path:
    """The base checkpoint of adapter checkpoint `folder`: --base when given, else its recorded path
    (a relative one from the folder holding the checkpoint), resolved as any checkpoint is (a run's
    latest, a Hub name); a UserError naming both and saying to pass --base when it is not there."""
    lora_config(folder, meta)  # its base's record checked before it is followed
    path = str(override) if override is not None else meta["lora"]["base"]["path"]
    local = Path(path) if override is not None or Path(path).is_absolute() else folder.parent / path
    try:
        return resolve(path if not local.exists() and parse_name(path) else local)  # or a Hub name
    except UserError as e:
        said = f"--base {path}" if override is not None else f"its base {path} (looked for {local})"
        raise UserError(f"adapter {folder} needs {said}, which cannot be read ({e}): "
                        "pass --base CKPT, the checkpoint it was trained on") from None


def attach(model: torch.nn.Module, folder: Path, meta: dict, base: str | Path) -> torch.nn.Module:
    """The adapter of checkpoint `folder` put onto `model` (its base, loaded from `base` in fp32),
    after checking the base's sha256 against the one recorded; model.lora_base says where it came from."""
    lora = lora_config(folder, meta)
    want = meta["lora"]["base"]["sha256"]
    got = base_sha256(model)
    if got != want:
        raise UserError(f"adapter {folder} was trained on a base with sha256 {want} ({meta['lora']['base']['path']}), "
                        f"but {base} has sha256 {got}: pass --base CKPT with the base it was trained on")
    if not (folder / ADAPTER_FILE).is_file():
        raise UserError(f"adapter checkpoint {folder} has no {ADAPTER_FILE}")
    file = folder / ADAPTER_FILE
    handle = open_safetensors(file)  # its shapes against r and the base's products before any adapter exists
    check_adapter_file(adapter_shapes(model, lora), header_shapes(handle), file, folder / "config.json", lora.r)
    apply_lora(model, lora)
    load_adapter_state(model, read_tensors(handle, file), where=str(file))
    model.lora_base = {"path": str(base), "sha256": want}
    return model
