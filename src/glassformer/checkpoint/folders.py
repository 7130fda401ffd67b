"""Checkpoint and run folders: config.json + model.safetensors + tokenizer.json (+ COMPLETE),
and a run's step-NNNNNN checkpoints with `latest` / `best` pointer files.

Written atomically (files.atomic_folder; `COMPLETE` last, a folder without it is ignored);
loading never unpickles anything (docs/training.md#run-folder). Building the model:
builder.py; training state: training.py; `load`: loading.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..files import atomic_folder, atomic_text, read_json
from .builder import model_state
from .checks import json_object
from .hub import find
from .sharded import consolidate, is_sharded

FORMAT = "glassformer"
FORMAT_VERSION = 1
STEP_PREFIX = "step-"
PEFT_CONFIG = "adapter_config.json"  # a PEFT LoRA folder, which load reads (convert/peft.py)


# ----------------------------------------------------------------------------- one checkpoint folder


# What travels with tokenizer.json: the chat template(s), special tokens and the eos ids, as
# Hugging Face folders keep them (text/tokenizer.py reads them; docs/chat.md#templates).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")
TOKENIZER_SIDE_DIR = "additional_chat_templates"


def write_tokenizer(folder: Path, tokenizer: Any) -> None:
    """tokenizer.json (+ its configs) in folder: tokenizer is None, a tokenizer.json path (copied
    as is, with the configs beside it), an object with save_folder(folder), or one with save(path)."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, Path)):
        src = Path(tokenizer)
        shutil.copyfile(src, folder / "tokenizer.json")
        for name in TOKENIZER_SIDE_FILES:
            if (src.parent / name).is_file():
                shutil.copyfile(src.parent / name, folder / name)
        if (src.parent / TOKENIZER_SIDE_DIR).is_dir():
            shutil.copytree(src.parent / TOKENIZER_SIDE_DIR, folder / TOKENIZER_SIDE_DIR)
    elif hasattr(tokenizer, "save_folder"):
        tokenizer.save_folder(folder)
    else:
        tokenizer.save(str(folder / "tokenizer.json"))


def write_model_files(folder: Path, model: torch.nn.Module, tokenizer: Any = None, extra: dict | None = None) -> None:
    write_state_files(folder, model.config, model_state(model), tokenizer, extra)


def write_state_files(folder: Path, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Any = None,
                      extra: dict | None = None) -> None:
    """config.json + model.safetensors (+ tokenizer.json) from a config and a full state dict."""
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": config.to_dict()}
    if extra:
        meta.update(extra)
    if config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.detach().contiguous() for k, v in state.items()}
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder, tokenizer)


def tensor_bytes(*states: dict[str, torch.Tensor]) -> int:
    """The bytes the tensors of states take in a safetensors file (its header aside): what a save needs
    free on the disk (files.atomic_folder checks it before writing)."""
    return sum(t.numel() * t.element_size() for state in states for t in state.values())


def save_model(dst: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> Path:
    """Write a complete checkpoint folder atomically. tokenizer: as write_tokenizer takes it."""
    return atomic_folder(dst, lambda tmp: write_model_files(tmp, model, tokenizer),
                         need=tensor_bytes(model_state(model)))


def is_complete(folder: Path) -> bool:
    return (folder / "COMPLETE").is_file() and (folder / "config.json").is_file()


def resolve(path: str | Path, weights: bool = True) -> Path:
    """The checkpoint folder that `path` names: itself, a run folder's `latest`, the folder a
    run's `latest` / `best` pointer file names, or a Hugging Face Hub name's snapshot (hub.py;
    weights=False fetches only its config). A sharded (DCP) training checkpoint gets its
    model.safetensors consolidated once when weights are wanted, so every reader takes one file."""
    folder = _resolve(path, weights)
    if weights and is_sharded(folder):
        consolidate(folder)
    return folder


def _resolve(path: str | Path, weights: bool) -> Path:
    path = find(path, weights=weights)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: give a checkpoint folder, a run folder, a Hugging Face folder "
                        "or a Hugging Face Hub name (org/name)")
    if path.is_file() and path.name in ("latest", "best"):  # a run's pointer: the checkpoint it names
        ckpt = path.parent / path.read_text().strip()
        if not is_complete(ckpt):
            raise UserError(f"{path} names checkpoint {ckpt.name}, which is missing or incomplete")
        return ckpt
    if not path.is_dir():
        raise UserError(f"checkpoint {path} is a file; give the folder that holds config.json")
    latest = path / "latest"
    if latest.is_file():
        ckpt = path / latest.read_text().strip()
        if not is_complete(ckpt):
            raise UserError(f"run {path}: its latest checkpoint {ckpt.name} is missing or incomplete")
        return ckpt
    if not (path / "config.json").is_file() and not (path / PEFT_CONFIG).is_file():
        raise UserError(f"{path} has no config.json: it is not a checkpoint, run or Hugging Face folder")
    return path


def read_config(folder: str | Path) -> dict:
    """config.json of the folder `folder` names (resolve); a PEFT adapter folder's adapter_config.json.
    A UserError naming the file when it is not a JSON object."""
    folder = resolve(folder, weights=False)  # a Hub name: its config.json alone
    path = folder / "config.json" if (folder / "config.json").is_file() else folder / PEFT_CONFIG
    return json_object(read_json(path), path)


# ----------------------------------------------------------------------------- run folders


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def write_pointer(run: Path, name: str, target: str) -> None:
    """Atomically point run/name (`latest` or `best`) at a checkpoint folder name."""
    atomic_text(Path(run) / name, target + "\n")


def read_pointer(run: Path, name: str) -> str | None:
    p = Path(run) / name
    return p.read_text().strip() if p.is_file() else None


def complete_checkpoints(run: str | Path) -> list[Path]:
    """The run's complete step-NNNNNN folders, oldest first."""
    run = Path(run)
    if not run.is_dir():
        return []
    found = [p for p in run.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and p.name[len(STEP_PREFIX):].isdigit() and is_complete(p) and (p / "train_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def newest_checkpoint(run: str | Path) -> Path | None:
    """The checkpoint --resume continues from: `latest` if complete, else the newest complete one."""
    run = Path(run)
    name = read_pointer(run, "latest")
    if name and is_complete(run / name) and (run / name / "train_state.json").is_file():
        return run / name
    found = complete_checkpoints(run)
    return found[-1] if found else None


def remove_leftovers(run: str | Path) -> list[str]:
    """Delete temporary folders/files a crashed save left behind (never a complete checkpoint)."""
    run, removed = Path(run), []
    if run.is_dir():
        for p in run.iterdir():
            if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
            elif p.is_dir() and p.name.startswith(STEP_PREFIX) and not is_complete(p):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


SNAPSHOTS = "snapshots"  # run/snapshots: the names of the checkpoints --snapshot-every keeps, one a line


def read_snapshots(run: str | Path) -> list[str]:
    """The checkpoint names listed in run/snapshots (train --snapshot-every), in the file's order."""
    p = Path(run) / SNAPSHOTS
    if not p.is_file():
        return []
    return [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]


def add_snapshot(run: str | Path, name: str) -> None:
    """List checkpoint `name` in run/snapshots (rewritten atomically), so prune keeps it."""
    names = read_snapshots(run)
    if name not in names:
        atomic_text(Path(run) / SNAPSHOTS, "".join(n + "\n" for n in names + [name]))


def prune(run: str | Path, keep_last: int, keep: set[str]) -> None:
    """Keep the newest keep_last checkpoints, those named in keep (the best, the latest) and the
    snapshots (run/snapshots: the explorer's checkpoint slider reads them)."""
    found = complete_checkpoints(run)
    doomed = found[:-keep_last] if keep_last > 0 else found
    keep = set(keep) | set(read_snapshots(run))
    for p in doomed:
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
