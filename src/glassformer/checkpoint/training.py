"""Training checkpoints: a checkpoint folder plus the state that makes a resumed run repeat
the uninterrupted one bit for bit.

train_state.safetensors holds the optimizer moments by parameter name and the RNG states as
byte tensors; train_state.json the step, schedule, RNG scalars, data position and the
TrainConfig. Each lives in run/step-NNNNNN/, and `latest` moves to it once it is complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..files import atomic_folder, read_json
from .checks import DAMAGED, json_object, read_safetensors
from .sharded import Sharded, check_sharded, is_sharded
from .folders import step_name, tensor_bytes, write_pointer, write_state_files


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


def save_training(run: str | Path, step: int, config: ModelConfig, model_state_: dict, tokenizer: Any,
                  optim_state: dict, state: dict, tensors: dict[str, torch.Tensor] | None = None,
                  write_model: Callable[[Path], None] | None = None) -> Path:
    """Write run/step-NNNNNN atomically (COMPLETE last), then move `latest` to it.

    state: JSON-able training state; tensors: extra tensors (RNG states); write_model: writes the
    model's files into the folder instead of config.json + model.safetensors (a LoRA run's adapter).
    If any write fails the temporary folder is removed, `latest` is unchanged, and the error is raised.
    """
    from safetensors.torch import save_file

    run = Path(run)
    opt_tensors, groups = _flatten_optimizer(optim_state)

    def write(tmp: Path) -> None:
        if write_model is None:
            write_state_files(tmp, config, model_state_, tokenizer)
        else:
            write_model(tmp)
        save_file({**opt_tensors, **(tensors or {})}, str(tmp / "train_state.safetensors"))
        (tmp / "train_state.json").write_text(json.dumps({**state, "param_groups": groups}, indent=2) + "\n")

    weights = tensor_bytes(model_state_) if write_model is None else 0  # an adapter's: a small part of the state
    folder = atomic_folder(run / step_name(step), write, need=weights + tensor_bytes(opt_tensors, tensors or {}))
    write_pointer(run, "latest", folder.name)
    return folder


def load_training(folder: str | Path) -> tuple[dict | None, dict | Sharded, dict, dict]:
    """(model state, optimizer state, train_state.json dict, extra tensors) of a training checkpoint;
    a sharded one's (None, Sharded(folder), …): both are read into the wrapped model and optimizer
    by train.distributed.load_optimizer, at the run's world size."""
    folder = Path(folder)
    if not (folder / "COMPLETE").is_file() or not (folder / "train_state.json").is_file():
        raise UserError(f"{folder} is not a complete training checkpoint (no COMPLETE or train_state.json)")
    state = json_object(read_json(folder / "train_state.json"), folder / "train_state.json")
    if is_sharded(folder):  # weights and moments stay in dcp/ until the wrapped model loads them
        check_sharded(folder)
        return None, Sharded(folder), state, read_safetensors(folder / "train_state.safetensors")
    if not isinstance(state.get("param_groups"), list):
        raise UserError(f"{folder / 'train_state.json'} has no list of param_groups: {DAMAGED}")
    tensors = read_safetensors(folder / "train_state.safetensors")
    optim = _unflatten_optimizer(tensors, state.pop("param_groups"))
    extra = {k: v for k, v in tensors.items() if not k.startswith("optim/")}
    weights = folder / "model.safetensors"
    model_sd = read_safetensors(weights if weights.is_file() else folder / "adapter.safetensors")  # a LoRA run's adapter
    return model_sd, optim, state, extra
