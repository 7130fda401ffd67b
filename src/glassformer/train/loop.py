"""The training loop: one process or many (torchrun), exact resume, faults handled.

`train(cfg)` is its table of contents: `start_run` (train/setup.py), then per step `one_step`
(around train/step.py `train_step`), `fix_time_budget`, `follow_the_clock`, `log_step`, `evaluate_if_due`,
`snapshot_if_due`, a signal check; then `finish`, all sharing one `RunState` (train/runstate.py). A step's numbers
are a function of (seed, step, rank), so a resume repeats the run bit for bit (docs/training.md#the-loop).
"""

from __future__ import annotations

import sys
import time

import torch

from .distributed import all_mean, all_sum, any_rank, full_states, teardown
from .distributed import setup as setup_processes
from ..checkpoint.dcp import finish_pending, save_sharded, when_complete, write_failure
from ..checkpoint.folders import add_snapshot, prune, read_pointer, step_name, write_pointer
from ..checkpoint.training import save_training
from ..config import TrainConfig
from ..errors import DiskFullError, UserError
from ..moe import expert_load
from .cpu_memory import keep_freed_memory
from .evaluate import score, summary
from .loader import data_state, next_batch
from .metrics import load_plotting, plot_losses
from .lora import adapter_writer
from .optim import decay_start, lr_at
from .runstate import RunState, StopFlag, least_total, plan_steps, rng_state
from .setup import say, start_run, uses_cuda
from .step import train_step
from .stats import measure_if_due, weights_if_due


class NonFiniteLoss(UserError):
    """A step produced a non-finite loss or gradient norm; the optimizer step was not taken."""


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one training run; returns a summary (steps, losses, last evaluation, stop reason)."""
    cuda = uses_cuda(cfg.device)
    d = setup_processes("cuda" if cuda else "cpu")
    threads, clean = torch.get_num_threads(), False
    try:
        with keep_freed_memory(cfg.keep_freed_memory and not cuda):  # CPU tensors live in malloc's memory
            run = start_run(cfg, d)
            run.net.train()
            with StopFlag() as stop:
                while not run.done:
                    before = weights_if_due(run)
                    one_step(run)
                    fix_time_budget(run)
                    follow_the_clock(run)
                    measure_if_due(run, before)
                    log_step(run)
                    evaluate_if_due(run)
                    snapshot_if_due(run)
                    if any_rank(stop.signal is not None, d, run.device):
                        run.stop_reason = stop.signal or "signal"
                        break
                result = finish(run)
        clean = True
        return result
    finally:
        torch.set_num_threads(threads)
        teardown(d, clean)


# ----------------------------------------------------------------------------- one step


def one_step(run: RunState) -> None:
    """This rank's rows of step `run.step`'s global batch through `train_step`, at the schedule's rate."""
    cfg, d = run.cfg, run.d
    if cfg.dropout > 0 or cfg.lora_dropout > 0:  # the dropout masks are a function of (seed, step, rank)
        torch.manual_seed(cfg.seed * 1_000_003 + run.step * d.world_size + d.rank)
    run.lr = lr_at(run.step, cfg.lr, cfg.min_lr, cfg.warmup_steps, run.total_steps or 10**9, cfg.schedule, cfg.decay_frac)
    xs, ys = next_batch(run)  # (B/W, T) from (seed, step); ys -1 where the mask says no loss
    res = train_step(run.net, run.optimizer, xs, ys, accum=run.accum, lr=run.lr, grad_clip=cfg.grad_clip,
                     autocast=run.autocast, d=d, device=run.device, masked=run.train_mask is not None)
    if not res.stepped:
        nonfinite(run, res)
    run.step += 1
    run.losses.append(res.loss)
    run.last = res
    run.tok_log += run.tokens_per_step
    run.bar.update(1)


def nonfinite(run: RunState, res) -> None:
    """Stop the run with a message (weights untouched), or with --skip-nonfinite say the step was skipped."""
    step = run.step + 1
    if run.cfg.skip_nonfinite:
        say(run.d, f"step {step}: non-finite loss/gradient norm ({res.loss}, {res.grad_norm}): step skipped")
        return
    complete_saves(run)  # a dcp checkpoint still being written is the last good one: completed first
    prev = read_pointer(run.out, "latest")
    run.bar.close()
    if run.metrics:
        run.metrics.write({"step": step, "nonfinite": True, "loss": res.loss, "grad_norm": res.grad_norm})
        run.metrics.close()
    raise NonFiniteLoss(
        f"step {step}: loss {res.loss} / gradient norm {res.grad_norm} is not finite; stopped before the "
        f"optimizer step, weights untouched"
        + (f"; last good checkpoint {run.out}/{prev}" if prev else "; no checkpoint was written yet")
        + ": lower --lr, or pass --skip-nonfinite to skip such steps")


def fix_time_budget(run: RunState) -> None:
    """With --time-budget: time the first steps (the first one excluded: warm-up), then one real
    evaluation and checkpoint, and fix the step count (and so the schedule) from them, once."""
    cfg, done = run.cfg, run.step - run.start_step
    if run.total_steps is not None:
        return
    if done == 1:
        run.t_calib = time.perf_counter()
        return
    if not (done == 1 + cfg.calibrate_steps or run.step >= cfg.warmup_steps):
        return
    sec_per_step = (time.perf_counter() - run.t_calib) / (done - 1)
    # One real evaluation and checkpoint, timed: each later one costs the same, and a
    # forward-only estimate would miss the writing and the loss picture (budget overrun).
    if run.d.main:
        load_plotting()  # a one-off cost: not part of each evaluation's
    if cfg.compile:
        evaluate(run)  # compiles the eval-mode graph (a one-off cost too), untimed
    t_eval = time.perf_counter()
    run.last_val = evaluate_and_checkpoint(run)
    now = time.perf_counter()
    # Every rank plans with the same numbers, so all stop at the same step.
    timing = all_mean(torch.tensor([sec_per_step, now - t_eval, run.elapsed0 + now - run.t_start],
                                         dtype=torch.float64, device=run.device), run.d)
    sec_per_step, sec_per_eval, spent = (float(v) for v in timing)
    run.total_steps = run.step + plan_steps(cfg.time_budget - spent, sec_per_step, cfg.eval_every, sec_per_eval)
    run.plan = {"sec_per_step": sec_per_step, "sec_per_eval": sec_per_eval, "spent": spent,
                "calibrated_at": run.step, "calibrated_total_steps": run.total_steps, "total_steps": run.total_steps,
                "budget": cfg.time_budget}
    run.bar.total = run.total_steps
    run.bar.refresh()
    say(run.d, f"time budget {cfg.time_budget:g} s: {sec_per_step * 1000:.0f} ms per step, "
               f"{sec_per_eval:.1f} s per evaluation and checkpoint, so {run.total_steps} steps in all (schedule fixed)")
    run.t_log += now - t_eval  # tokens/s measures training, not evaluation
    run.eval_seconds += now - t_eval


# Re-plans under wsd: every REPLAN_EVERY steps, from the speed over the last WINDOW intervals (a few
# seconds of the demo model: long enough to average a step's jitter, short enough to follow a shift
# of the machine's speed, which on a shared virtual machine came and went within a run:
# docs/benchmarks-log.md#quality-per-cpu-minute-on-tinyshakespeare).
REPLAN_EVERY, WINDOW = 50, 4


def follow_the_clock(run: RunState) -> None:
    """With --time-budget under wsd (and --follow-clock, the default): plan the step count again every
    REPLAN_EVERY steps from the latest steps' speed, until the decay begins; from then on it is fixed.
    Until the decay the rate is flat whatever the count, so a new count changes no step already taken
    (least_total keeps every step taken at the full rate); the final count's schedule is the one every
    step followed. Ranks average their timings, so all plan alike."""
    cfg, plan = run.cfg, run.plan
    if not (cfg.time_budget and cfg.follow_clock and cfg.schedule == "wsd") or plan is None or "decay_from" in plan:
        return
    if fix_at_decay(run) or (run.clock and run.step % REPLAN_EVERY):
        return
    run.clock.append((run.step, time.perf_counter() - run.t_start - run.eval_seconds))  # training seconds
    if run.step % REPLAN_EVERY == 0 and len(run.clock) > 1:
        replan(run)
        fix_at_decay(run)


def replan(run: RunState) -> None:
    """The step count that fits the rest of the budget at the speed of the last WINDOW intervals."""
    cfg, plan = run.cfg, run.plan
    (s0, t0), (s1, t1) = run.clock[-1 - min(WINDOW, len(run.clock) - 1)], run.clock[-1]
    timing = all_mean(torch.tensor([(t1 - t0) / (s1 - s0), run.elapsed0 + time.perf_counter() - run.t_start],
                                   dtype=torch.float64, device=run.device), run.d)
    sec_per_step, spent = (float(v) for v in timing)
    total = run.step + plan_steps(cfg.time_budget - spent, sec_per_step, cfg.eval_every, plan["sec_per_eval"])
    total = max(total, least_total(run.step, cfg.warmup_steps, cfg.decay_frac) or run.total_steps)
    plan.setdefault("replans", []).append([run.step, total, round(sec_per_step, 6)])
    plan["total_steps"] = run.total_steps = total
    run.bar.total = total
    run.bar.refresh()


def fix_at_decay(run: RunState) -> bool:
    """Whether the next step decays under the current count; if so the count is fixed from now (said once)."""
    cfg, plan = run.cfg, run.plan
    if run.step <= decay_start(cfg.warmup_steps, run.total_steps, cfg.decay_frac):
        return False
    plan["decay_from"] = run.step
    say(run.d, f"time budget {cfg.time_budget:g} s: the decay begins at step {run.step}, {run.total_steps} steps "
               f"in all ({len(plan.get('replans', []))} re-plans from the measured speed; fixed from now)")
    return True


def log_step(run: RunState) -> None:
    """Every --log-every steps (and the last): a metrics.jsonl line with tokens/s and MFU, the bar's text."""
    cfg, step, res = run.cfg, run.step, run.last
    now = time.perf_counter()
    if run.d.main and run.stats is not None and not (step % max(1, cfg.log_every) == 0 or step == run.total_steps):
        run.metrics.write({"step": step, "stats": run.stats})  # no log line at this step: the statistics alone
    if run.d.main and (step % max(1, cfg.log_every) == 0 or step == run.total_steps):
        tok_s = run.tok_log / max(1e-9, now - run.t_log)
        mfu = run.flops_per_token * tok_s / run.peak if run.peak else None
        rec = {"step": step, "loss": res.loss, "lr": run.lr, "grad_norm": res.grad_norm,
               "tokens": step * run.tokens_per_step, "tok_s": round(tok_s, 1),
               "mfu": None if mfu is None else round(mfu, 4), "time": round(run.elapsed0 + now - run.t_start, 3)}
        if not res.stepped:
            rec["skipped"] = True
        rec.update(moe_record(run.model, res))
        if run.stats is not None:
            rec["stats"] = run.stats
        run.metrics.write(rec)
        run.bar.set_postfix_str(f"loss {res.loss:.4f} | {tok_s:,.0f} tok/s"
                                + (f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""))
        run.t_log, run.tok_log = now, 0
    if cfg.log_every and run.d.main and run.bar.disable and step % cfg.log_every == 0:  # no bar drawn (setup.bar_shown)
        print(f"step {step}: loss {res.loss:.4f}", file=sys.stderr, flush=True)


def moe_record(model: torch.nn.Module, res) -> dict:
    """A mixture of experts' part of a log line: the step's load-balancing loss (when it trains with one)
    and, per mixture layer, each expert's share of the routed slots in the step's last forward."""
    out = {}
    if res.aux_loss is not None:
        out["aux_loss"] = round(res.aux_loss, 6)
    load = expert_load(model)
    if load:
        out["moe_load"] = [[round(x, 5) for x in layer] for layer in load]
    return out


# ----------------------------------------------------------------------------- evaluate and checkpoint


def evaluate_if_due(run: RunState) -> None:
    """Every --eval-every steps, except the last (finish evaluates that one)."""
    every = run.cfg.eval_every
    if every and run.step % every == 0 and not run.done:
        t = time.perf_counter()
        run.last_val = evaluate_and_checkpoint(run)
        run.eval_seconds += time.perf_counter() - t
        if run.d.main:
            run.bar.write(f"step {run.step}: held-out loss {run.last_val['loss']:.4f}, "
                          f"{run.last_val['bpb']:.4f} bits per byte")
        run.t_log, run.tok_log = time.perf_counter(), 0  # tokens/s measures training, not evaluation


def snapshot_if_due(run: RunState) -> None:
    """Every --snapshot-every steps: a checkpoint listed in run/snapshots, which pruning keeps (the
    explorer's checkpoint slider, `glassformer view --run`). An evaluation's checkpoint of the same
    step is listed, not written again; so is the last step's, which `finish` writes."""
    every, step = run.cfg.snapshot_every, run.step
    if not every or step % every:
        return
    evaluated = bool(run.cfg.eval_every and step % run.cfg.eval_every == 0)
    calibrated = bool(run.plan and run.plan["calibrated_at"] == step)  # fix_time_budget's checkpoint
    name = f"step-{step:06d}"
    if not (run.done or evaluated or calibrated):  # the same on every rank: save_checkpoint is a collective
        name = save_checkpoint(run, None, "snapshot")
    if run.d.main:
        add_snapshot(run.out, name)


def evaluate(run: RunState) -> dict:
    """Held-out loss and bits per byte of the eval tokens (a collective under torchrun)."""
    cfg, d, net = run.cfg, run.d, run.net
    net.eval()
    try:
        chat = {"mask": run.eval_mask, "block": run.block}  # None, None for plain data
        if cfg.fsdp and d.enabled:  # every rank must run the same forwards under FSDP
            nats, n = score(net, run.eval_ids, run.seq_len, run.device, batch_size=run.micro, autocast=run.autocast,
                            **chat)
        else:
            nats, n = score(run.model, run.eval_ids, run.seq_len, run.device, batch_size=run.micro, rank=d.rank,
                            world_size=d.world_size, autocast=run.autocast, **chat)
            tot = all_sum(torch.tensor([nats, float(n)], dtype=torch.float64, device=run.device), d)
            nats, n = float(tot[0]), int(tot[1])
    finally:
        net.train()
    return summary(nats, n, run.eval_bytes or 1)


def evaluate_and_checkpoint(run: RunState) -> dict:
    """Score the held-out tokens, log the result, checkpoint (best pointer, pruning, loss.png)."""
    val = evaluate(run)
    if run.d.main:
        run.metrics.write({"step": run.step, "val_loss": val["loss"], "val_bpb": val["bpb"],
                           "time": round(run.elapsed0 + time.perf_counter() - run.t_start, 3)})
    is_best = val["loss"] < run.best["val_loss"]
    if is_best:
        run.best = {"name": f"step-{run.step:06d}", "val_loss": val["loss"]}
    name = save_checkpoint(run, val, "eval")
    if run.d.main:
        if is_best:  # once the folder is complete (a dcp save may still be writing: checkpoint/dcp.py)
            when_complete(run.out, lambda: write_pointer(run.out, "best", name))
        prune(run.out, run.cfg.keep_last, {run.best["name"], name} - {None})
        plot_losses(run.out / "metrics.jsonl", run.out / "loss.png")
    return val


def save_checkpoint(run: RunState, val: dict | None, reason: str) -> str | None:
    """Checkpoint at `run.step` (a collective); rank 0 writes, or with --checkpoint-format dcp each
    rank its own shards (checkpoint/dcp.py). Returns the folder name."""
    if run.cfg.checkpoint_format == "dcp":
        return save_sharded_checkpoint(run, val, reason)
    model_sd, optim_sd = full_states(run.net, run.optimizer)
    failed, name, out, step = None, None, run.out, run.step
    if run.d.main:
        state, tensors = checkpoint_state(run, val, reason)
        try:
            folder = save_training(out, step, run.model.config, model_sd, run.data / "tokenizer.json", optim_sd,
                                   state, tensors, adapter_writer(run.model, model_sd, run.data / "tokenizer.json"))
            name = folder.name
        except OSError as e:
            failed = _failed_write(e, out, step)
    if any_rank(failed is not None, run.d, run.device):  # every rank stops together; rank 0 says why
        raise failed or UserError("rank 0 could not write a checkpoint")
    return name


def save_sharded_checkpoint(run: RunState, val: dict | None, reason: str) -> str:
    """--checkpoint-format dcp: every rank writes the weights and moments it holds, nothing gathered;
    rank 0 the small files around them. A failed write stops every rank with rank 0's line."""
    from torch.distributed.checkpoint.api import CheckpointException

    failed, out, step = None, run.out, run.step
    state, tensors = checkpoint_state(run, val, reason) if run.d.main else (None, None)
    try:
        save_sharded(out, step, run.model.config, run.net, run.optimizer, run.data / "tokenizer.json", state, tensors,
                     run.d.main)
    except (OSError, CheckpointException) as e:  # DCP raises the same CheckpointException on every rank
        failed = _failed_write(e if isinstance(e, OSError) else OSError(write_failure(e)), out, step)
    if any_rank(failed is not None, run.d, run.device):
        raise failed or UserError(f"another process could not write its shards of {out}/{step_name(step)}")
    return step_name(step)


def checkpoint_state(run: RunState, val: dict | None, reason: str) -> tuple[dict, dict]:
    """(train_state.json's dict, the RNG tensors) of a checkpoint at `run.step` (rank 0's)."""
    step = run.step
    js, tensors = rng_state()
    state = {
        "step": step, "total_steps": run.total_steps, "elapsed": run.elapsed0 + time.perf_counter() - run.t_start,
        "tokens_seen": step * run.tokens_per_step, "val": val, "best": run.best, "reason": reason,
        "world_size": run.d.world_size, "threads": run.n_threads, "torch": torch.__version__, "rng": js,
        "config": run.cfg.to_dict(), "time_budget_plan": run.plan, "data": data_state(run),
    }
    if run.grown:
        state["vocab_growth"] = run.grown
    return state, tensors


def complete_saves(run: RunState) -> None:
    """Wait for a --checkpoint-format dcp save still writing in the background and complete its
    folder; a failed write stops every rank with one line, as a failed save does."""
    from torch.distributed.checkpoint.api import CheckpointException

    failed = None
    try:
        finish_pending(run.out)
    except (OSError, CheckpointException) as e:
        failed = _failed_write(e if isinstance(e, OSError) else OSError(write_failure(e)), run.out, run.step)
    if any_rank(failed is not None, run.d, run.device):
        raise failed or UserError(f"another process could not write its shards of {run.out}/{step_name(run.step)}")


def _failed_write(e: OSError, out, step: int) -> UserError:
    """The one line for a checkpoint that could not be written (atomic_folder removed its partial
    folder). A full disk's DiskFullError already names the folder and the bytes: it goes out as it is,
    with only the run's previous checkpoint added, so the line says nothing twice."""
    prev = read_pointer(out, "latest")
    if isinstance(e, DiskFullError):  # when prev is this step's folder (rewritten), the error says it is as it was
        kept = f"; {out}/{prev} is intact: --resume continues from it" if prev and prev != step_name(step) else ""
        error = DiskFullError(f"{e}{kept}")
        error.errno = e.errno
        return error
    return UserError(f"could not write checkpoint {out}/step-{step:06d} ({e}); nothing partial was left behind"
                     + (f" and {out}/{prev} is intact" if prev else "") + ": free space or fix permissions, then --resume")


# ----------------------------------------------------------------------------- finish


def finish(run: RunState) -> dict:
    """After the last step: a checkpoint where a signal stopped the run, else the final evaluation
    and checkpoint; the run's summary."""
    run.bar.close()
    if run.stop_reason:
        name = save_checkpoint(run, run.last_val, run.stop_reason)
        say(run.d, f"stopped by {run.stop_reason} at step {run.step}: saved {run.out}/{name}; `--resume` continues")
    else:
        run.last_val = evaluate_and_checkpoint(run)
        say(run.d, f"done: {run.step} steps; held-out loss {run.last_val['loss']:.4f}, "
                   f"{run.last_val['bpb']:.4f} bits per byte; run in {run.out}")
    complete_saves(run)
    if run.metrics:
        run.metrics.close()
    return {"steps": run.step, "total_steps": run.total_steps, "losses": run.losses, "val": run.last_val,
            "stopped": run.stop_reason, "run": str(run.out), "wall": time.perf_counter() - run.t_start,
            "plan": run.plan}
