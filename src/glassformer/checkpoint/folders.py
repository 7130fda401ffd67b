"""Checkpoint folders: config.json + model.safetensors + tokenizer.json (+ COMPLETE).

A checkpoint is written into a temporary sibling folder, fsynced, and renamed into place,
so a crash never leaves half a checkpoint under the real name; `COMPLETE` is written last
and a folder without it is ignored. Loading never unpickles anything.

`load(path)` accepts a checkpoint folder, a training run folder (its `latest` checkpoint)
or a Hugging Face folder (config.json with a `model_type`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..errors import UserError, read_json

FORMAT = "glassformer"
FORMAT_VERSION = 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_folder(dst: str | Path, write: Callable[[Path], None]) -> Path:
    """Run write(tmp) on a fresh temporary sibling of dst, fsync it, write COMPLETE, rename to dst.

    If anything fails, the temporary folder is removed and an existing dst is untouched.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(tmp)
        if dst.exists():  # replacing: move the old one aside first, so dst is never half-written
            old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
            dst.rename(old)
            tmp.rename(dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dst)
        fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() with a tied LM head stored once (as embed.weight), contiguous, detached."""
    sd = model.state_dict()
    if getattr(model.config, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in sd.items()}


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
    if tokenizer is not None:
        if isinstance(tokenizer, (str, Path)):
            shutil.copyfile(tokenizer, folder / "tokenizer.json")
        else:
            tokenizer.save(str(folder / "tokenizer.json"))


def save_model(dst: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> Path:
    """Write a complete checkpoint folder atomically. tokenizer: an object with save(path), or a tokenizer.json path."""
    return atomic_folder(dst, lambda tmp: write_model_files(tmp, model, tokenizer))


def is_complete(folder: Path) -> bool:
    return (folder / "COMPLETE").is_file() and (folder / "config.json").is_file()


def resolve(path: str | Path) -> Path:
    """The checkpoint folder that `path` names: itself, a run folder's `latest`, or the folder a
    run's `latest` / `best` pointer file names."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: give a checkpoint folder, a run folder or a Hugging Face folder")
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
    if not (path / "config.json").is_file():
        raise UserError(f"{path} has no config.json: it is not a checkpoint, run or Hugging Face folder")
    return path


def read_config(folder: str | Path) -> dict:
    folder = resolve(folder)
    return read_json(folder / "config.json")


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) from a checkpoint, run or Hugging Face folder; tokenizer is None if absent."""
    from ..model import Transformer

    folder = resolve(path)
    meta = read_config(folder)
    if meta.get("format") != FORMAT:
        if "model_type" in meta:
            from ..convert import load_hf  # the conversion module handles Hugging Face folders

            return load_hf(folder, device=device, dtype=dtype)
        raise UserError(f"{folder / 'config.json'} is neither a glassformer nor a Hugging Face config")
    if meta.get("format_version", 1) > FORMAT_VERSION:
        raise UserError(f"{folder} was written by a newer glassformer (format {meta['format_version']}); upgrade glassformer")
    if not (folder / "COMPLETE").is_file():
        raise UserError(f"checkpoint {folder} is incomplete (no COMPLETE marker): it was being written when a run stopped")
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dict(meta["model"])
    with torch.device("meta"):
        model = Transformer(cfg)
    state = load_file(str(folder / "model.safetensors"))
    model = model.to_empty(device=device)
    if cfg.pos == "rope":
        from ..model import rope_inv_freq

        model.rope_inv_freq = rope_inv_freq(cfg).to(device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unexpected:
        raise UserError(f"{folder / 'model.safetensors'} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from ..text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    return model.eval(), tokenizer


# ----------------------------------------------------------------------------- training checkpoints
# A training checkpoint adds train_state.safetensors (optimizer moments by parameter name, RNG
# states as byte tensors) and train_state.json (step, schedule, RNG scalars, data position,
# the TrainConfig) to the model files. Run folder: step-NNNNNN/ checkpoints and `latest` /
# `best` pointer files naming one of them.

STEP_PREFIX = "step-"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def _flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A name-keyed optimizer state dict as safetensors tensors + JSON param groups."""
    tensors = {}
    for name, entry in osd.get("state", {}).items():
        for key, value in entry.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            tensors[f"optim/{name}/{key}"] = t.detach().contiguous().cpu()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd.get("param_groups", [])]
    return tensors, groups


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for key, t in tensors.items():
        if key.startswith("optim/"):
            name, _, field_ = key[len("optim/"):].rpartition("/")
            state.setdefault(name, {})[field_] = t
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def write_pointer(run: Path, name: str, target: str) -> None:
    """Atomically point run/name (`latest` or `best`) at a checkpoint folder name."""
    tmp = run / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as fh:
        fh.write(target + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, run / name)
    fsync_dir(run)


def read_pointer(run: Path, name: str) -> str | None:
    p = Path(run) / name
    return p.read_text().strip() if p.is_file() else None


def save_training(run: str | Path, step: int, config: ModelConfig, model_state_: dict, tokenizer: Any,
                  optim_state: dict, state: dict, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write run/step-NNNNNN atomically (COMPLETE last), then move `latest` to it.

    state: JSON-able training state; tensors: extra tensors (RNG states). If any write fails
    the temporary folder is removed, `latest` is unchanged, and the error is raised.
    """
    from safetensors.torch import save_file

    run = Path(run)
    opt_tensors, groups = _flatten_optimizer(optim_state)

    def write(tmp: Path) -> None:
        write_state_files(tmp, config, model_state_, tokenizer)
        save_file({**opt_tensors, **(tensors or {})}, str(tmp / "train_state.safetensors"))
        (tmp / "train_state.json").write_text(json.dumps({**state, "param_groups": groups}, indent=2) + "\n")

    folder = atomic_folder(run / step_name(step), write)
    write_pointer(run, "latest", folder.name)
    return folder


def load_training(folder: str | Path) -> tuple[dict, dict, dict, dict]:
    """(model state, optimizer state, train_state.json dict, extra tensors) of a training checkpoint."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "COMPLETE").is_file() or not (folder / "train_state.json").is_file():
        raise UserError(f"{folder} is not a complete training checkpoint (no COMPLETE or train_state.json)")
    state = json.loads((folder / "train_state.json").read_text())
    tensors = load_file(str(folder / "train_state.safetensors"))
    optim = _unflatten_optimizer(tensors, state.pop("param_groups"))
    extra = {k: v for k, v in tensors.items() if not k.startswith("optim/")}
    model_sd = load_file(str(folder / "model.safetensors"))
    return model_sd, optim, state, extra


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


def prune(run: str | Path, keep_last: int, keep: set[str]) -> None:
    """Keep the newest keep_last checkpoints and those named in keep (the best, the latest)."""
    found = complete_checkpoints(run)
    doomed = found[:-keep_last] if keep_last > 0 else found
    for p in doomed:
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
