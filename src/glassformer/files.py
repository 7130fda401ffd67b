"""The bottom of the package: writing folders and files so a crash never leaves half of one,
reading the JSON files users hand us, and where the project caches things. Imports nothing
of glassformer but errors."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from .errors import UserError


def cache_dir() -> Path:
    """The project's one cache folder (the default corpus, built kernels): GLASSFORMER_CACHE, else ~/.cache/glassformer."""
    return Path(os.environ.get("GLASSFORMER_CACHE") or Path.home() / ".cache" / "glassformer")


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_files(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(folder)


def _swap_in(tmp: Path, dst: Path) -> None:
    """Rename tmp to dst; an existing dst is moved aside first, so dst is never half-written."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        dst.rename(old)
        tmp.rename(dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(dst)
    fsync_dir(dst.parent)


def atomic_folder(dst: str | Path, write: Callable[[Path], None]) -> Path:
    """Run write(tmp) on a fresh temporary sibling of dst, fsync it, write COMPLETE, rename to dst.

    If anything fails, the temporary folder is removed and an existing dst is untouched.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync_files(tmp)
        _swap_in(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def atomic_text(path: str | Path, text: str) -> None:
    """Replace the file at path with text in one rename (after fsync): readers see the old or the new."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: str | Path, hint: str = ""):
    """The JSON in a user-given file; a UserError naming the file if it does not parse."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}){hint}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text, so not JSON (byte {e.object[e.start]:#04x} at offset {e.start}){hint}") from None
