"""The training loop: exact resume, faults (signals, NaN, failed and killed writes), schedule, FLOPs."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassformer.checkpoint.folders import complete_checkpoints, read_pointer
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.config import TrainConfig
from glassformer.train.metrics import read_metrics

from ..support import data, REPO  # noqa: F401  (a fixture)

# A short run that exercises every RNG (dropout), evaluation and pruning; keep_last large so all stay.
ARGS = ["--preset", "tiny", "--max-steps", "12", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4",
        "--eval-tokens", "512", "--log-every", "1", "--warmup-steps", "3", "--dropout", "0.1", "--keep-last", "10",
        "--no-progress", "--seed", "7", "--threads", "1"]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run every fault test is compared against."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 0
    return out


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r and "val_loss" not in r]


def weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def inject(monkeypatch, at_call: int, action):
    """Run action(loss) on the at_call-th forward of training (1-based), via train_step's forward_loss hook."""
    import glassformer.train.step as T

    real, calls = T.forward_loss, {"n": 0}

    def hooked(model, x, y):
        loss = real(model, x, y)
        calls["n"] += 1
        return action(loss) if calls["n"] == at_call else loss

    monkeypatch.setattr(T, "forward_loss", hooked)


def test_run_folder_layout(reference):
    assert read_pointer(reference, "latest") == "step-000012"
    best = read_pointer(reference, "best")
    assert (reference / best / "COMPLETE").is_file()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "train_state.json", "train_state.safetensors"):
        assert (reference / "step-000012" / f).is_file(), f
    assert (reference / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8, 12]
    assert len(losses(reference)) == 12
    # The best pointer names the checkpoint with the lowest held-out loss.
    vals = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert best == f"step-{min(vals, key=vals.get):06d}"
    # The checkpoint loads as a model whose held-out loss is the one logged.
    model, tok = load(reference)
    assert tok is not None and model.config.vocab_size == tok.vocab_size


def test_sigint_then_resume_is_bitwise_identical(data, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    # SIGINT arrives during step 6; the loop finishes the step, saves step-000006 and exits 130.
    inject(monkeypatch, 6, lambda loss: (os.kill(os.getpid(), signal.SIGINT), loss)[1])
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 130
    assert read_pointer(out, "latest") == "step-000006"
    assert "SIGINT" in capsys.readouterr().err
    monkeypatch.undo()
    # Resume with the flag alone: the run's saved settings are used.
    assert main(["train", "--data", str(data), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert losses(out) == losses(reference)  # bitwise: same floats, not approximately
    assert_same_weights(out / "step-000012", reference / "step-000012")


def test_resume_without_checkpoint_starts_fresh(data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--max-steps", "2", "--resume"]) == 0
    assert "starting fresh" in capsys.readouterr().err
    assert read_pointer(out, "latest") == "step-000002"


def test_nan_stops_before_the_update(data, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    inject(monkeypatch, 7, lambda loss: loss * float("nan"))
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "step-000004" in err
    assert read_pointer(out, "latest") == "step-000004"
    assert [p.name for p in complete_checkpoints(out)] == ["step-000004"]
    assert_same_weights(out / "step-000004", reference / "step-000004")


def test_skip_nonfinite_skips_the_step(data, reference, tmp_path, monkeypatch):
    out = tmp_path / "run"
    inject(monkeypatch, 7, lambda loss: loss * float("nan"))
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--skip-nonfinite"]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert rows[6]["step"] == 7 and rows[6].get("skipped") and math.isnan(rows[6]["loss"])
    assert losses(out)[:6] == losses(reference)[:6]
    assert read_pointer(out, "latest") == "step-000012"


def test_failed_write_leaves_no_partial_checkpoint(data, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    out = tmp_path / "run"
    real, calls = safetensors.torch.save_file, {"n": 0}

    def full_disk(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] == 4:  # the second checkpoint's train_state.safetensors
            Path(filename).write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 2
    err = capsys.readouterr().err
    assert "the disk filled while writing" in err and "No space left" in err and "step-000004 is intact" in err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step-000004"]  # no temporary folder left
    assert read_pointer(out, "latest") == "step-000004"
    load(out)


KILL_SCRIPT = """
import os, signal, sys
import safetensors.torch as st
real, n = st.save_file, [0]
def dying(tensors, filename, metadata=None):
    n[0] += 1
    if n[0] == 4:  # in the middle of the second checkpoint: model written, train state half written
        open(filename, "wb").write(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, filename, metadata=metadata)
st.save_file = dying
from glassformer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_during_save_then_resume(data, reference, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, "train", "--data", str(data), "--out", str(out), *ARGS],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert read_pointer(out, "latest") == "step-000004"
    assert any(".tmp-" in p.name for p in out.iterdir())  # the killed write's leftovers
    load(out)  # the previous checkpoint is loadable
    assert main(["train", "--data", str(data), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert not any(".tmp-" in p.name for p in out.iterdir())
    assert losses(out) == losses(reference)
    assert_same_weights(out / "step-000012", reference / "step-000012")


def test_gradient_accumulation_matches_the_whole_batch(data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*ARGS, "--max-steps", "5", "--dropout", "0", "--eval-every", "0"]
    assert main(["train", "--data", str(data), "--out", str(a), *common]) == 0
    assert main(["train", "--data", str(data), "--out", str(b), *common, "--micro-batch", "1"]) == 0
    assert losses(a) == pytest.approx(losses(b), rel=1e-5, abs=1e-6)


def test_time_budget_fixes_and_records_the_schedule(data, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--time-budget", "4",
                 "--calibrate-steps", "2", "--eval-every", "0"]) == 0
    state = json.loads((out / read_pointer(out, "latest") / "train_state.json").read_text())
    plan = state["time_budget_plan"]
    assert plan["total_steps"] == state["total_steps"] == state["step"] == len(losses(out))
    assert plan["calibrated_at"] == 3  # one warm-up step + 2 timed steps, within the 3 warm-up steps
    # The learning rate followed the fixed schedule from the first step.
    from glassformer.train.optim import lr_at

    lrs = [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r]
    cfg = TrainConfig()  # the defaults: this run passes no rate or schedule
    assert lrs == [lr_at(s, cfg.lr, cfg.min_lr, 3, state["total_steps"], cfg.schedule, cfg.decay_frac)
                   for s in range(len(lrs))]


def test_time_budget_counts_a_real_evaluation_and_checkpoint(data, tmp_path, monkeypatch):
    """The plan's cost of an evaluation is measured (here: a slow disk), not guessed from a forward."""
    import time

    import glassformer.train.loop as train_mod
    from glassformer.train.loop import plan_steps

    real_save = train_mod.save_training

    def slow_save(*a, **k):
        time.sleep(0.4)
        return real_save(*a, **k)

    monkeypatch.setattr(train_mod, "save_training", slow_save)
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--time-budget", "8",
                 "--calibrate-steps", "2", "--eval-every", "5"]) == 0
    state = json.loads((out / read_pointer(out, "latest") / "train_state.json").read_text())
    plan = state["time_budget_plan"]
    assert plan["sec_per_eval"] >= 0.4
    more = plan_steps(8 - plan["spent"], plan["sec_per_step"], 5, plan["sec_per_eval"])
    assert plan["calibrated_total_steps"] == plan["calibrated_at"] + more
    evals = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r]
    assert evals[0] == plan["calibrated_at"]  # the timed evaluation is a point of the curve too


@pytest.mark.parametrize("follow", [True, False])
def test_time_budget_follows_the_clock_until_the_decay(data, tmp_path, monkeypatch, follow):
    """Steps that slow down after the calibration: re-planned from their measured speed, the count
    falls and the run ends near its budget; every step's rate is the final count's wsd schedule,
    so the steps taken before a re-plan were at the full rate under the new count too. With
    --no-follow-clock the calibration's count stays. The planner reads a virtual clock that only
    the steps move (20 ms each, 80 ms after the calibration's), so the counts don't depend on how
    fast this machine runs a tiny step."""
    import types

    import glassformer.train.loop as train_mod
    import glassformer.train.setup as setup_mod
    from glassformer.train.optim import decay_start, lr_at

    real_step, calls, clock = train_mod.train_step, [], [0.0]

    def slowing(*a, **k):
        calls.append(1)
        clock[0] += 0.02 if len(calls) <= 4 else 0.08  # 4x slower after the calibration's steps
        return real_step(*a, **k)

    virtual = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(train_mod, "time", virtual)
    monkeypatch.setattr(setup_mod, "time", virtual)
    monkeypatch.setattr(train_mod, "train_step", slowing)
    monkeypatch.setattr(train_mod, "REPLAN_EVERY", 5)
    out = tmp_path / "run"
    flags = [] if follow else ["--no-follow-clock"]
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--time-budget", "4", "--dropout", "0",
                 "--calibrate-steps", "2", "--eval-every", "0", *flags]) == 0
    state = json.loads((out / read_pointer(out, "latest") / "train_state.json").read_text())
    plan, total = state["time_budget_plan"], state["total_steps"]
    assert plan["total_steps"] == total == state["step"] == len(losses(out))
    if not follow:
        assert total == plan["calibrated_total_steps"] and "replans" not in plan
        return
    assert total < plan["calibrated_total_steps"] / 2  # the calibration's fast steps promised far more
    assert 0.9 * 4 <= clock[0] <= 4  # the run ends near its budget, not past it
    assert plan["replans"][-1][1] == total and all(s % 5 == 0 for s, _, _ in plan["replans"])
    # Fixed once the next step decays; no re-plan after that.
    assert plan["decay_from"] == decay_start(3, total, TrainConfig().decay_frac) + 1
    assert all(s <= plan["decay_from"] for s, _, _ in plan["replans"])
    lrs = [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r]
    cfg = TrainConfig()
    assert lrs == [lr_at(s, cfg.lr, cfg.min_lr, 3, total, "wsd", cfg.decay_frac) for s in range(total)]


def test_least_total_keeps_the_steps_taken_at_the_full_rate():
    from glassformer.train.optim import decay_start
    from glassformer.train.runstate import least_total

    for warmup in (0, 3, 20):
        for frac in (0.1, 0.4, 0.9):
            for done in range(warmup + 2, 600, 7):
                t = least_total(done, warmup, frac)
                assert decay_start(warmup, t, frac) >= done - 1 > decay_start(warmup, t - 1, frac)


def test_train_help_comes_from_the_field_docs():
    from glassformer.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "Sequences per optimizer step, over all processes together" in text
    assert "--time-budget" in text and "--skip-nonfinite" in text and "--init-from" in text


def test_every_verbs_help_names_each_default_once_and_none_unset():
    """The help formatter adds "(default: X)" only where the help does not already say it and
    X means something: no "(default: None)", no flag with two defaults."""
    from glassformer.cli import VERBS, build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices
    assert set(verbs) == set(VERBS)
    for verb, parser in verbs.items():
        for action in parser._actions:
            text = " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
            assert "(default: None)" not in text and "(default: False)" not in text, (verb, text)
            assert text.count("(default:") <= 1, (verb, text)
    text = " ".join(verbs["generate"].format_help().split())
    assert "(default: 200)" in text and "attention kernel (default: the checkpoint's)" in text


def test_config_file_and_flags(data, tmp_path):
    from argparse import Namespace

    from glassformer.commands.train import resolve_config

    (tmp_path / "c.toml").write_text('max_steps = 3\nlr = 0.01\n')
    cfg = resolve_config(Namespace(config=str(tmp_path / "c.toml"), lr=0.02, data=str(data)))
    assert (cfg.max_steps, cfg.lr, cfg.data) == (3, 0.02, str(data))
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "r"), "--batch-size", "0"]) == 2


def test_a_run_saved_before_a_default_changed_resumes_as_it_ran(data, tmp_path):
    """A run whose saved settings predate `sampling` drew its batches at random: resuming it (and
    explaining its steps) keeps that, where a new run gets today's default."""
    from argparse import Namespace

    from glassformer.commands.train import resolve_config

    out = tmp_path / "r"
    assert main(["train", "--data", str(data), "--out", str(out), "--max-steps", "2", "--eval-every", "0",
                 "--no-progress"]) == 0
    state_file = next(out.glob("step-*")) / "train_state.json"
    state = json.loads(state_file.read_text())
    assert state["config"]["sampling"] == "epochs" == TrainConfig().sampling
    del state["config"]["sampling"]  # as an older glassformer saved it
    state_file.write_text(json.dumps(state))
    assert resolve_config(Namespace(resume=True, out=str(out), data=str(data))).sampling == "random"
    assert resolve_config(Namespace(resume=True, out=str(out), data=str(data), sampling="epochs")).sampling == "epochs"
    assert resolve_config(Namespace(out=str(tmp_path / "new"), data=str(data))).sampling == "epochs"
    assert TrainConfig.from_saved({}).sampling == "random" and TrainConfig.from_dict({}).sampling == "epochs"
    with pytest.raises(ValueError, match="sampling must be epochs or random"):
        TrainConfig(sampling="shuffled")


# ----------------------------------------------------------------------------- schedule, optimizer, FLOPs


def test_lr_schedule_formula():
    from glassformer.train.optim import lr_at

    assert [lr_at(s, 1.0, 0.1, 4, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(19, 1.0, 0.1, 4, 20) == pytest.approx(0.1)
    mid = 4 + (19 - 4) / 2
    assert lr_at(int(mid), 1.0, 0.1, 4, 20) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 4) / 15)))


def test_weight_decay_only_on_matrices():
    from glassformer import ModelConfig, Transformer
    from glassformer.train.optim import make_optimizer

    model = Transformer(ModelConfig.from_preset("tiny", tie_embeddings=True))
    opt = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_flops_per_token_matches_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from glassformer import ModelConfig, Transformer
    from glassformer.train.metrics import flops_per_token

    cfg = ModelConfig.from_preset("tiny", attention="naive", n_kv_heads=2)
    model = Transformer(cfg)
    B, T = 2, 48
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as fc:
        _, loss = model(x, x)
        loss.backward()
    assert fc.get_total_flops() == pytest.approx(flops_per_token(cfg, T) * B * T, rel=1e-9)


def test_compiled_training_follows_the_eager_losses(data, tmp_path):
    """--compile: inductor's fused loops round differently, so the losses agree closely, not bitwise."""
    from torch._dynamo.utils import counters

    args = ["--preset", "tiny", "--max-steps", "6", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0",
            "--log-every", "1", "--warmup-steps", "2", "--no-progress", "--seed", "3", "--threads", "1"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert main(["train", "--data", str(data), "--out", str(eager), *args]) == 0
    counters.clear()
    assert main(["train", "--data", str(data), "--out", str(compiled), *args, "--compile"]) == 0
    assert counters["frames"]["ok"] >= 1 and not counters["graph_break"]  # it did compile, in one piece
    a, b = losses(eager), losses(compiled)
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4 * max(a)
