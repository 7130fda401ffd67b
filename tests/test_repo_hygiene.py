"""The folders the docs tell users to write into stay out of git, and the tests' own data stays in."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .support import REPO


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs the git checkout")
def test_the_docs_output_folders_are_ignored_and_test_data_is_not():
    # docs/data.md and docs/chat.md: `glassformer prepare --out data/...`, `train --out runs/...`
    assert _ignored("data/shakespeare/train.bin")
    assert _ignored("runs/tiny/model.safetensors")
    assert not _ignored("tests/data/worked_example.json")
