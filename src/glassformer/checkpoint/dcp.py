"""Sharded training checkpoints (`train --checkpoint-format dcp`): torch.distributed.checkpoint.

Each process writes the weights and optimizer moments it holds into run/step-NNNNNN/dcp/ (its own
`__R_0.distcp` file, rank 0 the `.metadata` that maps every tensor's pieces), so no process ever
gathers the whole model; the small files (config.json, tokenizer.json, train_state.json, RNG
states in train_state.safetensors) sit beside it as in the one-file format. DCP reshards on load,
so such a checkpoint resumes at any world size, under DDP or FSDP2. Reading one as a model, in one
process: sharded.py. Layout: docs/training.md#past-one-machine.
"""

from __future__ import annotations

import copy
import json
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from ..files import atomic_folder
from .folders import FORMAT, FORMAT_VERSION, step_name, write_pointer, write_tokenizer
from .sharded import DCP_DIR, check_sharded


def _states(net: torch.nn.Module, optimizer) -> dict:
    """{"model": …, "optim": …} keyed by parameter name (DTensor shards under FSDP2): what DCP saves and loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, optimizer)
    return {"model": model_sd, "optim": optim_sd}


@dataclass
class Pending:
    """A sharded save still being written in the background: its future, and on rank 0 what
    completes the folder once every rank's shards are down."""

    future: Future
    shards: Path  # the temporary folder the ranks write into
    finish: list[Callable[[], None]]  # rank 0: complete the folder, then whatever waits on it (when_complete)


_pending: dict[str, Pending] = {}  # run folder -> its one save in flight
_group: list = []  # [(the default group, the gloo group the background writes talk over)] (_save_group)


def _save_group():
    """A process group of its own for the background writes (gloo: async_save needs a CPU backend,
    and collectives of a second thread must not interleave with training's on the default group);
    None in one process. Made on the first save, which every rank reaches together."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not _group or _group[0][0] is not dist.group.WORLD:  # a new process group: a new side group with it
        _group[:] = [(dist.group.WORLD, dist.new_group(backend="gloo"))]
    return _group[0][1]


def finish_pending(run: str | Path) -> None:
    """Wait for the run's save in flight, if any, and complete its folder (rank 0): before the next
    save starts and before the run ends. A failed background write is raised here."""
    pending = _pending.pop(str(run), None)
    if pending is None:
        return
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        pending.future.result()  # rank 0's completes after every rank's shards and the index are written
    except (Exception, CheckpointException) as e:
        shutil.rmtree(pending.shards, ignore_errors=True)  # nothing partial left behind
        first = write_failure(e)
        raise OSError(f"the background write of {pending.shards.name.split('.tmp-')[0].lstrip('.')} failed: {first}") from e
    for action in pending.finish:
        action()


def write_failure(e: BaseException) -> str:
    """The first line of what a failed DCP write raised: a CheckpointException's first failed rank's own error
    (its failures map rank -> (exception, traceback)), else the error itself."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0]}"
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def when_complete(run: str | Path, action: Callable[[], None]) -> None:
    """Run action (rank 0: a pointer naming the checkpoint just saved) once that checkpoint is
    complete: now, or when its background save is finished, so no pointer names a missing folder."""
    pending = _pending.get(str(run))
    if pending is None:
        action()
    else:
        pending.finish.append(action)


def save_sharded(run: Path, step: int, config: ModelConfig, net: torch.nn.Module, optimizer, tokenizer,
                 state: dict | None, tensors: dict[str, torch.Tensor] | None, main: bool,
                 background: bool = True) -> Path:
    """Write run/step-NNNNNN as a sharded checkpoint (a collective: every rank calls it; `state`,
    `tensors` matter on rank 0 alone); rank 0 completes the folder and moves `latest` to it.

    Every rank writes its shards into one temporary sibling (.step-N.tmp-dcp, a name all ranks
    know without talking); rank 0 then builds the checkpoint folder atomically around it, so a
    crash at any point leaves only temporary folders, which the next run deletes. background:
    dcp.async_save copies the state to CPU memory and returns, the writes overlap the next steps,
    and the folder is completed by finish_pending (the next save, or the end of the run)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    finish_pending(run)  # one save in flight at a time
    run, dst = Path(run), Path(run) / step_name(step)
    shards = run / f".{dst.name}.tmp-{DCP_DIR}"
    distributed = dist.is_available() and dist.is_initialized()
    if main and shards.exists():
        shutil.rmtree(shards)
    if distributed:
        dist.barrier()
    state = copy.deepcopy(state)  # as it is now: the loop changes its plan and best while the writes go on
    finish = [lambda: _complete(run, dst, shards, config, tokenizer, state, tensors)] if main else []
    if background and hasattr(dcp, "async_save"):
        future = dcp.async_save(_states(net, optimizer), checkpoint_id=str(shards), process_group=_save_group(),
                                no_dist=not distributed)
        _pending[str(run)] = Pending(future, shards, finish)
        return dst
    try:
        dcp.save(_states(net, optimizer), checkpoint_id=str(shards), no_dist=not distributed)  # each rank its pieces
    except BaseException:
        shutil.rmtree(shards, ignore_errors=True)  # nothing partial left behind (DCP fails on every rank)
        raise
    if distributed:
        dist.barrier()
    for action in finish:
        action()
    return dst


def _complete(run: Path, dst: Path, shards: Path, config: ModelConfig, tokenizer, state: dict | None,
              tensors: dict[str, torch.Tensor] | None) -> None:
    """Rank 0, once every rank's shards are written: the checkpoint folder, atomically, and `latest`."""
    atomic_folder(dst, lambda tmp: _write_small_files(tmp, shards, config, tokenizer, state, tensors))
    write_pointer(run, "latest", dst.name)


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
    dcp.load(states, checkpoint_id=str(Path(folder) / DCP_DIR), no_dist=not distributed)
    set_state_dict(net, optimizer, model_state_dict=states["model"], optim_state_dict=states["optim"])
