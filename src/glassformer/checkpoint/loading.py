"""`load(CKPT) -> (model, tokenizer)`: a checkpoint folder, a training run folder (its `latest`
checkpoint), a Hugging Face folder (config.json with a `model_type`) or an adapter checkpoint
(its base loaded, then the adapter put on: adapters.py; a PEFT LoRA folder: convert/peft.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..convert.hf import load_hf
from ..convert.peft import is_peft_folder, load_peft
from ..errors import UserError
from .adapters import attach, base_location, is_adapter
from .builder import model_from_state
from .checks import check_fits_memory, check_layers_held, model_config, open_safetensors, read_tensors
from .folders import FORMAT, FORMAT_VERSION, read_config, resolve


def _check_native(folder: Path, meta: dict) -> None:
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UserError(f"{folder / 'config.json'}: format_version must be a whole number such as 1, "
                        f"got {version!r}: restore the config.json saved with these weights")
    if version > FORMAT_VERSION:
        raise UserError(f"{folder} was written by a newer glassformer (format {meta['format_version']}); upgrade glassformer")
    if not (folder / "COMPLETE").is_file():
        raise UserError(f"checkpoint {folder} is incomplete (no COMPLETE marker): it was being written when a run stopped")


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
         base: str | Path | None = None):
    """(model, tokenizer) from a checkpoint, run or Hugging Face folder; tokenizer is None if absent.
    A native checkpoint loads in dtype, else float32 whatever it stores; a Hugging Face folder
    keeps its stored dtype unless dtype is given. An adapter checkpoint loads onto its base, or
    onto `base` (--base) when that has moved."""
    folder = resolve(path)
    if is_peft_folder(folder):  # its base loaded by this function, then the adapter put on
        return load_peft(folder, load, base=base, device=device, dtype=dtype)
    meta = read_config(folder)
    if meta.get("format") != FORMAT:
        if "model_type" in meta:
            return load_hf(folder, device=device, dtype=dtype)
        raise UserError(f"{folder / 'config.json'} is neither a glassformer nor a Hugging Face config")
    _check_native(folder, meta)
    if is_adapter(meta):
        return _load_adapted(folder, meta, device, dtype, base)
    cfg, dtype = model_config(meta, folder / "config.json"), dtype or torch.get_default_dtype()
    model = model_from_state(cfg, _native_state(folder, cfg, dtype), device, dtype,
                             where=str(folder / "model.safetensors"))
    return model, _tokenizer(folder)


def _native_state(folder: Path, cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model.safetensors' tensors, read once its header and the config agree on the size (checks.py)."""
    file = folder / "model.safetensors"
    handle = open_safetensors(file)
    per_weight = 1 if cfg.quantization is not None else dtype.itemsize  # int8 weights: a byte each
    check_layers_held(cfg, folder / "config.json", handle.keys(), file)
    check_fits_memory(cfg, folder / "config.json", per_weight)
    return read_tensors(handle, file)


def _tokenizer(folder: Path):
    if not (folder / "tokenizer.json").is_file():
        return None
    from ..text.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder)  # with tokenizer_config.json and the chat template


def _load_adapted(folder: Path, meta: dict, device, dtype, base):
    """The base in fp32 (its sha256 is over fp32 values), the adapter put on, then cast to dtype."""
    where = base_location(folder, meta, base)
    model, base_tok = load(where, device=device, dtype=torch.float32)
    attach(model, folder, meta, where)
    model = model.to(dtype or torch.get_default_dtype()).eval()
    tok = _tokenizer(folder)
    return model, base_tok if tok is None else tok
