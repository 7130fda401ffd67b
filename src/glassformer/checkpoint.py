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

from .config import ModelConfig
from .errors import UserError

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
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model.config.to_dict()}
    if extra:
        meta.update(extra)
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file(model_state(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
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
    """The checkpoint folder that `path` names: itself, or a run folder's `latest`."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: give a checkpoint folder, a run folder or a Hugging Face folder")
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
    try:
        return json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{folder / 'config.json'} is not valid JSON ({e})") from None


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) from a checkpoint, run or Hugging Face folder; tokenizer is None if absent."""
    from .model import Transformer

    folder = resolve(path)
    meta = read_config(folder)
    if meta.get("format") != FORMAT:
        if "model_type" in meta:
            from .convert import load_hf  # the conversion module handles Hugging Face folders

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
        from .model import rope_inv_freq

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
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    return model.eval(), tokenizer
