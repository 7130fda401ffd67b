"""files.py, the bottom helpers: atomic folders and files, a user's JSON, the cache folder."""

from __future__ import annotations

import pytest

from glassformer.errors import UserError
from glassformer.files import atomic_folder, atomic_text, cache_dir, read_json


def test_atomic_folder_replaces_whole_or_not_at_all(tmp_path):
    dst = tmp_path / "out"
    atomic_folder(dst, lambda tmp: (tmp / "a.txt").write_text("one"))
    assert sorted(p.name for p in dst.iterdir()) == ["COMPLETE", "a.txt"]

    def fails(tmp):
        (tmp / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_folder(dst, fails)
    assert (dst / "a.txt").read_text() == "one"  # the old folder is untouched
    atomic_folder(dst, lambda tmp: (tmp / "b.txt").write_text("two"))
    assert sorted(p.name for p in dst.iterdir()) == ["COMPLETE", "b.txt"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left


def test_atomic_text_and_read_json(tmp_path):
    path = tmp_path / "x.json"
    atomic_text(path, '{"a": 1}')
    atomic_text(path, '{"a": 2}')
    assert read_json(path) == {"a": 2} and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
    path.write_text("{oops")
    with pytest.raises(UserError, match=r"x.json is not valid JSON .*; fix it"):
        read_json(path, "; fix it")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSFORMER_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("GLASSFORMER_CACHE")
    assert cache_dir().parts[-2:] == (".cache", "glassformer")
