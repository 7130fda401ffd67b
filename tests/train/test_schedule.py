"""The learning-rate schedule (train/optim.lr_at): warm-up, then cosine or warm-up–stable–decay,
each step's rate against the formula written out directly; the rates a run logs are the schedule's."""

from __future__ import annotations

import math

import pytest

from glassformer.cli import main
from glassformer.config import TrainConfig
from glassformer.train.metrics import read_metrics
from glassformer.train.optim import decay_start, lr_at

from ..support import data  # noqa: F401  (a fixture)

LR, MIN_LR, WARMUP, TOTAL = 3e-3, 3e-4, 10, 100


def cosine(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    t = (step - WARMUP) / (TOTAL - 1 - WARMUP)
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * t)) / 2


def wsd(step: int, frac: float) -> float:
    """Written from the definition: the last frac·TOTAL steps fall on a straight line to MIN_LR at step TOTAL-1."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    last_full = max(WARMUP, TOTAL - 1 - round(frac * TOTAL))
    if step <= last_full:
        return LR
    return LR - (LR - MIN_LR) * (step - last_full) / (TOTAL - 1 - last_full)


def test_cosine_is_the_default_and_matches_its_formula():
    got = [lr_at(s, LR, MIN_LR, WARMUP, TOTAL) for s in range(TOTAL)]
    assert got == pytest.approx([cosine(s) for s in range(TOTAL)], rel=1e-12)
    assert got[WARMUP - 1] == LR and got[-1] == pytest.approx(MIN_LR)


@pytest.mark.parametrize("frac", [0.2, 0.4, 0.5, 1.0])
def test_wsd_matches_its_formula(frac):
    got = [lr_at(s, LR, MIN_LR, WARMUP, TOTAL, "wsd", frac) for s in range(TOTAL)]
    assert got == pytest.approx([wsd(s, frac) for s in range(TOTAL)], rel=1e-12)
    decaying = [s for s in range(TOTAL) if got[s] < LR and s >= WARMUP]
    assert len(decaying) == min(TOTAL - WARMUP - 1, round(frac * TOTAL))  # the last frac of the steps
    assert got[-1] == pytest.approx(MIN_LR)
    assert all(a >= b for a, b in zip(got[WARMUP:], got[WARMUP + 1:]))  # never rises after the warm-up


def test_wsd_to_zero_and_before_the_step_count_is_known():
    assert lr_at(TOTAL - 1, LR, 0.0, WARMUP, TOTAL, "wsd", 0.5) == 0.0
    # Under --time-budget the total is unknown (10**9) until calibrated: the stable phase does not depend on it.
    assert lr_at(WARMUP + 5, LR, 0.0, WARMUP, 10**9, "wsd", 0.5) == LR
    assert decay_start(WARMUP, TOTAL, 0.95) == WARMUP  # never decays inside the warm-up


def test_schedule_settings_are_checked():
    with pytest.raises(ValueError, match="schedule must be cosine or wsd"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="decay_frac"):
        TrainConfig(decay_frac=0.0)


def test_a_run_logs_the_schedules_rates(data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--preset", "tiny", "--max-steps", "12",
                 "--batch-size", "2", "--seq-len", "16", "--warmup-steps", "2", "--schedule", "wsd",
                 "--decay-frac", "0.5", "--lr", "0.01", "--min-lr", "0", "--eval-every", "0",
                 "--eval-tokens", "64", "--log-every", "1", "--threads", "1", "--no-progress"]) == 0
    logged = {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r}
    assert logged == {s + 1: pytest.approx(lr_at(s, 0.01, 0.0, 2, 12, "wsd", 0.5)) for s in range(12)}
    assert logged[6] == 0.01 and logged[7] < 0.01 and logged[12] == 0.0
