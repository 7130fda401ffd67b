"""A recorder sees the forwards of the thread that installed it only (probes.set_recorder): what
it records while another thread runs the same model equals what it records alone."""

from __future__ import annotations

import threading

import torch

from glassformer import probes

from ..support import tiny_model

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


class Keep:
    """Keeps a copy of every probe shown to it, in order (wants everything)."""

    def __init__(self):
        self.seen: list[tuple[str, torch.Tensor]] = []

    def __call__(self, name, x):
        self.seen.append((name, x.detach().clone()))
        return x

    def wants(self, name):
        return True


def record(model) -> list[tuple[str, torch.Tensor]]:
    rec = Keep()
    old = probes.set_recorder(rec)
    try:
        with torch.no_grad():
            model(torch.tensor([IDS]))
    finally:
        assert probes.set_recorder(old) is rec
    return rec.seen


def test_a_recorder_sees_its_own_threads_forwards_only():
    model = tiny_model().eval()
    alone = record(model)
    stop, seen_active = threading.Event(), []

    def busy():  # another thread running the same model (other ids, other length) all along
        with torch.no_grad():
            while not stop.is_set():
                model(torch.tensor([[7] * 11]))
                seen_active.append(probes.active())

    other = threading.Thread(target=busy)
    other.start()
    try:
        while not seen_active:
            pass
        crowded = [record(model) for _ in range(5)]
    finally:
        stop.set()
        other.join()
    assert len(seen_active) > 1 and not any(seen_active)  # the other thread never had a recorder
    assert alone and [n for n, _ in alone].count("embed") == 1  # one forward's probes
    for got in crowded:
        assert [n for n, _ in got] == [n for n, _ in alone]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, alone))
    assert not probes.active()
