"""Token files, batches, corpus reading and splitting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.text.corpus import DecodeStats, _file_doc, iter_text, pair_folios, user_corpus
from glassformer.text.data import TokenFile, dtype_for_vocab, get_batch, load_split
from glassformer.errors import UserError
from glassformer.text.tokenizer import Tokenizer

from .test_tokenizer import SAMPLE, llama3_style


@pytest.fixture(scope="module")
def arange_file(tmp_path_factory):
    """A token file whose id at offset i is i (so a window's first id is its start)."""
    path = tmp_path_factory.mktemp("tok") / "t.bin"
    np.arange(5000, dtype="<u2").tofile(path)
    return TokenFile(path, "uint16")


def test_token_file_reads_little_endian(tmp_path):
    ids = np.array([1, 258, 65535, 0], dtype="<u2")
    (tmp_path / "a.bin").write_bytes(ids.tobytes())
    assert (tmp_path / "a.bin").read_bytes()[:4] == b"\x01\x00\x02\x01"
    assert TokenFile(tmp_path / "a.bin", "uint16")[:].tolist() == [1, 258, 65535, 0]
    big = np.array([70000, 1], dtype="<u4")
    (tmp_path / "b.bin").write_bytes(big.tobytes())
    assert TokenFile(tmp_path / "b.bin", "uint32")[:].tolist() == [70000, 1]
    (tmp_path / "c.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(UserError, match="not a whole number"):
        TokenFile(tmp_path / "c.bin", "uint16")
    with pytest.raises(UserError, match="does not exist"):
        TokenFile(tmp_path / "missing.bin")
    assert dtype_for_vocab(65536) == "uint16" and dtype_for_vocab(65537) == "uint32"


def test_batch_windows_are_consecutive_tokens(arange_file):
    x, y = get_batch(arange_file, 16, 32, seed=1, step=0)
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
    start = x[:, :1]  # (B, 1)
    assert torch.equal(x, start + torch.arange(32))  # each row is tokens[s : s+T]
    assert torch.equal(y, x + 1)  # the targets are the next tokens
    assert int(start.max()) + 32 < 5000


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ranks_together_see_what_one_process_sees(arange_file, world_size):
    for step in (0, 1, 7):
        x1, y1 = get_batch(arange_file, 8, 16, seed=3, step=step)
        parts = [get_batch(arange_file, 8, 16, seed=3, step=step, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)


def test_batches_depend_on_seed_and_step_only(arange_file):
    a = get_batch(arange_file, 8, 16, seed=0, step=5)[0]
    get_batch(arange_file, 8, 16, seed=0, step=4)  # an earlier draw changes nothing
    torch.manual_seed(123)  # nor does the global RNG
    assert torch.equal(get_batch(arange_file, 8, 16, seed=0, step=5)[0], a)
    assert not torch.equal(get_batch(arange_file, 8, 16, seed=0, step=6)[0], a)
    assert not torch.equal(get_batch(arange_file, 8, 16, seed=1, step=5)[0], a)
    # numpy arrays and tensors give the same batch as the memory map
    assert torch.equal(get_batch(np.asarray(arange_file.array), 8, 16, 0, 5)[0], a)
    assert torch.equal(get_batch(torch.arange(5000), 8, 16, 0, 5)[0], a)


def test_batch_starts_cover_the_file(arange_file):
    starts = torch.cat([get_batch(arange_file, 64, 8, seed=0, step=s)[0][:, 0] for s in range(20)])
    assert int(starts.min()) < 100 and int(starts.max()) > 4890  # the whole range is drawn from, last window included


def _reads(arange_file, sampling: str, windows: int, T: int = 16, B: int = 8) -> torch.Tensor:
    """How often each token of the file was read (as an input) by the first `windows` windows."""
    steps = -(-windows // B)
    starts = torch.cat([get_batch(arange_file, B, T, seed=4, step=s, sampling=sampling)[0][:, 0]
                        for s in range(steps)])[:windows]  # (windows,)
    return torch.bincount((starts[:, None] + torch.arange(T)).reshape(-1), minlength=5000)  # (5000,)


def test_each_token_comes_once_an_epoch(arange_file):
    """sampling "epochs": an epoch's windows tile the file T apart from one offset, in a shuffled
    order, so n epochs read each token n times (but the few the offsets leave out at the ends),
    where drawing each start anew reads some tokens far more often than others."""
    T, n_windows = 16, (5000 - 16) // 16  # 311 windows an epoch
    one = get_batch(arange_file, n_windows, T, seed=4, step=0)[0][:, 0]  # (311,) the whole of epoch 0 in one batch
    offset = int(one[0]) % T
    assert sorted(one.tolist()) == [offset + k * T for k in range(n_windows)]
    assert one.tolist() != sorted(one.tolist())  # shuffled
    reads = _reads(arange_file, "epochs", 3 * n_windows)
    inner = reads[T:5000 - 2 * T]  # the ends: where each epoch's offset starts and stops its tiling
    assert int(inner.min()) == int(inner.max()) == 3
    anew = _reads(arange_file, "random", 3 * n_windows)[T:5000 - 2 * T]
    assert int(anew.min()) <= 1 and int(anew.max()) >= 6  # with replacement: the spread epochs remove
    nxt = get_batch(arange_file, n_windows, T, seed=4, step=1)[0][:, 0]  # epoch 1: another order (and offset)
    assert nxt.tolist() != one.tolist()


def test_conversation_blocks_come_once_an_epoch():
    """With block data each block start is a unit: once an epoch, in a shuffled order."""
    ids = torch.arange(33 * 10)  # ten blocks of 33 tokens
    firsts = torch.cat([get_batch(ids, 5, 32, seed=2, step=s, block=33)[0][:, 0] for s in range(4)])  # (20,)
    assert sorted(firsts[:10].tolist()) == sorted(firsts[10:].tolist()) == [33 * k for k in range(10)]
    assert firsts[:10].tolist() != firsts[10:].tolist()
    with pytest.raises(UserError, match="sampling must be one of"):
        get_batch(ids, 5, 32, 0, 0, sampling="sequential")


def test_batch_errors(arange_file):
    with pytest.raises(UserError, match="too few"):
        get_batch(arange_file, 2, 5000, 0, 0)
    assert get_batch(arange_file, 1, 4999, 0, 0)[0].shape == (1, 4999)  # exactly T+1 tokens is enough
    with pytest.raises(UserError, match="not divisible"):
        get_batch(arange_file, 6, 8, 0, 0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        get_batch(arange_file, 8, 8, 0, 0, rank=4, world_size=4)


# -- reading text in chunks --------------------------------------------------------------
TEXT_ALPHABET = st.sampled_from(["the", "King", "'s", "'ll", " ", "  ", "\n", "\n\n", "\t", "\r\n", ".", ",", "!",
                                 "42", "1234", "é", "東京", "🙂", "\u00a0", "\x1c", "\x85", "—", "  \n"])


WHITESPACE_RICH = "".join(f"the{sep}King{sep}'s 42{sep}" for sep in ["\n\n", "\n \n", "  \n", "\r\n\r\n", ".\n\n\t"]) * 30


@pytest.fixture(scope="module")
def tokenizers_pair():
    """GPT-2-regex and Llama-3-regex byte-level BPE that have merged runs of newlines and spaces,
    so a chunk cut in the wrong place would change the ids."""
    return Tokenizer.train([SAMPLE, WHITESPACE_RICH], vocab_size=450), Tokenizer(llama3_style(450, WHITESPACE_RICH))


@settings(max_examples=60)
@given(st.lists(TEXT_ALPHABET, max_size=120).map("".join), st.integers(4, 40))
def test_chunked_encoding_equals_whole_encoding(tokenizers_pair, tmp_path_factory, text, chunk_bytes):
    path = tmp_path_factory.mktemp("chunk") / "t.txt"
    path.write_bytes(text.encode("utf-8"))
    chunks = list(iter_text(_file_doc(path, "t.txt"), chunk_bytes=chunk_bytes))
    assert "".join(chunks) == text
    for tok in tokenizers_pair:
        assert [i for c in chunks for i in tok.encode(c)] == tok.encode(text)


@given(st.binary(max_size=300), st.integers(1, 16))
def test_invalid_utf8_is_replaced_and_counted(tmp_path_factory, raw, chunk_bytes):
    path = tmp_path_factory.mktemp("bad") / "b.txt"
    path.write_bytes(raw)
    stats = DecodeStats()
    text = "".join(iter_text(_file_doc(path, "b.txt"), stats, chunk_bytes=chunk_bytes))
    assert text == raw.decode("utf-8", errors="replace")
    # surrogateescape turns each undecodable byte into one lone surrogate: an independent count.
    bad = sum(0xDC80 <= ord(c) <= 0xDCFF for c in raw.decode("utf-8", errors="surrogateescape"))
    assert stats.bytes_replaced == bad
    assert stats.files == (["b.txt"] if bad else [])


# -- corpora ----------------------------------------------------------------------------
def test_single_file_holds_out_its_last_lines(tmp_path):
    lines = [f"line {i} ünïcödé" for i in range(1000)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    c = user_corpus(tmp_path / "one.txt", 0.1)
    train = "".join("".join(iter_text(d)) for d in c.train)
    val = "".join("".join(iter_text(d)) for d in c.val)
    assert train + val == text
    assert train.endswith("\n") and val.startswith("line ")  # cut at a line start
    assert 0.09 < len(val.encode()) / len(text.encode()) < 0.11
    c2 = user_corpus(tmp_path, 0.1)  # a folder holding one file splits it the same way
    assert [(d.start, d.end) for d in c2.val] == [(d.start, d.end) for d in c.val]


def test_folder_holds_out_whole_files(tmp_path):
    for i in range(40):
        sub = tmp_path / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i}.{'md' if i % 3 else 'txt'}").write_text(f"document {i}\n" * 50)
    (tmp_path / "a" / "skip.bin").write_bytes(b"\x00" * 100)  # not .txt/.md: ignored
    c = user_corpus(tmp_path, 0.2)
    names_train = {d.name for d in c.train}
    names_val = {d.name for d in c.val}
    assert not names_train & names_val and len(names_train | names_val) == 40
    held = sum(d.nbytes for d in c.val) / sum(d.nbytes for d in c.train + c.val)
    assert 0.2 <= held < 0.25
    assert names_val == {d.name for d in user_corpus(tmp_path, 0.2).val}  # the same files every time
    assert all(d.start == 0 and d.end is None for d in c.val)


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "empty.txt").write_text("") and p / "empty.txt" or p / "empty.txt", "empty"),
    (lambda p: (p / "sub").mkdir() or p / "sub", "no .txt or .md files"),
])
def test_bad_corpus_paths(tmp_path, make, match):
    with pytest.raises(UserError, match=match):
        user_corpus(make(tmp_path))


def test_val_fraction_out_of_range(tmp_path):
    (tmp_path / "t.txt").write_text("hello\n" * 100)
    for f in (0, 1, -0.5, 2):
        with pytest.raises(UserError, match="val-fraction"):
            user_corpus(tmp_path / "t.txt", f)


def test_folios_pair_with_first_versions_by_title():
    titles = {
        "twelfth_night_gut": "Twelfth Night", "twelfe-night_gut_f": "Twelfe-Night",
        "comedy_of_errors_gut": "The Comedy of Errors", "comedy_of_errours_gut_f": "The Comedy of Errours",
        "henry_iv_part_1_gut": "King Henry IV, Part 1", "henry_iv_part_1_gut_f": "Henry IV Part 1",
        "henry_vi_part_1_gut": "King Henry VI, Part 1", "henry_vi_part_1_gut_f": "Henry VI Part 1",
        "tragedy_of_titus_andronicus_gut": "The Tragedy of Titus Andronicus", "titus_andronicus_gut_f": "Titus Andronicus",
        "antony_and_cleopatra_gut": "Antony and Cleopatra", "anthonie_and_cleopatra_gut_f": "Anthonie and Cleopatra",
        "sonnets_gut": "Sonnets",
    }
    works = pair_folios(titles)
    assert works == {
        "twelfth_night_gut": ["twelfth_night_gut", "twelfe-night_gut_f"],
        "comedy_of_errors_gut": ["comedy_of_errors_gut", "comedy_of_errours_gut_f"],
        "henry_iv_part_1_gut": ["henry_iv_part_1_gut", "henry_iv_part_1_gut_f"],
        "henry_vi_part_1_gut": ["henry_vi_part_1_gut", "henry_vi_part_1_gut_f"],
        "tragedy_of_titus_andronicus_gut": ["tragedy_of_titus_andronicus_gut", "titus_andronicus_gut_f"],
        "antony_and_cleopatra_gut": ["antony_and_cleopatra_gut", "anthonie_and_cleopatra_gut_f"],
        "sonnets_gut": ["sonnets_gut"],
    }


def test_load_split_needs_a_prepared_folder(tmp_path):
    with pytest.raises(UserError, match="not a prepared data folder"):
        load_split(tmp_path, "train")
