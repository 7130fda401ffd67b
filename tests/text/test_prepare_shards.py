"""`prepare --shard-tokens N --workers K`: shards in llm.c's format read back by a reader written from
that format alone, equal to the ids of a single-file prepare; the same shards from 1 or 2 encoding
processes; an interrupted prepare continued by the same command; bad values refused in one line."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import random

import numpy as np
import pytest

from glassformer.cli import main
from glassformer.text import encoding
from glassformer.text.corpus import user_corpus
from glassformer.text.data import load_split, prepare, read_meta
from glassformer.text.tokenizer import Tokenizer

from ..support import llmc_read

WORDS = "the king queen castle knight sword sea stars hill sings walks waits old young naïve 東京".split()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A folder of 24 documents, some over one 256 KB read (so a document spans batches)."""
    docs = tmp_path_factory.mktemp("shards") / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for i in range(24):
        lines = 6000 if i % 8 == 0 else 80
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(lines))
        (docs / f"d{i:02d}.txt").write_text(text + "\n", encoding="utf-8")
    return docs


@pytest.fixture(scope="module")
def corpus_and_reference(docs):
    """The corpus and a single-file prepare of it: its tokenizer and ids are the reference."""
    corpus = user_corpus(docs, 0.1)
    meta = prepare(corpus, docs.parent / "single", vocab_size=300, context=8, show_progress=False)
    tok = Tokenizer.from_file(docs.parent / "single" / "tokenizer.json")
    ref = {s: np.asarray(load_split(docs.parent / "single", s)[:]) for s in ("train", "val")}
    return corpus, tok, ref, meta


def shards_of(folder, split):
    return sorted(p.name for p in folder.glob(f"{split}_*.bin"))


def test_shards_split_at_n_ids_and_read_as_llmc_reads_them(tmp_path, corpus_and_reference):
    corpus, tok, ref, single = corpus_and_reference
    n = 7000
    meta = prepare(corpus, tmp_path / "o", tokenizer=tok, context=8, shard_tokens=n, show_progress=False)
    out = tmp_path / "o"
    assert not (out / "train.bin").exists() and not (out / "progress.json").exists()
    assert not list(tmp_path.glob(".o.*"))  # the temporary folder was renamed in
    for split in ("train", "val"):
        listed = meta["shards"][split]
        assert [e["file"] for e in listed] == shards_of(out, split) == [f"{split}_{i:06d}.bin" for i in range(len(listed))]
        total = single[f"{split}_tokens"]
        assert meta[f"{split}_tokens"] == total and meta[f"{split}_bytes"] == single[f"{split}_bytes"]
        assert len(listed) == -(-total // n)  # ceil: every shard full but the last
        assert [e["tokens"] for e in listed] == [n] * (len(listed) - 1) + [total - n * (len(listed) - 1)]
        for e in listed:
            assert e["sha256"] == hashlib.sha256((out / e["file"]).read_bytes()).hexdigest()
        ids = np.concatenate([llmc_read(out / e["file"]) for e in listed])
        assert np.array_equal(ids, ref[split])  # the single-file prepare's ids, with the same tokenizer
    # a shard ends at n ids wherever that falls: here inside a document (no end-of-text at the cut)
    assert llmc_read(out / "train_000000.bin")[-1] != meta["eot_id"]
    assert json.loads((out / "meta.json").read_text())["shards"] == meta["shards"] == read_meta(out)["shards"]


def test_two_workers_write_the_same_shards_as_one(tmp_path, corpus_and_reference):
    corpus, tok, _, _ = corpus_and_reference
    for w in (1, 2):
        prepare(corpus, tmp_path / f"w{w}", tokenizer=tok, context=8, shard_tokens=9000, workers=w, show_progress=False)
    names = shards_of(tmp_path / "w1", "train") + shards_of(tmp_path / "w1", "val")
    assert len(names) > 3 and names == shards_of(tmp_path / "w2", "train") + shards_of(tmp_path / "w2", "val")
    for name in names + ["meta.json"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_encoding_workers_do_not_import_torch(corpus_and_reference):
    _, tok, _, _ = corpus_and_reference
    eot = np.asarray([tok.eot_id], dtype="<u2")
    jobs = [((i,), [f"the king {i} walks", "the sea"], [True, i % 2 == 0]) for i in range(7)]
    with encoding.Encoders(tok.tk, eot, 2) as enc:
        got = list(enc.ordered(iter(jobs)))
        assert len(enc.procs) == 2 and not enc.torch_in_workers
    with encoding.Encoders(tok.tk, eot, 1) as enc:
        want = list(enc.ordered(iter(jobs)))
    assert [k for k, _ in got] == [k for k, _, _ in jobs]  # in the order given
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert want[1][1].tolist() == tok.tk.encode("the king 1 walks", add_special_tokens=False).ids + [tok.eot_id] + \
        tok.tk.encode("the sea", add_special_tokens=False).ids


def test_an_interrupted_prepare_continues_from_its_whole_shards(tmp_path, corpus_and_reference, monkeypatch, capsys):
    corpus, tok, _, _ = corpus_and_reference
    argv = dict(tokenizer=tok, context=8, shard_tokens=6000, show_progress=False)
    want = prepare(corpus, tmp_path / "whole", **argv)
    real = encoding.Progress.add_shard

    def stop_after_the_first(self, split, record):
        real(self, split, record)
        raise KeyboardInterrupt  # as Ctrl-C (or a crash) right after the first shard is whole

    monkeypatch.setattr(encoding.Progress, "add_shard", stop_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        prepare(corpus, tmp_path / "o", **argv, workers=2)  # stopped with 2 workers, continued with 1
    monkeypatch.undo()
    assert not multiprocessing.active_children()  # the workers were ended
    partial = tmp_path / ".o.partial"
    assert "the same command continues" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert sorted(p.name for p in partial.glob("*.bin")) == ["train_000000.bin"]  # the half-written second is gone
    first = (partial / "train_000000.bin").stat().st_ino
    (partial / "train_000001.bin").write_bytes(b"half a shard")  # as a killed run (no cleanup) leaves one

    got = prepare(corpus, tmp_path / "o", **argv)
    assert (tmp_path / "o" / "train_000000.bin").stat().st_ino == first  # kept, not written again
    assert got["shards"] == want["shards"] and not partial.exists()
    for name in shards_of(tmp_path / "whole", "train") + shards_of(tmp_path / "whole", "val") + ["meta.json"]:
        assert (tmp_path / "o" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_a_damaged_kept_shard_is_written_again(tmp_path, corpus_and_reference, monkeypatch):
    corpus, tok, _, _ = corpus_and_reference
    argv = dict(tokenizer=tok, context=8, shard_tokens=6000, show_progress=False)
    real, seen = encoding.Progress.add_shard, []

    def stop_after_two(self, split, record):
        real(self, split, record)
        seen.append(record)
        if len(seen) == 2:
            raise RuntimeError("stopped")

    monkeypatch.setattr(encoding.Progress, "add_shard", stop_after_two)
    with pytest.raises(RuntimeError):
        prepare(corpus, tmp_path / "o", **argv)
    monkeypatch.undo()
    path = tmp_path / ".o.partial" / "train_000001.bin"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # one id changed: its sha256 no longer matches the progress file's
    path.write_bytes(bytes(raw))
    got = prepare(corpus, tmp_path / "o", **argv)
    assert got["shards"]["train"][:2] == [{k: r[k] for k in ("file", "tokens", "sha256")} for r in seen]


@pytest.mark.parametrize("flag,value,words", [
    ("--shard-tokens", "-5", "--shard-tokens -5 must be a whole number from 1 to 2,147,483,647"),
    ("--shard-tokens", str(2**31), "a shard's header counts them in an int32"),
    ("--shard-tokens", "1e8", "invalid int value"),
    ("--workers", "0", "--workers 0 must be a whole number of at least 1"),
])
def test_bad_shard_tokens_or_workers_is_one_line(tmp_path, capsys, flag, value, words):
    (tmp_path / "c.txt").write_text("the king walks\n" * 50, encoding="utf-8")
    try:
        rc = main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), flag, value])
    except SystemExit as e:  # argparse's own refusal (not a number), in the CLI's one-line form
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not list(tmp_path.glob("*o*"))  # nothing written


def test_the_command_writes_shards_of_100m_ids_by_default(tmp_path, docs, corpus_and_reference):
    _, _, _, single = corpus_and_reference
    assert main(["prepare", "--corpus", str(docs), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                 "--context", "8"]) == 0
    meta = read_meta(tmp_path / "o")
    assert meta["shard_tokens"] == 100_000_000 and [e["file"] for e in meta["shards"]["train"]] == ["train_000000.bin"]
    assert meta["train_tokens"] == single["train_tokens"] == len(llmc_read(tmp_path / "o" / "train_000000.bin"))


def test_a_shard_writer_records_each_shard_and_where_the_text_goes_on(tmp_path):
    """uint32 ids (a vocabulary past 65,536) make llm.c's "llama-3" shards; each finished shard is in
    progress.json with the stream position after it: (copy, batch, id within the batch)."""
    progress = encoding.Progress(tmp_path, "inputs")
    writer = encoding.ShardWriter(tmp_path, "train", "uint32", 5, progress)
    ids = np.arange(70_000, 70_012, dtype="<u4")
    writer.write(ids[:7], (0, 0, 0))  # batch 0 of copy 0: 7 ids
    writer.write(ids[7:], (0, 1, 0))  # batch 1: 5 ids
    writer.close()
    records = json.loads((tmp_path / "progress.json").read_text())["splits"]["train"]["shards"]
    assert [(r["file"], r["tokens"], r["next"]) for r in records] == [
        ("train_000000.bin", 5, [0, 0, 5]), ("train_000001.bin", 5, [0, 1, 3]), ("train_000002.bin", 2, [None] * 3)]
    with open(tmp_path / "train_000000.bin", "rb") as f:
        assert np.frombuffer(f.read(12), "<i4").tolist() == [20240801, 7, 5]
    assert np.array_equal(np.concatenate([llmc_read(tmp_path / r["file"]) for r in records]), ids)
