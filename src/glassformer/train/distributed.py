"""Running one training loop in N processes under torchrun: DDP or FSDP2, on PyTorch's own engine.

Without torchrun's RANK / WORLD_SIZE / LOCAL_RANK everything here is a no-op. Batches are
drawn globally from (seed, step) and sliced by rank, so the mean gradient is the one-process
gradient; checkpoints hold full tensors gathered with torch.distributed.checkpoint.state_dict,
or with --checkpoint-format dcp each rank's own shards (checkpoint/dcp.py); either loads at any
world size (docs/training.md#many-processes). Across machines RANK and WORLD_SIZE count every
process of every node and LOCAL_RANK this node's, so a process's GPU is its LOCAL_RANK
(docs/training.md#past-one-machine).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        """Rank 0 alone logs and writes."""
        return self.rank == 0


def setup(device_type: str) -> Dist:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); a no-op without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return Dist(rank=rank, world_size=world, local_rank=local)


def check_checkpoint_format(cfg) -> None:
    """--checkpoint-format checked before anything is written (a TrainConfig)."""
    from ..errors import UserError

    if cfg.checkpoint_format == "dcp" and cfg.lora_r:
        raise UserError("--checkpoint-format dcp shards the whole model's state; a LoRA run's checkpoints hold "
                        "the adapter alone (a small file): leave --checkpoint-format at safetensors")


def teardown(d: Dist, clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first waits for the others, so no
    rank tears its connections down while a peer still talks to it (gloo then aborts the peer)."""
    if d.enabled and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def wrap(model: torch.nn.Module, d: Dist, fsdp: bool, device: torch.device) -> torch.nn.Module:
    """DDP, or FSDP2 (each block sharded on its own, then the root), or the model itself."""
    if not d.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def micro_batch_sync(net: torch.nn.Module, d: Dist | None, last: bool):
    """The context for one micro-batch's backward: gradients are reduced across ranks only on the
    last micro-batch of a step, since a reduction per micro-batch would repeat the same traffic.
    DDP skips its all-reduce inside `no_sync()`; FSDP2 has no such context, so its flag is set
    (off before the first micro-batch, back on for the last). A no-op in one process."""
    if d is None or not d.enabled:
        return contextlib.nullcontext()
    if hasattr(net, "no_sync"):  # DDP
        return contextlib.nullcontext() if last else net.no_sync()
    if hasattr(net, "set_requires_gradient_sync"):  # FSDP2: the flag stays as set until changed
        net.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Transformer under a DDP wrapper (FSDP2 shards in place, so it is already the Transformer)."""
    return getattr(model, "module", model)


def all_mean(value: torch.Tensor, d: Dist) -> torch.Tensor:
    """Mean of a scalar tensor over ranks (the one-process value, since every rank holds an equal share)."""
    if d.enabled:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= d.world_size
    return value


def all_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        values = values.detach().clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_rank(flag: bool, d: Dist, device: torch.device) -> bool:
    """True if the flag is set on any rank (so all ranks stop together, e.g. after a signal)."""
    if not d.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) as full CPU tensors keyed by parameter name; a collective
    under torchrun (every rank must call it), and only rank 0 gets non-empty dicts then."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state) -> None:
    """Load a full, name-keyed optimizer state (from any world size) into this rank's optimizer; a
    sharded checkpoint's (checkpoint.sharded.Sharded) brings the weights too, each rank reading
    its pieces (a collective under torchrun)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from ..checkpoint.dcp import load_sharded
    from ..checkpoint.sharded import Sharded

    if isinstance(state, Sharded):
        load_sharded(state.folder, model, optimizer)
        return

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
