"""Keeping freed CPU memory between training steps: no page faults for re-used blocks, same numbers."""

from __future__ import annotations

import ctypes
import resource

import pytest
import torch

from glassformer.cli import main
from glassformer.cpu_memory import available, keep_freed_memory

from .test_train import inject, losses
from .train_fixtures import data  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(not available(), reason="needs Linux with glibc's malloc")

BLOCK = 16 << 20  # floats: a 64 MB block, far above malloc's mmap threshold


def faults_of_reuse() -> int:
    """Minor page faults taken by allocating, touching and freeing a 64 MB block three more times."""
    torch.ones(BLOCK).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.ones(BLOCK).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_kept_memory_is_reused_without_faults_and_the_defaults_come_back():
    pages = 3 * BLOCK * 4 // 4096
    assert faults_of_reuse() > pages // 2  # glibc's default: a fresh mapping each time, every page faulted in
    with keep_freed_memory() as on:
        assert on
        assert faults_of_reuse() < 100
    assert faults_of_reuse() > pages // 2  # defaults restored on leaving
    with keep_freed_memory(enabled=False) as on:
        assert not on and faults_of_reuse() > pages // 2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def own_mappings_for_a_block() -> int:
    """How many blocks malloc serves with a mapping of their own while a 64 MB tensor lives, beyond before."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    before = libc.mallinfo2().hblks
    block = torch.ones(BLOCK)
    during = libc.mallinfo2().hblks
    del block
    return during - before


def test_training_keeps_freed_memory_unless_told_not_to(data, tmp_path, monkeypatch):  # noqa: F811
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")
    seen = []

    def probe(loss):  # inside the loop, on each run's second forward
        seen.append(own_mappings_for_a_block())
        return loss

    def run(name, *flag):
        inject(monkeypatch, 2, probe)
        assert main(["train", "--data", str(data), "--out", str(tmp_path / name), "--preset", "tiny", "--max-steps", "3",
                     "--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--no-progress", "--threads", "1",
                     *flag]) == 0
        return losses(tmp_path / name)

    kept, default = run("kept"), run("default", "--no-keep-freed-memory")
    assert seen == [0, 1]  # from the heap while training; a mapping of its own with the allocator's defaults
    assert own_mappings_for_a_block() == 1  # and the defaults are back after a run
    assert kept == default  # the allocator's setting changes no number
