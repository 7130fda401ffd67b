"""What a training run sets up before its loop: the device, autocast, the data folder, the model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from . import distributed as gdist
from ..config import ModelConfig, TrainConfig
from ..text.data import read_meta
from ..errors import UserError


def uses_cuda(name: str) -> bool:
    """Whether --device NAME means a CUDA GPU ('auto' does where one is present)."""
    return name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())


def resolve_device(name: str, d: gdist.Dist | None = None) -> torch.device:
    if name == "auto":
        name = "cuda" if uses_cuda(name) else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError("--device cuda asked for, but PyTorch sees no CUDA GPU: use --device cpu")
        if name == "cuda" and d is not None and d.enabled:
            return torch.device("cuda", d.local_rank)
    if name == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError("--device mps asked for, but this PyTorch has no MPS backend: use --device cpu")
    return torch.device(name)


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on CUDA (weights and optimizer stay fp32); plain fp32 elsewhere unless asked."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def read_prepared(data: str | Path) -> dict:
    """meta.json of a prepared data folder, after checking the folder holds both token files."""
    data = Path(data)
    if not data.is_dir():
        raise UserError(f"--data {data} is not a folder: run `glassformer prepare --out {data}` first")
    for f in ("meta.json", "train.bin", "val.bin"):
        if not (data / f).is_file():
            raise UserError(f"{data} has no {f}: it is not a prepared data folder; run `glassformer prepare --out {data}`")
    return read_meta(data)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    model.config.dropout = p
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def build_model(cfg: TrainConfig, meta: dict):
    """A fresh model from the preset (+ --model overrides), or the weights of --init-from."""
    from ..model import Transformer

    if cfg.init_from:
        from ..checkpoint.folders import load

        model, _ = load(cfg.init_from)
        if model.config.vocab_size != meta["vocab_size"]:
            raise UserError(
                f"--init-from {cfg.init_from} has a vocabulary of {model.config.vocab_size} tokens but the data's "
                f"tokenizer has {meta['vocab_size']}: prepare the data with that checkpoint's tokenizer"
            )
        model.float()
    else:
        overrides = {"vocab_size": meta["vocab_size"], **cfg.model_overrides()}
        model = Transformer(ModelConfig.from_preset(cfg.preset, **overrides))
    set_dropout(model, cfg.dropout)
    return model
