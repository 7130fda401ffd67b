"""Reading a sharded (DCP) checkpoint in one process, without a process group: its check, its
full model tensors, and model.safetensors consolidated from them beside dcp/ — the one file every
reader of a checkpoint takes (resolve() makes it on first read). Writing one: dcp.py."""

from __future__ import annotations

import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError

DCP_DIR = "dcp"
METADATA = ".metadata"  # DCP's index of the pieces; written by rank 0 last, after every rank's data


# DCP warns on every save and load without a process group (one process, or a background save's
# thread) that it assumes one process: that is what we mean there, so the line is not shown.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass(frozen=True)
class Sharded:
    """What load_training hands back for a sharded checkpoint's weights and optimizer state: where they
    are. They are read into the wrapped model and optimizer, at its world size (train.distributed.load_optimizer)."""

    folder: Path


def is_sharded(folder: str | Path) -> bool:
    """Whether a checkpoint folder holds its state as a DCP folder rather than model.safetensors."""
    return (Path(folder) / DCP_DIR).is_dir()


def check_sharded(folder: str | Path) -> None:
    """One line naming what a sharded checkpoint lacks: dcp/.metadata or a data file it lists
    (a process's files left on another machine's disk, or a copy cut short)."""
    where = Path(folder) / DCP_DIR
    if not (where / METADATA).is_file():
        raise UserError(f"{where} has no {METADATA}: the sharded checkpoint is incomplete; resume from an earlier "
                        "checkpoint (delete this folder) or copy the whole folder again")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(where)).read_metadata()
    except Exception as e:  # a damaged index: whatever torch's reader raises, said in one line
        raise UserError(f"{where / METADATA} cannot be read ({type(e).__name__}): the sharded checkpoint is damaged; "
                        "resume from an earlier checkpoint") from None
    files = sorted({info.relative_path for info in meta.storage_data.values()})
    missing = [f for f in files if not (where / f).is_file()]
    if missing:
        raise UserError(f"{where} is missing {', '.join(missing[:3])} of its {len(files)} data files: every process "
                        "must write into one shared folder; copy the missing files in, or resume from an earlier checkpoint")


def sharded_model_state(folder: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The full model tensors of a sharded checkpoint, read in this one process (no process group),
    each into a tensor of the shape and dtype DCP's index records. A tied head is left out, as the
    one-file format stores it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    check_sharded(folder)
    where = str(Path(folder) / DCP_DIR)
    index = FileSystemReader(where).read_metadata().state_dict_metadata
    model = {k[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in index.items() if k.startswith("model.") and hasattr(m, "size")}
    if config.tie_embeddings:
        model.pop("lm_head.weight", None)
    dcp.load({"model": model}, checkpoint_id=where, no_dist=True)
    return model


def consolidate(folder: str | Path) -> Path:
    """model.safetensors beside dcp/, written once (atomically) from the shards: the one file
    every reader of a checkpoint takes. Returns the file."""
    from safetensors.torch import save_file

    from ..files import read_json
    from .checks import check_fits_memory, json_object, model_config

    folder = Path(folder)
    file = folder / "model.safetensors"
    if file.is_file():
        return file
    config = model_config(json_object(read_json(folder / "config.json"), folder / "config.json"), folder / "config.json")
    check_fits_memory(config, folder / "config.json", torch.get_default_dtype().itemsize)  # before any tensor is made
    state = sharded_model_state(folder, config)
    tmp = folder / f".model.safetensors.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.rename(file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"could not write {file} from the sharded checkpoint ({e.strerror or e}): the readers of "
                        "a checkpoint take one file; make the folder writable or copy it somewhere that is") from None
    return file
