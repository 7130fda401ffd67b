"""The training loop: one process or many (torchrun), exact resume, faults handled.

Outline of `train(cfg)`:
  set up (device, process group, data, model: fresh, --init-from or --resume)
  for step in range(start, total):
      lr from the schedule (a pure function of step)
      accumulate gradients over micro-batches drawn from (seed, step)
      global gradient norm (logged before clipping); stop or skip if loss/norm is not finite
      optimizer step
      every eval_every steps: held-out loss and bits per byte, checkpoint, loss.png
  final evaluation and checkpoint

Everything that decides a step's numbers (batch, dropout mask, learning rate) is a function
of (seed, step, rank), and optimizer moments plus RNG states are checkpointed, so a resumed
run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import distributed as gdist
from ..checkpoint.folders import (
    load_training,
    newest_checkpoint,
    prune,
    read_pointer,
    remove_leftovers,
    save_training,
    write_pointer,
)
from ..config import ModelConfig, TrainConfig
from .cpu_memory import keep_freed_memory
from ..text.data import TokenFile, get_batch
from ..errors import UserError
from .evaluate import score, summary
from .metrics import MetricsLog, flops_per_token, load_plotting, machine_peak, plot_losses
from .optim import lr_at, make_optimizer, set_lr
from .runstate import StopFlag, plan_steps, rng_state, set_rng_state
from .setup import autocast_for, build_model, read_prepared, resolve_device, set_dropout, uses_cuda


class NonFiniteLoss(UserError):
    """A step produced a non-finite loss or gradient norm; the optimizer step was not taken."""


def forward_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch (a module-level function so tests can inject faults)."""
    _, loss = model(x, y)
    return loss


# ----------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one training run; returns a summary (steps, losses, last evaluation, stop reason)."""
    cuda = uses_cuda(cfg.device)
    d = gdist.setup("cuda" if cuda else "cpu")
    threads = torch.get_num_threads()
    clean = False
    try:
        with keep_freed_memory(cfg.keep_freed_memory and not cuda):  # CPU tensors live in malloc's memory
            result = _train(cfg, d)
        clean = True
        return result
    finally:
        torch.set_num_threads(threads)
        gdist.teardown(d, clean)


def _say(d: gdist.Dist, msg: str) -> None:
    if d.main:
        print(msg, file=sys.stderr, flush=True)


def _train(cfg: TrainConfig, d: gdist.Dist) -> dict:
    t_start = time.perf_counter()
    device = resolve_device(cfg.device, d)
    data = Path(cfg.data)
    meta = read_prepared(data)
    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        left = remove_leftovers(out)
        if left:
            _say(d, f"removed unfinished checkpoint writes: {', '.join(left)}")
    gdist.barrier(d)

    # ---- resume or start
    resume_from = newest_checkpoint(out) if cfg.resume else None
    saved = None
    if cfg.resume and resume_from is None:
        _say(d, f"--resume: no complete checkpoint in {out} yet, so starting fresh")
    if resume_from is not None:
        model_sd, optim_sd, saved, rng_tensors = load_training(resume_from)
        _say(d, f"resuming from {resume_from} (step {saved['step']})")
    elif cfg.init_from and d.main:
        _say(d, f"initialising from {cfg.init_from}")

    torch.manual_seed(cfg.seed)
    if saved is not None:
        from ..model import Transformer

        mcfg = ModelConfig.from_dict(json.loads((resume_from / "config.json").read_text())["model"])
        model = Transformer(mcfg)
        set_dropout(model, cfg.dropout)
        model.load_state_dict(model_sd)
    else:
        model = build_model(cfg, meta)
    mcfg = model.config
    seq_len = cfg.seq_len or mcfg.max_seq_len
    if seq_len > mcfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the model's context ({mcfg.max_seq_len})")

    # ---- batch arithmetic: global batch = world · micro · accum
    if cfg.batch_size % d.world_size:
        raise UserError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({d.world_size})")
    per_rank = cfg.batch_size // d.world_size
    micro = cfg.micro_batch or per_rank
    if per_rank % micro:
        raise UserError(f"--micro-batch {micro} must divide the per-process batch {per_rank}")
    accum = per_rank // micro
    tokens_per_step = cfg.batch_size * seq_len

    train_tokens, val_tokens = (TokenFile(data / f"{split}.bin", meta["dtype"]) for split in ("train", "val"))
    if len(train_tokens) <= seq_len + 1:
        raise UserError(f"{data}/train.bin has {len(train_tokens)} tokens, fewer than one sequence of {seq_len + 1}")

    # ---- model on device, wrapped, optimizer
    model.to(device)
    if cfg.compile:
        model.compile()
        _say(d, "compile: the first step (and the first evaluation) compile the model once, tens of seconds on a CPU")
    net = gdist.wrap(model, d, cfg.fsdp, device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), device, sharded=cfg.fsdp and d.enabled)
    step, total_steps, elapsed0 = 0, (cfg.max_steps if not cfg.time_budget else None), 0.0
    best = {"name": None, "val_loss": math.inf}
    if saved is not None:
        gdist.load_optimizer(net, optimizer, optim_sd)
        set_rng_state(saved["rng"], rng_tensors)
        step, total_steps, elapsed0 = saved["step"], saved["total_steps"], saved["elapsed"]
        best = saved.get("best") or best
        if best.get("val_loss") is None:
            best["val_loss"] = math.inf
    if cfg.time_budget and cfg.calibrate_steps > cfg.warmup_steps and total_steps is None:
        raise UserError("--calibrate-steps must not exceed --warmup-steps with --time-budget, so the "
                        "calibration steps' learning rate does not depend on the step count it fixes")
    # ---- CPU threads: as asked, as the resumed run had them (same reduction order, same bits), or measured
    n_threads = cfg.threads or (saved or {}).get("threads") or 0
    if n_threads:
        torch.set_num_threads(n_threads)
    elif device.type == "cpu":
        from .metrics import pick_threads

        n_threads, one, many = pick_threads(torch.get_num_threads())
        if d.main:
            _say(d, f"CPU threads: {n_threads} (one thread {one / 1e9:.0f} GFLOP/s, all {many / 1e9:.0f} GFLOP/s "
                    "on a training-sized matmul; --threads N fixes it)")
    n_threads = torch.get_num_threads()
    autocast = autocast_for(device, cfg.dtype)
    tokenizer_path = data / "tokenizer.json"

    # ---- measurement
    peak, peak_src = machine_peak(device) if d.main else (None, "")
    fpt = flops_per_token(mcfg, seq_len)
    metrics = MetricsLog(out / "metrics.jsonl", truncate_after_step=step) if d.main else None
    if d.main:
        n_params = model.num_params()
        _say(d, f"model: {n_params:,} weights ({mcfg.n_layers} layers, width {mcfg.dim}, vocab {mcfg.vocab_size}); "
                f"batch {cfg.batch_size}×{seq_len} tokens = {d.world_size} process(es) × {micro} × {accum} accumulation; "
                f"device {device}" + (f"; MFU peak {peak / 1e9:.1f} GFLOP/s ({peak_src})" if peak else ""))

    # ---- the pieces of one run
    eval_ids = np.asarray(val_tokens[: (cfg.eval_tokens + 1) if cfg.eval_tokens else len(val_tokens)])
    eval_bytes = int(round(meta.get("val_bytes", 0) * min(1.0, len(eval_ids) / max(1, len(val_tokens)))))

    def evaluate() -> dict:
        net.eval()
        try:
            if cfg.fsdp and d.enabled:  # every rank must run the same forwards under FSDP
                nats, n = score(net, eval_ids, seq_len, device, batch_size=micro, autocast=autocast)
            else:
                nats, n = score(model, eval_ids, seq_len, device, batch_size=micro, rank=d.rank,
                                world_size=d.world_size, autocast=autocast)
                tot = gdist.all_sum(torch.tensor([nats, float(n)], dtype=torch.float64, device=device), d)
                nats, n = float(tot[0]), int(tot[1])
        finally:
            net.train()
        return summary(nats, n, eval_bytes or 1)

    def save(val: dict | None, reason: str) -> str | None:
        """Checkpoint at `step` (collective); rank 0 writes. Returns the folder name."""
        model_sd_, optim_sd_ = gdist.full_states(net, optimizer)
        failed, name = None, None
        if d.main:
            js, tensors = rng_state()
            state = {
                "step": step, "total_steps": total_steps, "elapsed": elapsed0 + time.perf_counter() - t_start,
                "tokens_seen": step * tokens_per_step, "val": val, "best": best, "reason": reason,
                "world_size": d.world_size, "threads": n_threads, "torch": torch.__version__, "rng": js, "config": cfg.to_dict(),
                "time_budget_plan": plan,
            }
            try:
                folder = save_training(out, step, mcfg, model_sd_, tokenizer_path, optim_sd_, state, tensors)
                name = folder.name
            except OSError as e:
                prev = read_pointer(out, "latest")
                failed = (f"could not write checkpoint {out}/step-{step:06d} ({e}); nothing partial was left behind"
                          + (f" and {out}/{prev} is intact" if prev else "") + ": free space or fix permissions, then --resume")
        if gdist.any_rank(failed is not None, d, device):
            raise UserError(failed or "rank 0 could not write a checkpoint")
        return name

    def after_eval_checkpoint(val: dict) -> None:
        nonlocal best
        is_best = val["loss"] < best["val_loss"]
        if is_best:
            best = {"name": f"step-{step:06d}", "val_loss": val["loss"]}
        name = save(val, "eval")
        if d.main:
            if is_best:
                write_pointer(out, "best", name)
            prune(out, cfg.keep_last, {best["name"], name} - {None})
            plot_losses(out / "metrics.jsonl", out / "loss.png")

    def evaluate_and_checkpoint() -> dict:
        """Score the held-out tokens, log the result, checkpoint: what every evaluation does."""
        val = evaluate()
        if d.main:
            metrics.write({"step": step, "val_loss": val["loss"], "val_bpb": val["bpb"],
                           "time": round(elapsed0 + time.perf_counter() - t_start, 3)})
        after_eval_checkpoint(val)
        return val

    # ---- train
    from tqdm import tqdm

    plan = saved.get("time_budget_plan") if saved else None
    bar = tqdm(total=total_steps, initial=step, disable=not (d.main and cfg.progress), unit="step",
               dynamic_ncols=True, file=sys.stderr)
    losses: list[float] = []
    stop_reason = None
    last_val = None
    net.train()
    t_calib = None
    t_log, tok_log = time.perf_counter(), 0
    start_step = step
    with StopFlag() as stop:
        while total_steps is None or step < total_steps:
            if cfg.dropout > 0:  # the dropout masks are a function of (seed, step, rank)
                torch.manual_seed(cfg.seed * 1_000_003 + step * d.world_size + d.rank)
            lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, total_steps or 10**9)
            set_lr(optimizer, lr)
            loss_sum = torch.zeros((), device=device)
            # This rank's rows of the global batch of step `step`, whatever the world size or accumulation.
            xs, ys = get_batch(train_tokens, cfg.batch_size, seq_len, cfg.seed, step, d.rank, d.world_size)  # (B/W, T)
            for m in range(accum):
                x = xs[m * micro:(m + 1) * micro].to(device, non_blocking=True)  # (micro, T)
                y = ys[m * micro:(m + 1) * micro].to(device, non_blocking=True)  # (micro, T)
                last = m == accum - 1
                sync = contextlib.nullcontext()
                if d.enabled and not last:
                    if hasattr(net, "no_sync"):
                        sync = net.no_sync()
                    elif hasattr(net, "set_requires_gradient_sync"):
                        net.set_requires_gradient_sync(False)
                if d.enabled and last and hasattr(net, "set_requires_gradient_sync"):
                    net.set_requires_gradient_sync(True)
                with sync:
                    with autocast():
                        loss = forward_loss(net, x, y)
                    (loss / accum).backward()
                loss_sum += loss.detach().float()
            loss_val = float(gdist.all_mean(loss_sum / accum, d))
            params = [p for p in model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            norm = float(norm)
            finite = math.isfinite(loss_val) and math.isfinite(norm)
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                if not cfg.skip_nonfinite:
                    prev = read_pointer(out, "latest")
                    bar.close()
                    if metrics:
                        metrics.write({"step": step + 1, "nonfinite": True, "loss": loss_val, "grad_norm": norm})
                        metrics.close()
                    raise NonFiniteLoss(
                        f"step {step + 1}: loss {loss_val} / gradient norm {norm} is not finite; stopped before the "
                        f"optimizer step, weights untouched"
                        + (f"; last good checkpoint {out}/{prev}" if prev else "; no checkpoint was written yet")
                        + ": lower --lr, or pass --skip-nonfinite to skip such steps")
                _say(d, f"step {step + 1}: non-finite loss/gradient norm ({loss_val}, {norm}): step skipped")
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss_val)
            tok_log += tokens_per_step
            bar.update(1)

            # ---- time budget: time the first steps (the first one excluded: warm-up), then fix the step count
            if total_steps is None:
                if step == start_step + 1:
                    t_calib = time.perf_counter()
                elif step == start_step + 1 + cfg.calibrate_steps or step >= cfg.warmup_steps:
                    sec_per_step = (time.perf_counter() - t_calib) / (step - start_step - 1)
                    # One real evaluation and checkpoint, timed: each later one costs the same, and a
                    # forward-only estimate would miss the writing and the loss picture (budget overrun).
                    if d.main:
                        load_plotting()  # a one-off cost: not part of each evaluation's
                    if cfg.compile:
                        evaluate()  # compiles the eval-mode graph (a one-off cost too), untimed
                    t_eval = time.perf_counter()
                    last_val = evaluate_and_checkpoint()
                    now = time.perf_counter()
                    # Every rank plans with the same numbers, so all stop at the same step.
                    timing = gdist.all_mean(torch.tensor([sec_per_step, now - t_eval, elapsed0 + now - t_start],
                                                         dtype=torch.float64, device=device), d)
                    sec_per_step, sec_per_eval, spent = (float(v) for v in timing)
                    more = plan_steps(cfg.time_budget - spent, sec_per_step, cfg.eval_every, sec_per_eval)
                    total_steps = step + more
                    plan = {"sec_per_step": sec_per_step, "sec_per_eval": sec_per_eval, "spent": spent, "calibrated_at": step,
                            "total_steps": total_steps, "budget": cfg.time_budget}
                    bar.total = total_steps
                    bar.refresh()
                    _say(d, f"time budget {cfg.time_budget:g} s: {sec_per_step * 1000:.0f} ms per step, "
                            f"{sec_per_eval:.1f} s per evaluation and checkpoint, so {total_steps} steps in all "
                            "(schedule fixed)")
                    t_log += now - t_eval  # tokens/s measures training, not evaluation

            # ---- log
            now = time.perf_counter()
            if d.main and (step % max(1, cfg.log_every) == 0 or step == total_steps):
                tok_s = tok_log / max(1e-9, now - t_log)
                mfu = fpt * tok_s / peak if peak else None
                rec = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm, "tokens": step * tokens_per_step,
                       "tok_s": round(tok_s, 1), "mfu": None if mfu is None else round(mfu, 4),
                       "time": round(elapsed0 + now - t_start, 3)}
                if not finite:
                    rec["skipped"] = True
                metrics.write(rec)
                bar.set_postfix_str(f"loss {loss_val:.4f} | {tok_s:,.0f} tok/s"
                                    + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""))
                t_log, tok_log = now, 0
            if cfg.log_every and d.main and not cfg.progress and step % cfg.log_every == 0:
                print(f"step {step}: loss {loss_val:.4f}", file=sys.stderr, flush=True)

            # ---- evaluate + checkpoint
            done = total_steps is not None and step >= total_steps
            if cfg.eval_every and step % cfg.eval_every == 0 and not done:
                last_val = evaluate_and_checkpoint()
                if d.main:
                    bar.write(f"step {step}: held-out loss {last_val['loss']:.4f}, {last_val['bpb']:.4f} bits per byte")
                t_log, tok_log = time.perf_counter(), 0  # tokens/s measures training, not evaluation
            if gdist.any_rank(stop.signal is not None, d, device):
                stop_reason = stop.signal or "signal"
                break
        bar.close()
        if stop_reason:
            name = save(last_val, stop_reason)
            _say(d, f"stopped by {stop_reason} at step {step}: saved {out}/{name}; `--resume` continues")
        else:
            last_val = evaluate_and_checkpoint()
            _say(d, f"done: {step} steps; held-out loss {last_val['loss']:.4f}, {last_val['bpb']:.4f} bits per byte; "
                    f"run in {out}")
    if metrics:
        metrics.close()
    return {"steps": step, "total_steps": total_steps, "losses": losses, "val": last_val, "stopped": stop_reason,
            "run": str(out), "wall": time.perf_counter() - t_start, "plan": plan}
