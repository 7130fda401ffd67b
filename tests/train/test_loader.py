"""The loader: a sharded folder trains as the single-file folder of the same ids, --align-docs begins
every window at a document (each document once an epoch), a run resumes exactly at another world
size (2 processes -> 1 and 1 -> 2, gloo), and --resume refuses a data folder that changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from glassformer.checkpoint.folders import write_pointer
from glassformer.cli import main
from glassformer.text.data import check_prepared, doc_batch_starts, document_starts, get_batch, load_split
from glassformer.text.shards import ShardSet, sha256, shard_name, write_shard
from glassformer.train.metrics import read_metrics

from ..support import REPO, one_error, word_ids

VOCAB, EOT = 512, 0
ARGS = ["--preset", "tiny", "--max-steps", "8", "--batch-size", "4", "--seq-len", "32", "--eval-every", "4",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "2", "--keep-last", "5", "--no-progress",
        "--seed", "3", "--threads", "1"]


# ----------------------------------------------------------------------------- folders of made-up documents


def documents(n: int, seed: int) -> np.ndarray:
    """(n,) uint16 ids: documents of 3 to 60 ids drawn from a fixed rule (so a model can learn them),
    each followed by EOT; independent of any tokenizer."""
    rng, parts, total = np.random.default_rng(seed), [], 0
    while total < n:
        k, a = int(rng.integers(3, 61)), int(rng.integers(1, VOCAB))
        doc = (a + 7 * np.arange(k)) % (VOCAB - 1) + 1  # never EOT
        parts += [doc, [EOT]]
        total += k + 1
    return np.concatenate(parts)[:n].astype(np.uint16)


def meta_of(train: np.ndarray, val: np.ndarray) -> dict:
    return {"dtype": "uint16", "vocab_size": VOCAB, "eot_id": EOT, "train_tokens": len(train), "val_tokens": len(val),
            "train_bytes": 3 * len(train), "val_bytes": 3 * len(val), "corpus": "made-up documents"}


def single_folder(folder: Path, train: np.ndarray, val: np.ndarray) -> Path:
    """A prepared folder of one train.bin and one val.bin, as prepare wrote them before shards."""
    folder.mkdir(parents=True)
    train.tofile(folder / "train.bin")
    val.tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps(meta_of(train, val)))
    word_ids(VOCAB).save(folder / "tokenizer.json")
    return folder


def sharded_folder(folder: Path, train: np.ndarray, val: np.ndarray, cuts: dict) -> Path:
    """The same ids as shards cut at cuts[split] (positions), listed in meta.json as prepare lists them."""
    folder.mkdir(parents=True)
    meta = meta_of(train, val)
    meta["shards"] = {}
    for split, ids in (("train", train), ("val", val)):
        bounds, entries = [0, *cuts[split], len(ids)], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            write_shard(folder / shard_name(split, i), ids[a:b], "uint16")
            entries.append({"file": shard_name(split, i), "tokens": b - a, "sha256": sha256(folder / shard_name(split, i))})
        meta["shards"][split] = entries
    (folder / "meta.json").write_text(json.dumps(meta))
    word_ids(VOCAB).save(folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def ids():
    return documents(6000, 1), documents(800, 2)


@pytest.fixture(scope="module")
def folders(ids, tmp_path_factory):
    """(single-file folder, sharded folder) of the same ids; a shard of one id among the cuts."""
    root = tmp_path_factory.mktemp("loader")
    train, val = ids
    return (single_folder(root / "single", train, val),
            sharded_folder(root / "sharded", train, val, {"train": [1000, 1001, 3500], "val": [300]}))


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


# ----------------------------------------------------------------------------- shards read as one file


def test_a_sharded_folder_reads_and_batches_as_its_single_file(folders, ids):
    single, sharded = folders
    assert check_prepared(sharded)["shards"]["train"][1]["tokens"] == 1
    train = load_split(sharded, "train")
    assert isinstance(train, ShardSet) and len(train.paths) == 4
    assert (train[0:len(train)] == ids[0]).all() and (load_split(sharded, "val")[0:800] == ids[1]).all()
    flat = load_split(single, "train")
    for step in (0, 1, 57):
        for rank in range(2):
            a, b = get_batch(train, 8, 32, 5, step, rank, 2), get_batch(flat, 8, 32, 5, step, rank, 2)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_a_sharded_folder_trains_and_evaluates_as_its_single_file(folders, tmp_path, capsys):
    single, sharded = folders
    for data, out in ((single, tmp_path / "single"), (sharded, tmp_path / "sharded")):
        assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--max-steps", "4"]) == 0
    assert losses(tmp_path / "sharded") == losses(tmp_path / "single")  # bit for bit: the same batches
    scores = []
    for data in folders:  # eval --data scores the val shards as it scores val.bin
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(tmp_path / "sharded" / "step-000004"), "--data", str(data)]) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[0] == scores[1] and scores[0]["tokens"] == 799
    state = json.loads((tmp_path / "sharded" / "step-000004" / "train_state.json").read_text())
    assert state["data"]["fingerprint"]["shards"] == json.loads((sharded / "meta.json").read_text())["shards"]


@pytest.mark.parametrize("damage,names", [
    ("missing", ["train_000002.bin", "does not exist"]),
    ("magic", ["train_000002.bin", "magic"]),
    ("count", ["train_000002.bin", "lists 2500"]),
    ("id", ["train_000002.bin", "token id 600"]),
    ("list", ["meta.json", "shards.train[1]"]),
])
def test_a_bad_shard_is_one_line_before_training(damage, names, ids, tmp_path, capsys):
    data = sharded_folder(tmp_path / "d", *ids, {"train": [1000, 3500], "val": [300]})
    shard, meta = data / "train_000002.bin", json.loads((data / "meta.json").read_text())
    if damage == "missing":
        shard.unlink()
    elif damage == "magic":
        shard.write_bytes(b"\0\0\0\0" + shard.read_bytes()[4:])
    elif damage == "count":  # a shard cut short, its header rewritten to match: meta.json's count tells
        write_shard(shard, ids[0][3500:5000], "uint16")
    elif damage == "id":
        bad = ids[0][3500:].copy()
        bad[10] = 600
        write_shard(shard, bad, "uint16")
    else:
        meta["shards"]["train"][1]["file"] = "../elsewhere.bin"
        (data / "meta.json").write_text(json.dumps(meta))
    one_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "run"), *ARGS], *names)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- --align-docs


def test_document_starts_are_found_by_a_scan(ids):
    train = ids[0]
    want = [0] + [i + 1 for i in range(len(train) - 1) if train[i] == EOT]  # written out: after each EOT
    got = document_starts(train, EOT, chunk=997)  # chunks that cut documents
    assert got.dtype == np.int64 and got.tolist() == want


def test_align_docs_rows_begin_at_documents_each_once_an_epoch(folders, ids):
    train, T, B = ids[0], 32, 6
    starts = document_starts(load_split(folders[1], "train"), EOT)  # found across the shards' ends
    assert starts.tolist() == document_starts(train, EOT).tolist()
    usable = starts[starts + T + 1 <= len(train)]
    steps = len(usable) // B
    seen = np.concatenate([doc_batch_starts(starts, len(train), B, T, 9, s, "epochs").numpy() for s in range(steps)])
    assert len(set(seen.tolist())) == len(seen) == steps * B  # none twice within the epoch
    assert set(seen.tolist()) <= set(usable.tolist()) and len(usable) - len(seen) < B  # and all of them, to the last batch
    for step in (0, steps + 1):  # the second epoch: another order, the same rule
        got = doc_batch_starts(starts, len(train), B, T, 9, step, "epochs").tolist()
        x = torch.cat([get_batch(train, B, T, 9, step, r, 2, doc_starts=starts)[0] for r in range(2)])  # (B, T)
        for row, s in zip(x, got):
            assert s == 0 or train[s - 1] == EOT
            assert row.tolist() == train[s:s + T].tolist()


def test_align_docs_trains_and_refuses_data_without_documents(folders, tmp_path, capsys):
    out = tmp_path / "aligned"
    assert main(["train", "--data", str(folders[1]), "--out", str(out), *ARGS, "--max-steps", "2",
                 "--align-docs"]) == 0
    assert json.loads((out / "step-000002" / "train_state.json").read_text())["config"]["align_docs"] is True
    data = tmp_path / "noeot"
    shutil.copytree(folders[0], data)
    meta = json.loads((data / "meta.json").read_text())
    del meta["eot_id"]
    (data / "meta.json").write_text(json.dumps(meta))
    one_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "r"), *ARGS, "--align-docs"],
              "--align-docs", "eot_id")


# ----------------------------------------------------------------------------- resume: other world sizes, other data


def torchrun(out: Path, data: Path, *extra: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glassformer", "train", "--data", str(data), "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def cut_back(run: Path, to: Path) -> Path:
    """A copy of a finished run as it stood at its step-4 checkpoint."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "step-000008")
    write_pointer(to, "latest", "step-000004")
    return to


ALIGNED = [*ARGS, "--align-docs"]
distributed = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def uninterrupted(folders, tmp_path_factory):
    """One process, 8 steps with --align-docs over the sharded folder, and its losses."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", "--data", str(folders[1]), "--out", str(out), *ALIGNED]) == 0
    assert len(losses(out)) == 8
    return out, losses(out)


def resumed_as_it_ran(run: Path, want: list[float]) -> None:
    assert losses(run) == pytest.approx(want, abs=1e-5, rel=0)  # as the uninterrupted run (2-process gloo: 1e-5)
    assert json.loads((run / "step-000008" / "train_state.json").read_text())["data"]["windows_read"] == 32


@distributed
def test_two_processes_resumed_in_one_repeat_the_run(folders, uninterrupted, tmp_path):
    one, want = uninterrupted
    torchrun(tmp_path / "two", folders[1], *ALIGNED)
    assert losses(tmp_path / "two") == pytest.approx(want, abs=1e-5, rel=0)
    run = cut_back(tmp_path / "two", tmp_path / "2to1")
    assert main(["train", "--data", str(folders[1]), "--out", str(run), "--resume", "--no-progress"]) == 0
    resumed_as_it_ran(run, want)


@distributed
def test_one_process_resumed_in_two_repeats_the_run(folders, uninterrupted, tmp_path):
    one, want = uninterrupted
    run = cut_back(one, tmp_path / "1to2")
    torchrun(run, folders[1], "--resume", "--no-progress")
    resumed_as_it_ran(run, want)


@pytest.mark.parametrize("kind", ["sharded", "single"])
def test_resume_refuses_a_data_folder_that_changed(kind, ids, tmp_path, capsys):
    train, val = ids

    def make(folder, train):
        if kind == "sharded":
            return sharded_folder(folder, train, val, {"train": [3000], "val": [300]})
        return single_folder(folder, train, val)

    data, out = make(tmp_path / "d", train), tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--max-steps", "2"]) == 0
    shutil.rmtree(data)
    make(data, train)  # the same ids prepared again: resuming is fine
    assert main(["train", "--data", str(data), "--out", str(out), "--resume", "--max-steps", "3", "--no-progress"]) == 0
    shutil.rmtree(data)
    changed = train.copy()
    changed[3100] = 5  # one id, in the second shard; the same length
    make(data, changed)
    name = "train_000001.bin" if kind == "sharded" else "train.bin"
    err = one_error(capsys, ["train", "--data", str(data), "--out", str(out), "--resume", "--max-steps", "4"],
                    "--resume", data, name)
    assert "not the one the run began with" in err
    assert not (out / "step-000004").exists()


def test_reading_ahead_changes_no_batch_and_keeps_errors_for_their_step():
    from glassformer.errors import UserError
    from glassformer.train.loader import Prefetch

    reads = []

    def read(step):
        reads.append(step)
        if step == 5:
            raise UserError("step 5 cannot be read")
        return step * 10

    p = Prefetch(read)
    assert [p.get(s) for s in (0, 1, 2)] == [0, 10, 20]  # 1 and 2 were read ahead
    assert p.get(0) == 0  # a step asked out of order is read then
    p.get(3), p.get(4)
    with pytest.raises(UserError, match="step 5"):  # read ahead at step 4, raised when step 5 is asked for
        p.get(5)
    assert sorted(set(reads)) == [0, 1, 2, 3, 4, 5]
