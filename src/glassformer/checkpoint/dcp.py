"""Sharded training checkpoints (`train --checkpoint-format dcp`): torch.distributed.checkpoint.

Each process writes the weights and optimizer moments it holds into run/step-NNNNNN/dcp/ (its own
`__R_0.distcp` file, rank 0 the `.metadata` that maps every tensor's pieces), so no process ever
gathers the whole model; the small files (config.json, tokenizer.json, train_state.json, RNG
states in train_state.safetensors) sit beside it as in the one-file format. DCP reshards on load,
so such a checkpoint resumes at any world size, under DDP or FSDP2. Reading one as a model, in one
process: sharded.py. Layout: docs/training.md#past-one-machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..config import ModelConfig
from ..files import atomic_folder
from .folders import FORMAT, FORMAT_VERSION, step_name, write_pointer, write_tokenizer
from .sharded import DCP_DIR, check_sharded, one_process_quiet


def _states(net: torch.nn.Module, optimizer) -> dict:
    """{"model": …, "optim": …} keyed by parameter name (DTensor shards under FSDP2): what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(run: Path, step: int, config: ModelConfig, net: torch.nn.Module, optimizer, tokenizer,
                 state: dict | None, tensors: dict[str, torch.Tensor] | None, main: bool) -> Path:
    """Write run/step-NNNNNN as a sharded checkpoint (a collective: every rank calls it; `state`,
    `tensors` matter on rank 0 alone) and, on rank 0, move `latest` to it.

    Every rank writes its shards into one temporary sibling (.step-N.tmp-dcp, a name all ranks
    know without talking); rank 0 then builds the checkpoint folder atomically around it, so a
    crash at any point leaves only temporary folders, which the next run deletes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    run, dst = Path(run), Path(run) / step_name(step)
    shards = run / f".{dst.name}.tmp-{DCP_DIR}"
    distributed = dist.is_available() and dist.is_initialized()
    if main and shards.exists():
        shutil.rmtree(shards)
    if distributed:
        dist.barrier()
    with one_process_quiet(not distributed):
        dcp.save(_states(net, optimizer), checkpoint_id=str(shards), no_dist=not distributed)  # each rank its pieces; rank 0 the index
    if distributed:
        dist.barrier()
    if not main:
        return dst
    atomic_folder(dst, lambda tmp: _write_small_files(tmp, shards, config, tokenizer, state, tensors))
    write_pointer(run, "latest", dst.name)
    return dst


def _write_small_files(tmp: Path, shards: Path, config: ModelConfig, tokenizer, state: dict | None,
                       tensors: dict[str, torch.Tensor] | None) -> None:
    """Rank 0's part of a sharded checkpoint: the shards moved in (a rename: no bytes copied),
    config.json, the tokenizer, train_state.json and the RNG tensors."""
    from safetensors.torch import save_file

    shards.rename(tmp / DCP_DIR)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": config.to_dict()}
    (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_tokenizer(tmp, tokenizer)
    save_file({k: v.detach().contiguous().cpu() for k, v in (tensors or {}).items()},
              str(tmp / "train_state.safetensors"))
    (tmp / "train_state.json").write_text(json.dumps({**(state or {}), "checkpoint_format": "dcp"}, indent=2) + "\n")


def load_sharded(folder: str | Path, net: torch.nn.Module, optimizer) -> None:
    """Load a sharded checkpoint into this rank's (wrapped) model and optimizer, at whatever world
    size it was written (a collective under torchrun): DCP reads each rank's pieces of each tensor."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    check_sharded(folder)
    states = _states(net, optimizer)  # the optimizer's moments exist (zeros) before they are loaded into
    distributed = dist.is_available() and dist.is_initialized()
    with one_process_quiet(not distributed):
        dcp.load(states, checkpoint_id=str(Path(folder) / DCP_DIR), no_dist=not distributed)
    set_state_dict(net, optimizer, model_state_dict=states["model"], optim_state_dict=states["optim"])
