"""What a training run sets up before its loop: the device, autocast, the data folder, the model,
and `start_run`, the loop's first phase (fresh, --init-from or --resume)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import devices, speed
from .distributed import Dist, barrier, check_checkpoint_format, load_optimizer, wrap
from .recompute import checkpoint_blocks
from ..checkpoint.folders import newest_checkpoint, remove_leftovers
from ..checkpoint.training import load_training
from ..config import ModelConfig, TrainConfig
from ..errors import UserError
from ..text.data import check_prepared, load_split, read_meta
from .metrics import MetricsLog, flops_per_token, machine_peak, pick_threads
from .lora import check_flags, describe, prepare_model, resumed_adapter
from .loader import attach_docs, check_same_data, data_fingerprint
from .loggers import LoggedMetrics, check_specs, make_sinks
from .optim import check_optimizer, make_muon, make_optimizer
from .runstate import RunState, set_rng_state


def uses_cuda(name: str) -> bool:
    """Whether --device NAME means a CUDA GPU ('auto' does where one is present)."""
    return name.startswith("cuda") or (name == "auto" and torch.cuda.is_available())


def resolve_device(name: str, d: Dist | None = None) -> torch.device:
    """The run's torch.device (devices.resolve_device); under torchrun a plain 'cuda' is this process's GPU."""
    return devices.resolve_device(name, d.local_rank if d is not None and d.enabled else None)


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on CUDA (weights and optimizer stay fp32); plain fp32 elsewhere unless asked."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def read_prepared(data: str | Path) -> dict:
    """meta.json of a prepared data folder, after checking the folder holds both token files (or
    meta.json lists shards) and that a run can read it: meta.json, the tokenizer, every shard's
    header and count, and every id (text/data.py check_prepared)."""
    data = Path(data)
    if not data.is_dir():
        raise UserError(f"--data {data} is not a folder: run `glassformer prepare --out {data}` first")
    if not (data / "meta.json").is_file():
        raise UserError(f"{data} has no meta.json: it is not a prepared data folder; run `glassformer prepare --out {data}`")
    for f in () if "shards" in read_meta(data) else ("train.bin", "val.bin"):  # a shard missing: load_split says
        if not (data / f).is_file():
            raise UserError(f"{data} has no {f}: it is not a prepared data folder; run `glassformer prepare --out {data}`")
    return check_prepared(data)


def check_out(out: Path, resume: bool = False) -> None:
    """--out must be a folder or not exist yet (nor sit under a file), and a fresh run (no --resume)
    may not start in a folder that holds a run's checkpoints or metrics, which it would overwrite or
    mix with its own: said before the data are read or anything is built."""
    existing = next(p for p in (out, *out.parents) if p.exists())  # the nearest existing one ('.' at last)
    if not existing.is_dir():
        what = "is a file" if existing == out else f"lies under {existing}, which is a file"
        raise UserError(f"--out {out} {what}, not a run folder: choose a new folder name (or an earlier run's "
                        f"folder, with --resume to continue it)")
    if not resume and existing == out:
        held = sorted(p.name for p in out.glob("step-*"))[-1:] or [p.name for p in out.glob("metrics.jsonl")]
        if held:
            raise UserError(f"--out {out} already holds a run ({held[0]}): continue it with --resume, or choose a "
                            f"new folder (a fresh run there would overwrite or mix with its files)")


def set_dropout(model: torch.nn.Module, p: float) -> None:
    model.config.dropout = p
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p


def build_model(cfg: TrainConfig, meta: dict):
    """(model, vocabulary growth or None): a fresh model from the preset (+ --model overrides),
    or the weights of --init-from, grown to the data's larger vocabulary (train/vocab.py)."""
    from ..model import Transformer

    grown = None
    if cfg.init_from:
        from ..checkpoint.loading import load

        model, _ = load(cfg.init_from, base=cfg.base)
        if model.config.vocab_size > meta["vocab_size"]:
            raise UserError(
                f"--init-from {cfg.init_from} has a vocabulary of {model.config.vocab_size} tokens but the data's "
                f"tokenizer has {meta['vocab_size']}: prepare the data with that checkpoint's tokenizer"
            )
        model.float()
        if model.config.vocab_size < meta["vocab_size"]:
            from .vocab import grow_vocab

            model, grown = grow_vocab(model, meta["vocab_size"])
    else:
        overrides = {"vocab_size": meta["vocab_size"], **cfg.model_overrides()}
        model = Transformer(ModelConfig.from_preset(cfg.preset, **overrides))
    model = prepare_model(cfg, model, grown)  # --lora-r: the base frozen, adapters to train (train/lora.py)
    set_dropout(model, cfg.dropout)
    return model, grown


def say(d: Dist, msg: str) -> None:
    """A line on stderr from rank 0 alone."""
    if d.main:
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- start or resume a run


def start_run(cfg: TrainConfig, d: Dist) -> RunState:
    """The run folder, the model (fresh, --init-from, or resumed with its optimizer and RNG states),
    the data, the thread count and the progress bar: everything the loop's first step needs."""
    t_start = time.perf_counter()
    device = resolve_device(cfg.device, d)
    data, out = Path(cfg.data), Path(cfg.out)
    check_out(out, cfg.resume)
    meta = read_prepared(data)
    check_flags(cfg)
    check_optimizer(cfg)
    check_checkpoint_format(cfg)
    check_specs(cfg.log)
    open_run_folder(out, d)
    fingerprint = data_fingerprint(data, meta)
    resume_from, saved = find_checkpoint(cfg, out, d, lambda state: check_same_data(state, fingerprint, data))
    torch.manual_seed(cfg.seed)
    model, grown = (resumed_model(cfg, resume_from, saved[0]), None) if saved else build_model(cfg, meta)
    if describe(model):
        say(d, describe(model))
    if grown:
        say(d, f"vocabulary grown from {grown['from']} to {grown['to']} ids for the data's tokenizer: "
               f"new rows of {', '.join(grown['matrices'])} are the mean of the old rows")
    seq_len, micro, accum = batch_shape(cfg, model.config, d)
    train_tokens, val_tokens = (load_split(data, split, meta) for split in ("train", "val"))
    if len(train_tokens) <= seq_len + 1:
        where = f"{data}/train.bin" if "shards" not in meta else f"the training shards of {data}"
        raise UserError(f"{where} has {len(train_tokens)} tokens, fewer than one sequence of {seq_len + 1}")
    net, optimizer = place_model(cfg, model, d, device)
    n_eval = (cfg.eval_tokens + 1) if cfg.eval_tokens else len(val_tokens)
    eval_ids = np.asarray(val_tokens[:n_eval])
    run = RunState(cfg=cfg, d=d, device=device, data=data, out=out, model=model, net=net, optimizer=optimizer,
                   train_tokens=train_tokens, eval_ids=eval_ids,
                   eval_bytes=int(round(meta.get("val_bytes", 0) * min(1.0, len(eval_ids) / max(1, len(val_tokens))))),
                   seq_len=seq_len, micro=micro, accum=accum, autocast=contextlib.nullcontext, n_threads=0,
                   total_steps=None if cfg.time_budget else cfg.max_steps, t_start=t_start, grown=grown,
                   data_fingerprint=fingerprint)
    attach_masks(run, meta, len(train_tokens), len(val_tokens), n_eval)
    attach_docs(run, meta)
    if saved:
        restore_training(run, *saved[1:])
        run.grown = saved[2].get("vocab_growth")
    if cfg.time_budget and cfg.calibrate_steps > cfg.warmup_steps and run.total_steps is None:
        raise UserError("--calibrate-steps must not exceed --warmup-steps with --time-budget, so the "
                        "calibration steps' learning rate does not depend on the step count it fixes")
    run.n_threads = set_threads(cfg, d, device, (saved[2] if saved else {}).get("threads"))
    run.autocast = autocast_for(device, cfg.dtype)
    start_measuring(run)
    run.plan = saved[2].get("time_budget_plan") if saved else None
    run.start_step = run.step
    run.t_log = time.perf_counter()
    return run


def attach_masks(run: RunState, meta: dict, n_train: int, n_val: int, n_eval: int) -> None:
    """A conversation folder's loss masks and window block (docs/data.md#conversation-data);
    nothing for plain data, which trains as it always has."""
    from ..text.data import chat_block, load_mask

    run.block = chat_block(meta)
    run.train_mask = load_mask(run.data, "train", n_train)
    val_mask = load_mask(run.data, "val", n_val)
    if run.block is None:
        return
    if run.seq_len < run.block - 1:
        raise UserError(f"--seq-len {run.seq_len} is shorter than the conversations' context of {run.block - 1} "
                        f"in {run.data}: prepare with --context {run.seq_len} or train with a longer context")
    run.eval_mask = np.asarray(val_mask[:n_eval])
    # val_bytes counts the scored tokens' bytes: the evaluated share of them, as plain data's share of tokens.
    run.eval_bytes = int(round(meta["val_bytes"] * int(run.eval_mask.sum()) / max(1, int(np.asarray(val_mask).sum()))))


def open_run_folder(out: Path, d: Dist) -> None:
    """Create the run folder and delete what a killed checkpoint write left there (rank 0)."""
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        left = remove_leftovers(out)
        if left:
            say(d, f"removed unfinished checkpoint writes: {', '.join(left)}")
    barrier(d)


def find_checkpoint(cfg: TrainConfig, out: Path, d: Dist, check=None) -> tuple[Path | None, tuple | None]:
    """With --resume: (newest complete checkpoint, its (model state, optimizer state, train state,
    RNG tensors)), after check(train state) (the data folder's, train/loader.py); (None, None) for a
    fresh run, which --resume on an empty run folder is too."""
    resume_from = newest_checkpoint(out) if cfg.resume else None
    if cfg.resume and resume_from is None:
        say(d, f"--resume: no complete checkpoint in {out} yet, so starting fresh")
    if resume_from is None:
        if cfg.init_from:
            say(d, f"initialising from {cfg.init_from}")
        return None, None
    saved = load_training(resume_from)
    if check is not None:
        check(saved[2])
    say(d, f"resuming from {resume_from} (step {saved[2]['step']})")
    return resume_from, saved


def resumed_model(cfg: TrainConfig, folder: Path, state_dict: dict | None):
    """The checkpoint's model, with the run's dropout; an adapter checkpoint's on its base (--base)."""
    from ..checkpoint.builder import model_from_state
    from ..checkpoint.checks import check_fits_memory, check_layers_held, json_object, model_config
    from ..files import read_json

    file = folder / "config.json"  # checked as load() checks it: one line naming it, before a model is built
    meta = json_object(read_json(file), file)
    if "lora" in meta:
        model = resumed_adapter(cfg, folder)
    elif state_dict is None:  # sharded (dcp/): built here, its weights loaded once wrapped (load_optimizer)
        from ..model import Transformer

        mcfg = model_config(meta, file)
        check_fits_memory(mcfg, file, torch.get_default_dtype().itemsize)
        model = Transformer(mcfg).train()
    else:
        mcfg, dtype = model_config(meta, file), torch.get_default_dtype()
        check_layers_held(mcfg, file, state_dict.keys(), folder / "model.safetensors")
        check_fits_memory(mcfg, file, dtype.itemsize)
        model = model_from_state(mcfg, state_dict, dtype=dtype, where=str(folder)).train()
    set_dropout(model, cfg.dropout)
    return model


def batch_shape(cfg: TrainConfig, mcfg: ModelConfig, d: Dist) -> tuple[int, int, int]:
    """(seq_len, micro-batch rows, micro-batches per step): global batch = world · micro · accum."""
    seq_len = cfg.seq_len or mcfg.max_seq_len
    if seq_len > mcfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the model's context ({mcfg.max_seq_len})")
    if cfg.batch_size % d.world_size:
        raise UserError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({d.world_size})")
    per_rank = cfg.batch_size // d.world_size
    micro = cfg.micro_batch or per_rank
    if per_rank % micro:
        raise UserError(f"--micro-batch {micro} must divide the per-process batch {per_rank}")
    return seq_len, micro, per_rank // micro


def place_model(cfg: TrainConfig, model, d: Dist, device: torch.device):
    """(net, optimizer): the model on its device, compiled if asked, wrapped for DDP/FSDP."""
    model.to(device)
    if device.type == "cuda":  # the head's products over a padded vocabulary (glassformer.speed.head)
        speed.install(model)
    if cfg.compile:
        model.compile()
        say(d, "compile: the first step (and the first evaluation) compile the model once, tens of seconds on a CPU")
    if cfg.activation_checkpointing:  # before FSDP2 re-classes the blocks in its turn
        checkpoint_blocks(model)
    net = wrap(model, d, cfg.fsdp, device)
    betas, sharded = (cfg.beta1, cfg.beta2), cfg.fsdp and d.enabled
    if cfg.optimizer == "muon":
        optimizer = make_muon(model, cfg.lr, cfg.muon_lr, cfg.muon_momentum, cfg.weight_decay, betas, device, sharded)
    else:
        optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, betas, device, sharded=sharded)
    return net, optimizer


def restore_training(run: RunState, optim_sd, state: dict, rng_tensors: dict) -> None:
    """A resumed run's optimizer moments (a sharded checkpoint's weights too: load_optimizer), RNG
    states, step counts and best checkpoint."""
    load_optimizer(run.net, run.optimizer, optim_sd)
    set_rng_state(state["rng"], rng_tensors)
    run.step, run.elapsed0 = state["step"], state["elapsed"]
    # A step-limited run resumed with another --max-steps runs to it (its schedule then spans the new
    # total, as nanoGPT's max_iters does); a time-budget run keeps the total its budget fixed.
    run.total_steps = state["total_steps"] if run.cfg.time_budget else run.cfg.max_steps
    run.best = state.get("best") or run.best
    if run.best.get("val_loss") is None:
        run.best["val_loss"] = math.inf


def set_threads(cfg: TrainConfig, d: Dist, device: torch.device, saved_threads: int | None) -> int:
    """CPU threads as asked, as the resumed run had them (same reduction order, same bits), or measured."""
    n_threads = cfg.threads or saved_threads or 0
    if n_threads:
        torch.set_num_threads(n_threads)
    elif device.type == "cpu":
        n_threads, one, many = pick_threads(torch.get_num_threads())
        say(d, f"CPU threads: {n_threads} (one thread {one / 1e9:.0f} GFLOP/s, all {many / 1e9:.0f} GFLOP/s "
               "on a training-sized matmul; --threads N fixes it)")
    return torch.get_num_threads()


def start_measuring(run: RunState) -> None:
    """The MFU peak, metrics.jsonl (cut back to the resumed step), the model's summary line, the bar."""
    from tqdm import tqdm

    cfg, d, mcfg = run.cfg, run.d, run.model.config
    run.peak, peak_src = machine_peak(run.device) if d.main else (None, "")
    run.flops_per_token = flops_per_token(mcfg, run.seq_len)
    run.metrics = MetricsLog(run.out / "metrics.jsonl", truncate_after_step=run.step) if d.main else None
    if run.metrics and cfg.log:  # --log sinks get every record metrics.jsonl gets (train/loggers.py)
        run.metrics = LoggedMetrics(run.metrics, make_sinks(cfg.log, run.out, cfg.to_dict(), run.step))
    say(d, f"model: {run.model.num_params():,} weights ({mcfg.n_layers} layers, width {mcfg.dim}, vocab {mcfg.vocab_size}); "
           f"batch {cfg.batch_size}×{run.seq_len} tokens = {d.world_size} process(es) × {run.micro} × {run.accum} "
           f"accumulation; device {run.device}"
           + (f"; MFU peak {run.peak / 1e9:.1f} GFLOP/s ({peak_src})" if run.peak else ""))
    run.bar = tqdm(total=run.total_steps, initial=run.step, disable=not bar_shown(d.main, cfg.progress, sys.stderr),
                   unit="step", dynamic_ncols=True, file=sys.stderr)


def bar_shown(main: bool, progress: bool, stream) -> bool:
    """Whether the progress bar is drawn: on the main process, asked for, and onto a terminal (redirected
    into a file its carriage-return redraws pile up; the loop prints a step line every --log-every instead)."""
    isatty = getattr(stream, "isatty", None)
    return bool(main and progress and isatty is not None and isatty())
