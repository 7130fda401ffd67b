"""The bottom of the package: writing folders and files so a crash never leaves half of one,
reading the JSON files users hand us, and where the project caches things. Imports nothing
of glassformer but errors."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from .errors import DiskFullError, UserError


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


# A write that failed for want of space: the disk is full, or the user's quota is spent.
DISK_FULL = tuple(n for n in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if n is not None)


def disk_full(e: BaseException) -> int | None:
    """The errno (ENOSPC or EDQUOT) of a write that failed for want of space, else None: an OSError's
    own (a DiskFullError carries one too), or the one named in the words of a writer that keeps only
    those (safetensors' save_file raises "I/O error: No space left on device (os error 28)", not an OSError)."""
    if isinstance(e, OSError):
        return e.errno if e.errno in DISK_FULL else None
    return next((n for n in DISK_FULL if f"(os error {n})" in str(e)), None)


def free_bytes(folder: Path) -> int:
    """Bytes free to this user on the disk that holds folder."""
    return shutil.disk_usage(folder).free


def _no_space(dst: Path, need: int | None, free: int, code: int | None = None) -> DiskFullError:
    """The one line for a folder the disk cannot hold: where, how many bytes, and that nothing was lost.
    code: the errno of a write that failed (None: refused before writing). need counts the tensors
    alone (their files' headers and the small files come on top)."""
    kept = f"; {dst} is as it was" if dst.exists() else ""
    if code is None:
        what = (f"not enough space on the disk for {dst}: its tensors alone take {need:,} bytes, {free:,} are free; "
                "nothing was written")
    else:
        tensors = f" (its tensors alone take {need:,})" if need is not None else ""
        what = (f"the disk filled while writing {dst} ({os.strerror(code)}): it needs more than the {free:,} bytes "
                f"free{tensors}; the partial folder was removed")
    error = DiskFullError(f"{what}{kept}: free some space or write it elsewhere")
    error.errno = code or errno.ENOSPC
    return error


def atomic_folder(dst: str | Path, write: Callable[[Path], None], need: int | None = None) -> Path:
    """Run write(tmp) on a fresh temporary sibling of dst, fsync it, write COMPLETE, rename to dst.

    If anything fails, the temporary folder is removed and an existing dst is untouched. need: about
    how many bytes write puts there, refused before anything is written when the disk has less
    free; a disk that fills anyway is a UserError naming dst and the bytes, not the writer's error.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if need is not None and need > free_bytes(dst.parent):
        raise _no_space(dst, need, free_bytes(dst.parent))
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync_files(tmp)
        _swap_in(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        code = disk_full(e)  # a DiskFullError from a folder written inside this one: said again, naming this one
        if code:
            raise _no_space(dst, need, free_bytes(dst.parent), code) from None
        raise
    return dst


def atomic_text(path: str | Path, text: str) -> None:
    """Replace the file at path with text in one rename (after fsync): readers see the old or the new.
    A full disk leaves the old file and no temporary one, and is a UserError naming the file."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        code = disk_full(e)
        if code:
            error = DiskFullError(f"the disk filled while writing {path} ({os.strerror(code)}, "
                                  f"{free_bytes(path.parent):,} bytes free); it is as it was: free some space and run again")
            error.errno = code
            raise error from None
        raise
    fsync_dir(path.parent)


def read_json(path: str | Path, hint: str = ""):
    """The JSON in a user-given file; a UserError naming the file if it does not parse."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}){hint}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text, so not JSON (byte {e.object[e.start]:#04x} at offset {e.start}){hint}") from None
