"""Regenerate tests/golden/tiny_loss_100.json: the 100-step loss trajectory of the `tiny` preset.

Run this ONLY when a change to the numbers is intended (a new init, a schedule change, a
new PyTorch), and say why in the commit:

    PYTHONPATH=src python scripts/regen_golden.py

The test (tests/train/test_train_golden.py) replays the recorded arguments and compares every
step's loss with rtol 1e-5.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "tiny_loss_100.json"
ARGS = ["--preset", "tiny", "--max-steps", "100", "--batch-size", "4", "--seq-len", "32", "--warmup-steps", "10",
        "--lr", "0.003", "--min-lr", "0.0003", "--dropout", "0.1", "--eval-every", "0", "--eval-tokens", "256",
        "--log-every", "1", "--seed", "1234", "--threads", "1", "--no-progress"]


def trajectory(workdir: Path, args: list[str]) -> list[float]:
    sys.path.insert(0, str(REPO))
    import torch

    from glassformer.cli import main
    from glassformer.train.metrics import read_metrics
    from tests.support import make_token_stream

    data = make_token_stream(workdir / "data")
    out = workdir / "run"
    if main(["train", "--data", str(data), "--out", str(out), *args]) != 0:
        raise SystemExit("training failed")
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def main() -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        losses = trajectory(Path(tmp), ARGS)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({
        "about": "100-step loss trajectory of the tiny preset; regenerate only with scripts/regen_golden.py",
        "torch": torch.__version__, "python": platform.python_version(), "args": ARGS, "losses": losses,
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {len(losses)} losses, first {losses[0]:.6f}, last {losses[-1]:.6f}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "src"))
    main()
