"""Keep freed memory in the process while a CPU job runs, so each step does not fault it in again.

glibc's malloc maps every large block on its own and unmaps it on free, so each step would
fault its activations, logits and gradients in afresh; inside keep_freed_memory() malloc serves
them from its heap and keeps what is freed there. Without glibc (macOS, musl) it does nothing.
Why and what it holds: docs/training.md#freed-memory-kept-between-steps-cpu (bench/cpu_memory.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import platform

# mallopt's parameter numbers (malloc.h) and glibc's defaults for them
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
_depth = 0  # contexts open now (one process, one allocator)


@functools.cache
def _glibc():
    """The process's glibc (for mallopt and malloc_trim), or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def available() -> bool:
    """Whether keep_freed_memory() has an effect here (Linux with glibc)."""
    return _glibc() is not None


@contextlib.contextmanager
def keep_freed_memory(enabled: bool = True):
    """Inside: no block is served by its own mapping, and free memory is never trimmed.

    The settings are process-wide, as the allocator is; they return to glibc's defaults on
    exit (a fixed mmap threshold from then on rather than its self-adjusting one).
    """
    global _depth
    libc = _glibc() if enabled else None
    if libc is None:
        yield False
        return
    if _depth == 0:
        libc.mallopt(M_MMAP_MAX, 0)  # every block from the heap, none from a mapping of its own
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # never hand the heap's free top back
    _depth += 1
    try:
        yield True
    finally:
        _depth -= 1
        if _depth == 0:  # the outermost context restores (a nested one, e.g. eval inside a job, does not)
            libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
            libc.malloc_trim(0)  # return what the job kept
