"""Guard against silent changes: the tiny preset's 100-step loss trajectory, step by step (rtol 1e-5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ..support import REPO

GOLDEN = json.loads((REPO / "tests" / "golden" / "tiny_loss_100.json").read_text())


def test_golden_trajectory(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from regen_golden import trajectory
    finally:
        sys.path.pop(0)
    losses = trajectory(tmp_path, GOLDEN["args"])
    assert len(losses) == len(GOLDEN["losses"]) == 100
    why = (f"the loss trajectory moved (golden recorded with torch {GOLDEN['torch']}, now {torch.__version__}); "
           "if the change is intended, run scripts/regen_golden.py and say why in the commit")
    assert losses == pytest.approx(GOLDEN["losses"], rel=1e-5), why
    assert losses[-1] < losses[0] - 1.0  # and it learns: the trajectory is not flat noise
