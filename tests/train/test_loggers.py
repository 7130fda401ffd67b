"""--log sinks: TensorBoard's event files, read back by tensorboard's own reader, hold the values
metrics.jsonl holds under the same keys; wandb (when installed) in offline mode; bad values refused."""

from __future__ import annotations

import importlib.util

import pytest

from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.train.loggers import check_specs, flatten, parse_spec
from glassformer.train.metrics import read_metrics

from ..support import data  # noqa: F401  (a fixture)

ARGS = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "2", "--no-progress", "--seed", "2",
        "--threads", "1", "--stats-every", "2"]


def jsonl_values(run) -> dict[str, dict[int, float]]:
    """metrics.jsonl as tag -> {step: value}, flattened as the sinks flatten it."""
    out: dict[str, dict[int, float]] = {}
    for rec in read_metrics(run / "metrics.jsonl"):
        for key, v in flatten(rec).items():
            out.setdefault(key, {})[rec["step"]] = v
    return out


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="the tensorboard extra is not installed")
def test_tensorboard_events_hold_the_jsonl_values(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "tensorboard"]) == 0
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    want = jsonl_values(out)
    for key in ("loss", "lr", "grad_norm", "val_loss", "val_bpb", "stats/grad_norm/blocks.1.ffn.w_down.weight",
                "stats/update_rms_ratio/embed.weight", "stats/stream_rms/blocks.0.resid_out",
                "stats/attn_entropy/blocks.1.attn/0"):
        assert key in want, key
    assert set(acc.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        assert got == pytest.approx(by_step, rel=1e-6), tag  # the events hold float32


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed")
def test_wandb_offline_run(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "wandb:glassformer-test"]) == 0
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))


def test_bad_values_are_refused():
    assert parse_spec("tensorboard:logs/tb") == ("tensorboard", "logs/tb")
    for bad in ("tensorbord", "wandb:", "csv:x"):
        with pytest.raises(UserError, match="--log"):
            parse_spec(bad)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_missing_package_names_its_extra(data, tmp_path, capsys):
    with pytest.raises(UserError, match=r"glassformer\[wandb\]"):
        check_specs(["wandb"])
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "wandb"]) == 2
    assert "glassformer[wandb]" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()  # refused before the run wrote anything
