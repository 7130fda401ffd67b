"""Tokenizer steps (text/bpe_steps.py) end in exactly the ids of the `tokenizers` library, on our
trained tokenizer, an imported GPT-2-style tokenizer.json and a Llama-3-style one (ignore_merges,
a normalizer, added tokens with lstrip/rstrip/single_word); the merges replay from the bytes in
the ranks tokenizer.json lists; `glassformer tokenize --steps` prints them; non-byte-level refused."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.text.bpe_steps import ByteLevelBpe, bpe_steps
from glassformer.text.labels import token_label
from glassformer.text.tokenizer import EOT, Tokenizer, bytes_to_unicode

BYTE_CHAR = bytes_to_unicode()

SAMPLE = ("the cat saw the hat and the king sings  1234567 89, 2026\n\n"
          "Ça va? Ñandú, Straße, naïve café — 東京, Москва, 🙂👍🏽 don't we've\t tabs\r\n") * 30
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA_ADDED = [AddedToken("<mask>", lstrip=True, special=True), AddedToken("[/x]", rstrip=True, special=True),
               AddedToken("king", single_word=True, normalized=True, special=False),
               AddedToken("zq", single_word=True, normalized=False, special=False)]
SPECIALS = [EOT, "<|begin_of_text|>", "<mask>", "[/x]", "king", "zq", "<mask", "<|endoftext|"]
FRAGMENTS = st.one_of(
    st.text(max_size=12),  # any Unicode (no surrogates)
    st.text(alphabet=" \t\n\r\u00a0\u3000\u2028\x1c", min_size=1, max_size=6),  # whitespace runs
    st.from_regex(r"[0-9]{1,7}", fullmatch=True),
    st.sampled_from(SPECIALS + ["the", " the", " cat", "sings", "ﬁ", "é", "don't", " "]),
)
TEXTS = st.lists(FRAGMENTS, max_size=10).map("".join)


def train(tk: HFTokenizer, vocab_size: int, special: list[str]) -> HFTokenizer:
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([SAMPLE], trainer=trainer)
    return tk


def gpt2_style() -> HFTokenizer:
    """GPT-2's layout: ByteLevel pre-tokenizer (its regex), decoder and post-processor, <|endoftext|>."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=True)
    return train(tk, 420, [EOT])


def llama3_style() -> HFTokenizer:
    """Llama 3's layout (its split regex, then ByteLevel without one; ignore_merges), plus an NFKC
    normalizer and added tokens that strip whitespace or stand alone as words."""
    tk = HFTokenizer(models.BPE())
    tk.normalizer = normalizers.NFKC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    train(tk, 400, ["<|begin_of_text|>", "<|end_of_text|>"])
    spec = json.loads(tk.to_str())
    spec["model"]["ignore_merges"] = True
    tk = HFTokenizer.from_str(json.dumps(spec))
    tk.add_special_tokens([a for a in LLAMA_ADDED if a.special])
    tk.add_tokens([a for a in LLAMA_ADDED if not a.special])
    return tk


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """name -> tokenizer.json path: ours (text/tokenizer.py) and the two imported layouts."""
    root = tmp_path_factory.mktemp("bpe_steps")
    made = {"ours": Tokenizer.train([SAMPLE], vocab_size=400).tk, "gpt2": gpt2_style(), "llama3": llama3_style()}
    for name, tk in made.items():
        tk.save(str(root / f"{name}.json"))
    return {name: root / f"{name}.json" for name in made}


@pytest.fixture(scope="module")
def loaded(files) -> dict:
    """name -> (our Tokenizer read from the file, its ByteLevelBpe, merges' ranks read from the file)."""
    out = {}
    for name, path in files.items():
        tok = Tokenizer.from_file(path)
        merges = json.loads(path.read_text(encoding="utf-8"))["model"]["merges"]
        out[name] = tok, ByteLevelBpe(tok), {tuple(m): r for r, m in enumerate(merges)}
    return out


def replay(chunk, tok, ranks) -> list[int]:
    """The chunk's merges applied by hand to its single bytes (each to the leftmost such pair);
    each merge's rank must be the one tokenizer.json lists for that pair."""
    def piece(raw: bytes) -> str:  # bytes -> GPT-2's byte alphabet, as tokenizer.json writes them
        return "".join(BYTE_CHAR[b] for b in raw)

    pieces = [bytes([b]) for b in chunk.raw]
    for m in chunk.merges:
        assert ranks[(piece(m.left), piece(m.right))] == m.rank
        i = next(i for i in range(len(pieces) - 1) if (pieces[i], pieces[i + 1]) == (m.left, m.right))
        pieces[i:i + 2] = [m.left + m.right]
    return [tok.tk.token_to_id(piece(p)) for p in pieces]


@pytest.mark.parametrize("name", ["ours", "gpt2", "llama3"])
@given(text=TEXTS)
def test_steps_end_in_the_library_ids(loaded, files, name, text):
    tok, bpe, ranks = loaded[name]
    steps = bpe.steps(text)
    assert steps.ids == tok.encode(text) == HFTokenizer.from_file(str(files[name])).encode(text, add_special_tokens=False).ids
    assert steps.ids == [i for c in steps.chunks for i in c.ids]
    if name != "llama3":  # no normalizer: the chunks are the text, cut
        assert b"".join(c.raw for c in steps.chunks) == text.encode("utf-8")
        assert "".join(c.text for c in steps.chunks) == text
    for c in steps.chunks:
        if not c.added and not (name == "llama3" and not c.merges):  # ignore_merges: a token kept whole
            assert replay(c, tok, ranks) == c.ids


def test_probes_with_added_tokens_and_whitespace(loaded, files):
    """Texts that reach each rule: lstrip/rstrip whitespace taken (U+001C is none to Rust),
    single_word refused inside a word (Rust's \\w: marks yes, '²' no), a whole-word match, NFKC, whitespace runs, digits in threes."""
    tok, bpe, _ = loaded["llama3"]
    raw = HFTokenizer.from_file(str(files["llama3"]))
    for text in ["a  <mask>b", "x[/x]   y", "kingdom king kings  king", "ﬁne  ①②", "\n\n  \t 12345678 the",
                 "<mask><mask>  [/x][/x] ", "a\x1c <mask>", "[/x] \x1c",
                 "zq\u093e", "zq\u0301", "\u2160zq", "zq²", "zq_", "\u24b6zq", "a zq b", "", " ", "<|begin_of_text|>hi"]:
        assert bpe.steps(text).ids == raw.encode(text, add_special_tokens=False).ids == tok.encode(text), text
    chunks = bpe.steps("a  <mask>b").chunks
    assert [c.text for c in chunks if c.added] == ["  <mask>"]  # lstrip: the spaces go with the token
    assert [c.text for c in bpe.steps("kingdom king").chunks if c.added] == ["king"]


def test_ignore_merges_keeps_a_vocabulary_chunk_whole(files):
    """A chunk that is itself a token is one id under ignore_merges, though no merges reach it."""
    spec = json.loads(files["gpt2"].read_text(encoding="utf-8"))
    spec["model"]["vocab"]["Ġthecat"] = len(spec["model"]["vocab"])  # in the vocabulary, no merge makes it
    for ignore in (True, False):
        spec["model"]["ignore_merges"] = ignore
        raw = HFTokenizer.from_str(json.dumps(spec))
        want = raw.encode(" thecat", add_special_tokens=False).ids
        steps = bpe_steps(raw, " thecat")
        assert steps.ids == want
        assert (want == [spec["model"]["vocab"]["Ġthecat"]]) == ignore and (steps.chunks[0].merges == []) == ignore


def test_cli_prints_the_steps(files, capsys):
    text = "the cat\n\n saw<|endoftext|>1234"
    tok = Tokenizer.from_file(files["ours"])
    assert main(["tokenize", "--tokenizer", str(files["ours"]), "--steps", text]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "ids " + " ".join(map(str, tok.encode(text)))
    heads = [line.split()[1] for line in lines if line.startswith("[")]
    assert heads == [token_label(c.text) for c in bpe_steps(tok, text).chunks]
    assert "␣cat" in heads and "↵↵" in heads and "<|endoftext|>" in heads
    assert any(line.strip().startswith("rank") and "->" in line for line in lines)


def test_cli_json(files, capsys):
    text = "Ça va?  the king 🙂\n"
    for name in ("ours", "gpt2"):
        assert main(["tokenize", "--tokenizer", str(files[name]), "--steps", "--json", text]) == 0
        got = json.loads(capsys.readouterr().out)
        assert list(got) == ["ids", "chunks"] and got["ids"] == Tokenizer.from_file(files[name]).encode(text)
        assert all(list(c) == ["text", "bytes", "merges", "ids"] for c in got["chunks"])
        assert all(list(m) == ["rank", "left", "right"] for c in got["chunks"] for m in c["merges"])
        assert b"".join(bytes(c["bytes"]) for c in got["chunks"]) == text.encode("utf-8")
        assert [i for c in got["chunks"] for i in c["ids"]] == got["ids"]
        assert "".join(c["text"] for c in got["chunks"]) == text


def non_byte_level(kind: str) -> HFTokenizer:
    if kind == "unigram":
        return HFTokenizer(models.Unigram([("<unk>", 0.0), ("▁a", -1.0), ("a", -2.0)], unk_id=0))
    if kind == "wordpiece":
        return HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tk = HFTokenizer(models.BPE({"<unk>": 0, "▁": 1, "a": 2, "▁a": 3}, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()  # SentencePiece-style BPE
    return tk


@pytest.mark.parametrize("kind", ["unigram", "wordpiece", "sentencepiece_bpe"])
def test_non_byte_level_refused(kind, tmp_path, capsys):
    with pytest.raises(UserError, match="byte-level BPE"):
        bpe_steps(non_byte_level(kind), "a")
    non_byte_level(kind).save(str(tmp_path / "tokenizer.json"))
    assert main(["tokenize", "--tokenizer", str(tmp_path), "--steps", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "byte-level BPE" in err and "Traceback" not in err


def test_a_merge_that_makes_a_lower_rank_pair_goes_next():
    """After 'a'+'b' (rank 1) the pair ('ab', 'a') of rank 0 is merged before the second 'a'+'b', as
    `tokenizers` orders merges (minbpe's merge-every-occurrence would give ab, ab)."""
    tk = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "aba": 3}, [("ab", "a"), ("a", "b")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in ["abab", "ababab", "aabab"]:
        assert bpe_steps(tk, text).ids == tk.encode(text).ids
    assert [(m.rank, m.left, m.right) for m in bpe_steps(tk, "abab").chunks[0].merges] == [(1, b"a", b"b"), (0, b"ab", b"a")]
    assert tk.encode("abab").tokens == ["aba", "b"]


@pytest.mark.parametrize("name", ["ours", "gpt2", "llama3"])
@given(text=TEXTS)
def test_encode_with_and_without_bpe_dropout(loaded, files, name, text):
    """encode() is the library's ids with no dropout; with dropout, another segmentation into the same
    vocabulary that decodes to the same text, the same for the same draws."""
    tok, bpe, _ = loaded[name]
    raw = HFTokenizer.from_file(str(files[name]))
    assert bpe.encode(text) == raw.encode(text, add_special_tokens=False).ids
    dropped = bpe.encode(text, 0.3, random.Random(1).random)
    assert dropped == bpe.encode(text, 0.3, random.Random(1).random)
    assert raw.decode(dropped, skip_special_tokens=False) == raw.decode(bpe.encode(text), skip_special_tokens=False)


def test_bpe_dropout_segments_anew_and_leaves_out_merges_at_its_rate(loaded):
    """At p = 0.5 words come out in smaller pieces, differently with other draws; at p close to 1
    almost every chunk stays single bytes."""
    tok, bpe, _ = loaded["ours"]
    text = SAMPLE[:2000]
    whole = bpe.encode(text)
    half = [bpe.encode(text, 0.5, random.Random(s).random) for s in (1, 2)]
    assert half[0] != half[1] and all(len(whole) < len(h) for h in half)
    assert [tok.decode(h) for h in half] == [text, text]
    assert len(bpe.encode(text, 0.999, random.Random(3).random)) > 0.98 * len(text.encode("utf-8"))
