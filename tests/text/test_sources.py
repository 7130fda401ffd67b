"""Row corpora (text/sources.py): parquet, JSONL and Hugging Face datasets read from a cache laid out
as huggingface_hub documents it (HF_HUB_CACHE/datasets--OWNER--NAME/{blobs, refs/<branch>,
snapshots/<commit>/<file> -> ../../blobs/<sha256>}), offline. Fixtures are written with pyarrow and
json here; the expected split is computed in the tests from its documented rule, not by the module."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from glassformer.cli import main  # noqa: E402
from glassformer.errors import UserError  # noqa: E402
from glassformer.text import sources  # noqa: E402
from glassformer.text.corpus import Document, get_corpus, read_text  # noqa: E402
from glassformer.text.data import load_split, read_meta  # noqa: E402

WORDS = "the king queen castle knight sword sea stars hill sings walks waits old young Ça naïve 東京 🙂".split()
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def docs_of(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "." for _ in range(n)]


def held_out(text: str, val_fraction: float = 0.1) -> bool:
    """The documented rule, written independently: sha256's first 8 bytes, big-endian, below val_fraction * 2**64."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:16], 16) < round(val_fraction * 2 ** 64)


def write_parquet(path: Path, texts: list, row_group_size: int = 16, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts, **extra}), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def texts_of(split) -> list[str]:
    return [read_text(d) for d in split]


# -- local files --------------------------------------------------------------------------------
def test_parquet_corpus_splits_whole_documents_by_the_documented_hash(tmp_path):
    texts = docs_of(0, 300)
    write_parquet(tmp_path / "c.parquet", texts)
    corpus = get_corpus(tmp_path / "c.parquet")
    want_val = [t for t in texts if held_out(t)]
    want_train = [t for t in texts if not held_out(t)]
    assert 10 < len(want_val) < 60  # the fixture exercises both sides
    assert texts_of(corpus.train) == want_train and texts_of(corpus.val) == want_val
    assert texts_of(corpus.train) == want_train  # a second pass reads the same
    assert (len(corpus.train), len(corpus.val)) == (len(want_train), len(want_val))
    assert corpus.train.nbytes == sum(len(t.encode()) for t in want_train)
    assert corpus.val.nbytes == sum(len(t.encode()) for t in want_val)
    assert corpus.meta["files"] == [str(tmp_path / "c.parquet")] and corpus.meta["documents_read"] == 300


def test_parquet_is_read_by_row_group_never_whole(tmp_path, monkeypatch):
    texts = docs_of(1, 100)
    write_parquet(tmp_path / "c.parquet", texts, row_group_size=7)
    groups = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, row_groups=None, **k):
        groups.append(row_groups)
        return real(self, *a, row_groups=row_groups, **k)

    def whole(*a, **k):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    monkeypatch.setattr(pq, "read_table", whole)
    rows = list(sources.RowFile("c.parquet", lambda: tmp_path / "c.parquet").rows())
    assert [r.decode() for r in rows] == texts
    assert groups == [[g] for g in range(15)]  # ceil(100 / 7) row groups, one at a time


def test_jsonl_folder_reads_every_kind_in_path_order_and_skips_null_and_empty(tmp_path):
    a, b, c = docs_of(2, 40), docs_of(3, 40), docs_of(4, 40)
    write_jsonl(tmp_path / "d" / "b.jsonl.gz", [{"text": t, "n": i} for i, t in enumerate(b)], gz=True)
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": t} for t in a] + [{"text": None}, {"text": ""}, ""])
    write_jsonl(tmp_path / "d" / "sub" / "c.json.gz", [{"body": t} for t in c], gz=True)
    with pytest.raises(UserError, match=r"c\.json\.gz:1: no field 'text' \(its fields: body\)"):
        get_corpus(tmp_path / "d")
    write_jsonl(tmp_path / "d" / "sub" / "c.json.gz", [{"text": t} for t in c], gz=True)
    corpus = get_corpus(tmp_path / "d")
    everything = a + b + c
    assert sorted(texts_of(corpus.train) + texts_of(corpus.val)) == sorted(everything)
    assert texts_of(corpus.train) == [t for t in everything if not held_out(t)]
    assert corpus.meta["documents_read"] == 120


def test_lone_surrogate_in_json_is_replaced_and_counted(tmp_path):
    from glassformer.text.corpus import DecodeStats

    write_jsonl(tmp_path / "s.jsonl", ['{"text": "ab\\ud800cd"}'] + [{"text": t} for t in docs_of(5, 30)])
    source = sources.RowSource("s", [sources.RowFile("s.jsonl", lambda: tmp_path / "s.jsonl")]).scan()
    stats = DecodeStats()
    docs = [d for v in (False, True) for d in source.split(v, Document) if d.name == "s.jsonl#0"]
    assert [read_text(d, stats) for d in docs] == ["ab\ufffd\ufffd\ufffdcd"] and stats.bytes_replaced == 3


def test_max_docs_takes_the_first_documents_and_reads_no_further_file(tmp_path):
    texts = docs_of(6, 50)
    write_parquet(tmp_path / "d" / "0.parquet", texts[:30])
    write_parquet(tmp_path / "d" / "1.parquet", texts[30:])
    (tmp_path / "d" / "2.parquet").write_bytes(b"not parquet")  # never opened: the slice ends before it
    corpus = get_corpus(tmp_path / "d", max_docs=40)
    assert sorted(texts_of(corpus.train) + texts_of(corpus.val)) == sorted(texts[:40])
    assert corpus.meta["max_docs"] == 40 and corpus.meta["documents_read"] == 40
    (tmp_path / "d" / "1.parquet").write_bytes(b"not parquet either")
    corpus = get_corpus(tmp_path / "d", max_docs=30)  # ends with the first file: the second is never opened
    assert sorted(texts_of(corpus.train) + texts_of(corpus.val)) == sorted(texts[:30])


def test_max_tokens_stops_near_the_count_the_given_tokenizer_makes(tmp_path):
    from glassformer.text.tokenizer import Tokenizer

    texts = docs_of(7, 400)
    write_parquet(tmp_path / "c.parquet", texts)
    tok = Tokenizer.train(iter(texts), 400)
    corpus = get_corpus(tmp_path / "c.parquet", max_tokens=5000, tokenizer=tok)
    got = texts_of(corpus.train) + texts_of(corpus.val)
    n = corpus.meta["documents_read"]
    assert sorted(got) == sorted(texts[:n]) and n < 400
    tokens = sum(len(tok.encode(t)) + 1 for t in texts[:n])  # each document and its end-of-text
    assert 0.8 * 5000 < tokens < 1.2 * 5000, tokens


def test_split_is_never_empty_on_either_side(tmp_path):
    texts = [t for t in docs_of(8, 200) if not held_out(t)][:5]  # none falls below the cut
    write_jsonl(tmp_path / "few.jsonl", [{"text": t} for t in texts])
    corpus = get_corpus(tmp_path / "few.jsonl")
    lowest = min(texts, key=lambda t: hashlib.sha256(t.encode()).digest())
    assert texts_of(corpus.val) == [lowest] and len(corpus.train) == 4
    write_jsonl(tmp_path / "same.jsonl", [{"text": "one text"}] * 3)
    with pytest.raises(UserError, match="one distinct text"):
        get_corpus(tmp_path / "same.jsonl")


def test_prepare_writes_the_documents_in_order_each_followed_by_eot(tmp_path):
    texts = docs_of(9, 200)
    write_parquet(tmp_path / "c.parquet", texts)
    rc = main(["prepare", "--corpus", str(tmp_path / "c.parquet"), "--out", str(tmp_path / "data"),
               "--vocab-size", "300", "--context", "16", "--max-docs", "150"])
    assert rc == 0
    meta = read_meta(tmp_path / "data")
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tmp_path / "data")
    for split, val in (("train", False), ("val", True)):
        want = [t for t in texts[:150] if held_out(t) == val]
        ids = np.asarray(load_split(tmp_path / "data", split)[0:meta[f"{split}_tokens"]]).tolist()
        assert ids == [i for t in want for i in tok.encode(t) + [tok.eot_id]]
        assert meta["documents"][split] == len(want) and meta[f"{split}_bytes"] == sum(len(t.encode()) for t in want)
    assert meta["text_field"] == "text" and meta["max_docs"] == 150


# -- bad input --------------------------------------------------------------------------------
def _bad(tmp_path, capsys, argv, match):
    rc = main(["prepare", "--out", str(tmp_path / "out"), "--vocab-size", "300", "--context", "8", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setup, argv, match", [
    ("parquet", ["--corpus", "{t}/c.parquet", "--text-field", "body"], "has no column 'body' (its columns: id, text)"),
    ("parquet", ["--corpus", "{t}/c.parquet", "--text-field", "id"], "column 'id' holds int64, not text"),
    ("broken", ["--corpus", "{t}/c.parquet"], "is not a parquet file pyarrow can read"),
    ("jsonl", ["--corpus", "{t}/c.jsonl"], "c.jsonl:3: not a line of UTF-8 JSON"),
    ("jsonl", ["--corpus", "{t}/c.jsonl", "--text-field", "n"], "c.jsonl:1: field 'n' is a int, not a string"),
    ("mixed", ["--corpus", "{t}"], "holds both parquet/JSONL files"),
    ("parquet", ["--corpus", "{t}/c.parquet", "--max-docs", "0"], "--max-docs 0 must be at least 1"),
    ("text", ["--corpus", "{t}/c.txt", "--max-docs", "5"], "--max-docs is for parquet, JSONL and hf: corpora"),
    (None, ["--corpus", "hf:no-slash"], "is not a Hugging Face dataset name"),
    ("jsonl", ["--chat", "{t}/c.jsonl", "--max-docs", "5"], "--max-docs is for a parquet, JSONL or hf: --corpus"),
])
def test_bad_row_input_is_one_line_naming_the_file(tmp_path, capsys, setup, argv, match):
    if setup in ("parquet", "mixed"):
        write_parquet(tmp_path / "c.parquet", docs_of(10, 40))
    if setup == "broken":
        (tmp_path / "c.parquet").write_bytes(b"PAR1 but no more")
    if setup == "jsonl":
        write_jsonl(tmp_path / "c.jsonl", [{"text": "a b", "n": 1}, {"text": "c d", "n": 2}, "{not json"])
    if setup in ("text", "mixed"):
        (tmp_path / "c.txt").write_text("some text\n" * 50)
    _bad(tmp_path, capsys, [a.format(t=tmp_path) for a in argv], match)


# -- the Hugging Face Hub, offline --------------------------------------------------------------
CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: small
  data_files:
  - split: train
    path: data/small/*
  - split: validation
    path: valid/*
---
# a dataset
"""


def put_in_cache(hub: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> None:
    """files as snapshot `commit` of dataset `repo`: content-addressed blobs, relative symlinks, refs."""
    storage = hub / ("datasets--" + repo.replace("/", "--"))
    for name, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HF_HUB_CACHE with dataset org/name (main -> A: a card with two configurations; v1 -> B: no card,
    JSONL files), offline. Returns the texts by file."""
    parts = {"data/small/0.parquet": docs_of(11, 40), "data/small/1.parquet": docs_of(12, 40),
             "data/big/0.parquet": docs_of(13, 60), "valid/0.parquet": docs_of(14, 20)}
    made = tmp_path / "made"
    files = {name: write_parquet(made / name, texts).read_bytes() for name, texts in parts.items()}
    files["README.md"] = CARD.encode()
    put_in_cache(tmp_path / "hub", "org/name", COMMIT_A, files, ("main",))
    b = {"train/0.jsonl": docs_of(15, 30)}
    put_in_cache(tmp_path / "hub", "org/name", COMMIT_B,
                 {k: write_jsonl(made / k, [{"text": t} for t in v]).read_bytes() for k, v in b.items()}, ("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return {**parts, **b}


def all_texts(corpus) -> list[str]:
    return sorted(texts_of(corpus.train) + texts_of(corpus.val))


def test_hub_configuration_picks_its_train_split_files(hub):
    small = get_corpus("hf:org/name:small")
    assert all_texts(small) == sorted(hub["data/small/0.parquet"] + hub["data/small/1.parquet"])
    assert small.meta["files"] == ["hf:org/name/data/small/0.parquet", "hf:org/name/data/small/1.parquet"]
    assert small.meta["hf"] == {"repo": "org/name", "config": "small", "revision": None, "commit": COMMIT_A}
    default = get_corpus("hf:org/name")  # data/*/*: big and small, not valid/
    assert all_texts(default) == sorted(hub["data/big/0.parquet"] + hub["data/small/0.parquet"]
                                        + hub["data/small/1.parquet"])
    v1 = get_corpus("hf:org/name@v1")  # no card: every data file
    assert all_texts(v1) == sorted(hub["train/0.jsonl"]) and v1.meta["hf"]["commit"] == COMMIT_B
    assert all_texts(get_corpus(f"hf:org/name@{COMMIT_B}")) == all_texts(v1)


def test_hub_prepare_end_to_end_offline(hub, tmp_path):
    rc = main(["prepare", "--corpus", "hf:org/name:small", "--out", str(tmp_path / "data"), "--vocab-size", "300",
               "--context", "16"])
    assert rc == 0
    meta = read_meta(tmp_path / "data")
    texts = hub["data/small/0.parquet"] + hub["data/small/1.parquet"]
    assert meta["documents"] == {"train": sum(not held_out(t) for t in texts), "val": sum(held_out(t) for t in texts)}
    assert meta["corpus"] == "hf:org/name:small" and meta["hf"]["commit"] == COMMIT_A


@pytest.mark.parametrize("name, match", [
    ("hf:org/name:huge", "has no configuration 'huge'; it has: default, small"),
    ("hf:org/missing", "hf:org/missing is not in the Hugging Face cache"),
    ("hf:org/name@v2", "is not in the Hugging Face cache"),
    ("hf:org/name:nowhere@v1", "holds no parquet or JSONL files under a folder 'nowhere'"),
])
def test_hub_bad_names_are_one_line(hub, tmp_path, capsys, name, match):
    _bad(tmp_path, capsys, ["--corpus", name], match)


def test_hub_datasets_offline_flag_counts_too(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert sources.hub_settings()[1] is True
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert sources.hub_settings()[1] is False


def test_prepare_reads_a_row_corpus_four_times_and_resume_sees_a_replaced_file(tmp_path, monkeypatch):
    texts = docs_of(16, 120)
    write_parquet(tmp_path / "c.parquet", texts)
    opened = []
    real = sources.RowFile.rows

    def counting(self):
        opened.append(self.name)
        return real(self)

    monkeypatch.setattr(sources.RowFile, "rows", counting)
    rc = main(["prepare", "--corpus", str(tmp_path / "c.parquet"), "--out", str(tmp_path / "data"),
               "--vocab-size", "300", "--context", "16", "--workers", "1"])
    assert rc == 0
    assert len(opened) == 4  # the first read, the tokenizer's sample, train, val: no pass for the resume check
    first = get_corpus(tmp_path / "c.parquet").train.fingerprint()
    assert get_corpus(tmp_path / "c.parquet").train.fingerprint() == first
    write_parquet(tmp_path / "c.parquet", texts[:-1] + ["a new last document."])
    assert get_corpus(tmp_path / "c.parquet").train.fingerprint() != first


def test_hub_online_fetches_one_file_at_a_time_and_only_the_slice(tmp_path, monkeypatch):
    """The Hub itself stood in for by huggingface_hub's two calls: the listing (dataset_info) and the
    download (hf_hub_download), so the order of fetching and reading is seen."""
    import types

    import huggingface_hub

    names = [f"data/{i}.parquet" for i in range(3)]
    texts = {n: docs_of(20 + i, 30) for i, n in enumerate(names)}
    for n in names:
        write_parquet(tmp_path / "repo" / n, texts[n])
    events = []

    def dataset_info(self, repo, revision=None, **k):
        events.append(("list", repo, revision))
        return types.SimpleNamespace(sha=COMMIT_A, siblings=[types.SimpleNamespace(rfilename=n) for n in names])

    def download(repo, name, repo_type=None, revision=None, cache_dir=None, local_files_only=False):
        assert (repo_type, revision, local_files_only) == ("dataset", COMMIT_A, False)
        events.append(("fetch", name))
        return str(tmp_path / "repo" / name)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", dataset_info)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    corpus = get_corpus("hf:org/name@main", max_docs=45)
    assert events == [("list", "org/name", "main"), ("fetch", names[0]), ("fetch", names[1])]  # not the third
    assert all_texts(corpus) == sorted(texts[names[0]] + texts[names[1]][:15])
    assert corpus.meta["hf"] == {"repo": "org/name", "config": None, "revision": "main", "commit": COMMIT_A}

    def missing(self, repo, revision=None, **k):
        from huggingface_hub.utils import RepositoryNotFoundError

        e = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(e, "404 Repository Not Found")
        raise e

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", missing)
    with pytest.raises(UserError, match="hf:org/gone: no such dataset on the Hugging Face Hub"):
        get_corpus("hf:org/gone")
