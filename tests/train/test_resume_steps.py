"""--resume with a larger --max-steps continues to it (docs/training.md's first example), and with
the same one repeats the uninterrupted run."""

from __future__ import annotations

import json

from glassformer.cli import main

from ..support import make_token_stream


def _steps(run) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_resume_runs_to_a_larger_max_steps(tmp_path):
    data = make_token_stream(tmp_path / "data")
    common = ["train", "--data", str(data), "--preset", "tiny", "--batch-size", "4", "--seq-len", "32",
              "--eval-every", "5", "--threads", "1", "--log-every", "1"]
    assert main(common + ["--out", str(tmp_path / "a"), "--max-steps", "10"]) == 0
    assert main(common + ["--out", str(tmp_path / "a"), "--resume", "--max-steps", "14"]) == 0
    assert max(_steps(tmp_path / "a")) == 14 and (tmp_path / "a" / "step-000014").is_dir()
    assert main(common + ["--out", str(tmp_path / "a"), "--resume", "--max-steps", "14"]) == 0  # nothing left to do
    assert max(_steps(tmp_path / "a")) == 14


def test_a_fresh_run_into_a_run_folder_is_refused_and_loses_nothing(tmp_path, capsys):
    data = make_token_stream(tmp_path / "data")
    common = ["train", "--data", str(data), "--preset", "tiny", "--batch-size", "4", "--seq-len", "32",
              "--eval-every", "5", "--threads", "1", "--out", str(tmp_path / "a")]
    assert main(common + ["--max-steps", "5"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    capsys.readouterr()
    assert main(common + ["--max-steps", "3"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run (step-000005)" in err[0] and "--resume" in err[0]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == before  # nothing touched
