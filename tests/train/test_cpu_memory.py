"""Keeping freed CPU memory between training steps: no page faults for re-used blocks, same numbers."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
import torch

from glassformer.cli import main
from glassformer.train.cpu_memory import available

from .test_train import inject, losses
from ..support import data  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not available() or not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"),
                                reason="needs Linux with glibc 2.33+ (malloc's own counters)")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _mallinfo() -> _MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


def own_mappings_for_a_new_block() -> int:
    """Blocks that malloc serves with a mapping of their own, counted while one tensor lives that is
    larger than all the free memory the heap holds (so no free block can serve it; never touched)."""
    before = _mallinfo()
    block = torch.empty(before.fordblks // 4 + (16 << 20))  # floats: the heap's free bytes + 64 MB
    during = _mallinfo().hblks
    del block
    return during - before.hblks


# In a fresh interpreter, so that no earlier test has left free blocks in the heap that would
# serve the allocator's defaults too: page faults taken by allocating, touching and freeing a
# 64 MB block three more times, with the defaults, then inside keep_freed_memory().
FAULTS = """
import json, resource, torch
from glassformer.train.cpu_memory import keep_freed_memory

def faults_of_reuse():
    torch.ones(16 << 20).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.ones(16 << 20).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_reuse()
with keep_freed_memory() as on:
    with keep_freed_memory():  # a nested context leaves the setting to the outer one
        pass
    # the least of three tries: where a short-lived allocation lands beside a freed block can
    # make the heap grow once more before blocks are reused (it depends on what was imported)
    kept = min(faults_of_reuse() for _ in range(3))
with keep_freed_memory(enabled=False) as off:
    pass
print(json.dumps({"default": default, "kept": kept, "on": on, "off": off}))
"""


def test_kept_memory_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True).stdout
    r = json.loads(out.splitlines()[-1])
    pages = 3 * (64 << 20) // 4096
    assert r["default"] > pages // 2  # a fresh mapping each time: every page faulted in again
    assert r["kept"] < 100 and r["on"] and not r["off"]


def test_training_keeps_freed_memory_unless_told_not_to(data, tmp_path, monkeypatch):  # noqa: F811
    seen = []

    def probe(loss):  # inside the loop, on each run's second forward
        seen.append(own_mappings_for_a_new_block())
        return loss

    def run(name, *flag):
        inject(monkeypatch, 2, probe)
        assert main(["train", "--data", str(data), "--out", str(tmp_path / name), "--preset", "tiny", "--max-steps", "3",
                     "--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--no-progress", "--threads", "1",
                     *flag]) == 0
        return losses(tmp_path / name)

    kept, default = run("kept"), run("default", "--no-keep-freed-memory")
    assert seen == [0, 1]  # from the heap while training; a mapping of its own with the allocator's defaults
    assert own_mappings_for_a_new_block() == 1  # and the defaults are back after a run
    assert kept == default  # the allocator's setting changes no number
