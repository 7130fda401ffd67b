"""Keep freed memory in the process while a CPU job runs, so each step does not fault it in again.

A training step on the CPU allocates its activations, logits and gradients afresh (the
logits alone are B·T·V floats: 64 MB on the reference shape). glibc's malloc serves every
block over its mmap threshold (128 KB to 32 MB) with a new mapping and unmaps it on free,
so the next step touches brand-new pages and the kernel faults each 4 KB page in and
zeroes it: ~16,000 faults for those logits, ~120,000 a compiled step on the reference shape,
~11% of its time (~3% of an eager step's; bench/cpu_memory.py). While this context is open, malloc takes every block from its
heap and keeps freed memory there for the next step (the process holds on to its peak);
on leaving, the defaults are set again and the free memory goes back to the system.

Where the C library is not glibc (macOS, musl) this does nothing.
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
