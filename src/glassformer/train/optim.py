"""AdamW with one weight-decay rule (or Muon for the block matrices beside it), and the
learning-rate schedule: linear warm-up, then cosine or warm-up–stable–decay (wsd).

Pure functions of the config and the step, so a resumed run recomputes the same rate at the
same step and the schedule never depends on the clock.
"""

from __future__ import annotations

import inspect
import math

import torch

from ..errors import UserError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay tensors of 2+ dims (matrices, embeddings); never norms' gains or biases (nanoGPT's rule)."""
    decay, no_decay = [], []
    for p in model.parameters():  # a tied matrix is listed once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                   device: torch.device, sharded: bool = False) -> torch.optim.AdamW:
    """AdamW, fused where this PyTorch and device support it (one kernel for all tensors), else foreach."""
    kwargs = {}
    fused_ok = "fused" in inspect.signature(torch.optim.AdamW).parameters and device.type in ("cuda", "cpu", "mps")
    if fused_ok and not sharded:  # FSDP2's DTensor parameters take the foreach path
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=1e-8, **kwargs)


# The block matrices Muon trains (docs/training.md#muon): the products of attention and the feed-forward.
MUON_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def is_block_matrix(name: str) -> bool:
    """Whether parameter `name` is one of a block's product matrices (not embedding, head, norm or bias).

    >>> is_block_matrix("blocks.3.attn.wq.weight"), is_block_matrix("blocks.3.attn.wq.bias"), is_block_matrix("embed.weight")
    (True, False, False)
    """
    parts = name.split(".")
    return len(parts) == 5 and parts[0] == "blocks" and parts[3] in MUON_MATRICES and parts[4] == "weight"


class Optimizers:
    """Several optimizers stepped as one: what train_step, the schedule and the checkpoint see.

    Iterable, so torch.distributed.checkpoint's state-dict functions take it as their list of
    optimizers and key every moment and momentum buffer by parameter name."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    def __iter__(self):
        return iter(self.optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def check_optimizer(cfg) -> None:
    """--optimizer and its companions checked before anything is written (a TrainConfig)."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise UserError(f"--optimizer {cfg.optimizer!r}: choose adamw or muon")
    if cfg.optimizer != "muon":
        return
    if cfg.lora_r:
        raise UserError("--optimizer muon with --lora-r: the block matrices are frozen under LoRA and Muon would "
                        "only see the thin rank-r adapter factors: use --optimizer adamw for adapters")


def make_muon(model: torch.nn.Module, lr: float, muon_lr: float, momentum: float, weight_decay: float,
              betas: tuple[float, float], device: torch.device, sharded: bool = False) -> Optimizers:
    """torch.optim.Muon for the block matrices, AdamW (one decay rule) for everything else; under
    FSDP2 (sharded) ShardedMuon, the same update on matrices each process holds a row shard of.

    The Muon group carries lr_ratio = muon_lr / lr, so the one schedule (set_lr) scales both."""
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        raise UserError(f"--optimizer muon needs torch.optim.Muon (PyTorch 2.9 or later; this is {torch.__version__}): "
                        "upgrade torch or use --optimizer adamw")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_block_matrix(n)]
    if not matrices:
        raise UserError("--optimizer muon found no trainable block matrices (wq wk wv wo w_gate w_up w_down)")
    chosen = {id(p) for p in matrices}
    rest = torch.nn.Module()
    rest.params = torch.nn.ParameterList([p for _, p in named if id(p) not in chosen])
    muon = (ShardedMuon if sharded else muon_cls)([{"params": matrices, "lr_ratio": muon_lr / lr}], lr=muon_lr,
                                                  momentum=momentum, weight_decay=weight_decay, nesterov=True)
    return Optimizers(muon, make_optimizer(rest, lr, weight_decay, betas, device, sharded=sharded))


# Keller Jordan's quintic Newton–Schulz coefficients, torch.optim.Muon's defaults.
NS_COEFFICIENTS, NS_STEPS, NS_EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7


def newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS) -> torch.Tensor:
    """Muon's orthogonalisation of one whole (rows, cols) matrix, in bf16, wide side last: the same
    operations in the same order as torch.optim.Muon, so one process and many give the same bits."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class ShardedMuon(torch.optim.Optimizer):
    """Muon on FSDP2's row-sharded matrices (DTensors, Shard(0)), as nanochat's and modded-nanogpt's
    distributed Muon: the momentum and Nesterov look-ahead are elementwise, so each process does them
    on its own rows; Newton–Schulz needs the whole matrix, so matrix i's rows are gathered to process
    i mod world (each process orthogonalises its own matrices, all at once), and the result's rows
    are scattered back. FSDP2's reduce-scatter has already left each process the mean gradient's
    rows. The state (momentum_buffer) and step are torch.optim.Muon's, so checkpoints move between
    the two; plain tensors (one process) are orthogonalised in place of the gather."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True):
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": NS_COEFFICIENTS, "eps": NS_EPS, "ns_steps": NS_STEPS, "adjust_lr_fn": None}
        super().__init__(params, defaults)
        if any(p.dim() != 2 for g in self.param_groups for p in g["params"]):
            raise ValueError("Muon trains 2-D matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])  # B ← μB + (1 − μ)g, on this process's rows
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            orthogonal = orthogonalise_owned(updates, group)  # this process's rows of each, bf16
            lr = group["lr"]
            for p, o in zip(params, orthogonal):
                rows, cols = p.shape  # the whole matrix's shape, as torch.optim.Muon scales by it
                local = p.to_local() if hasattr(p, "to_local") else p
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(o, alpha=-lr * math.sqrt(max(1.0, rows / cols)))
        return None


def row_counts(rows: int, world: int) -> list[int]:
    """Rows each process holds of a matrix FSDP2 shards on dim 0 (torch.chunk's split, empty shards last).

    >>> row_counts(5, 2), row_counts(2, 4)
    ([3, 2], [1, 1, 0, 0])
    """
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def orthogonalise_owned(updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Newton–Schulz of each whole matrix, as this process's rows (plain tensors: the matrix itself).

    DTensor i (Shard(0) over a 1-D mesh) is owned by process i mod world: every process sends its
    rows, padded to one chunk, to the owner (gather, all matrices in flight at once), the owner
    orthogonalises the matrix, then sends each process its rows back (scatter)."""
    import torch.distributed as dist

    ns = lambda m: newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["eps"])  # noqa: E731
    if not updates or not hasattr(updates[0], "to_local"):
        return [ns(u) for u in updates]
    mesh = updates[0].device_mesh
    pg, me, world = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    shards, gathered, works = [], [], []
    for i, u in enumerate(updates):  # (rows_i, cols) whole, (counts[me], cols) here
        local, counts, owner = u.to_local(), row_counts(u.shape[0], world), i % world
        assert local.shape[0] == counts[me], (u.placements, local.shape, counts)  # FSDP2's even split on dim 0
        padded = local.new_zeros(counts[0], u.shape[1])  # (chunk, cols)
        padded[: counts[me]] = local
        pieces = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
        works.append(dist.gather(padded, pieces, dst=dist.get_global_rank(pg, owner), group=pg, async_op=True))
        shards.append((counts, owner, padded))
        gathered.append(pieces)
    for w in works:
        w.wait()
    out, works = [], []
    for (counts, owner, padded), pieces in zip(shards, gathered):
        send = None
        if me == owner:  # the whole matrix: each process's rows, padding dropped
            whole = ns(torch.cat([p[:n] for p, n in zip(pieces, counts)]))  # (rows, cols) bf16
            send = [torch.zeros_like(padded, dtype=whole.dtype) for _ in range(world)]
            for r, part in enumerate(whole.split(counts[0])):
                send[r][: part.shape[0]] = part
        mine = padded.new_empty(padded.shape, dtype=torch.bfloat16)
        works.append(dist.scatter(mine, send, src=dist.get_global_rank(pg, owner), group=pg, async_op=True))
        out.append(mine[: counts[me]])
    for w in works:
        w.wait()
    return out


SCHEDULES = ("cosine", "wsd")


def lr_at(step: int, lr: float, min_lr: float, warmup: int, total: int, schedule: str = "cosine",
          decay_frac: float = 0.4) -> float:
    """Rate for optimizer step `step` (0-based): (step+1)/warmup·lr, then the schedule down to min_lr at step total-1.

    'cosine': half a cosine from lr to min_lr over all steps after the warm-up.
    'wsd' (warm-up, stable, decay; the speedrun lineage's): lr held, then a straight line to
    min_lr over the last decay_frac of the steps (decay_start gives where it starts).

    >>> lr_at(0, 1.0, 0.1, 10, 100), lr_at(9, 1.0, 0.1, 10, 100), lr_at(99, 1.0, 0.1, 10, 100)
    (0.1, 1.0, 0.1)
    >>> lr_at(59, 1.0, 0.0, 10, 100, "wsd", 0.4), lr_at(99, 1.0, 0.0, 10, 100, "wsd", 0.4)
    (1.0, 0.0)
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if total <= warmup:
        return lr
    if schedule == "wsd":
        start = decay_start(warmup, total, decay_frac)
        progress = min(1.0, max(0.0, (step - start) / max(1, total - 1 - start)))
        return lr + (min_lr - lr) * progress
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def decay_start(warmup: int, total: int, decay_frac: float) -> int:
    """The last step at the full rate under 'wsd': the decay_frac·total steps after it decay (never inside the warm-up).

    >>> decay_start(10, 100, 0.4), decay_start(10, 100, 1.0)
    (59, 10)
    """
    return max(warmup, total - 1 - round(decay_frac * total))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    """The schedule's rate into every group (a Muon group's scaled by its lr_ratio)."""
    for g in optimizer.param_groups:
        g["lr"] = value * g.get("lr_ratio", 1.0)
