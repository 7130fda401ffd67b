"""The progress bar is drawn onto a terminal only: redirected into a file, train prints step lines."""

from __future__ import annotations

import io

from glassformer.cli import main
from glassformer.train.setup import bar_shown

from ..support import data  # noqa: F401  (a fixture)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_needs_a_terminal_the_main_process_and_progress():
    assert bar_shown(True, True, _Terminal())
    assert not bar_shown(True, True, io.StringIO())  # a redirected stderr
    assert not bar_shown(False, True, _Terminal())  # another rank
    assert not bar_shown(True, False, _Terminal())  # --no-progress
    assert not bar_shown(True, True, object())  # a stream that cannot say


def test_train_into_a_file_writes_step_lines_not_a_bar(data, tmp_path, capsys):
    # No --no-progress: stderr is pytest's capture, not a terminal, as in `train ... 2> log.txt`.
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "tiny", "--max-steps", "2",
                 "--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--eval-every", "0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "step/s" not in err and "it/s" not in err
    assert "step 1: loss" in err and "step 2: loss" in err
