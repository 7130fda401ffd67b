"""The tokenizer against the `tokenizers` library itself and against `transformers`."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from glassformer.errors import UserError
from glassformer.text.tokenizer import EOT, MAX_VOCAB, MIN_VOCAB, Tokenizer, bytes_to_unicode

SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
    "Ça va? Ñandú, Straße, naïve café — 東京, Москва, ελληνικά, 🙂👍🏽, 3.14159 and 1,000,000!\n"
) * 40
PROBES = [
    "", " ", "\n\n\n", "  leading spaces", "trailing spaces   ", "tabs\tand\r\nCRLF",
    "To be, or not to be: that is the question.", "don't won't I'll we've they're",
    "12345678901234567890", "東京タワー", "🙂👍🏽 zero\u200bwidth", "a<|endoftext|>b", "\x00\x01\x7f",
    "ǅ ﬁ ẞ İ", "\ud7ff\ue000\U0010ffff",
]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train([SAMPLE], vocab_size=400)


def llama3_style(vocab_size: int = 400, extra: str = "") -> HFTokenizer:
    """A Llama 3 style tokenizer.json made by `tokenizers`: the Llama 3 split regex, then
    byte-level without its own regex, special tokens <|begin_of_text|> and <|end_of_text|>."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([SAMPLE, extra], trainer=trainer)
    return tk


@given(st.text(max_size=200))
def test_round_trip_on_any_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Each id stands for bytes; together they are exactly the text's UTF-8 bytes.
    assert b"".join(tok.id_to_bytes(i) for i in ids) == text.encode("utf-8")


@given(st.lists(st.sampled_from(PROBES + ["word", " ", "\n", EOT]), max_size=12).map("".join))
def test_round_trip_with_special_token_inside(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_same_ids_as_tokenizers_directly(tok, tmp_path):
    tok.save(tmp_path / "tokenizer.json")
    raw = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json")
    for text in PROBES + [SAMPLE[:3000]]:
        assert ours.encode(text) == raw.encode(text, add_special_tokens=False).ids == tok.encode(text)
        assert ours.decode(ours.encode(text)) == raw.decode(raw.encode(text).ids, skip_special_tokens=False)
    assert ours.encode_batch(PROBES) == [e.ids for e in raw.encode_batch(PROBES, add_special_tokens=False)]
    assert ours.vocab_size == raw.get_vocab_size() and ours.eot_id == raw.token_to_id(EOT)


def test_trained_tokenizer_layout(tok):
    assert tok.eot_id == 0  # the special token is added first
    assert MIN_VOCAB <= tok.vocab_size <= 400
    # Every byte has its own token, so no text is ever unknown.
    assert {tok.id_to_bytes(tok.tk.token_to_id(c)) for c in bytes_to_unicode().values()} == {bytes([b]) for b in range(256)}
    # Frequent words became single tokens.
    assert len(tok.encode(" speak")) == 1
    assert [tok.id_to_piece(i) for i in tok.encode("ø")] == ["\\xc3", "\\xb8"]  # halves of ø, unseen in SAMPLE


def test_transformers_gpt2_style_tokenizer_json_loads_and_encodes_identically(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers.implementations import ByteLevelBPETokenizer

    bl = ByteLevelBPETokenizer()
    bl.train_from_iterator([SAMPLE], vocab_size=350, special_tokens=[EOT], show_progress=False)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bl._tokenizer, eos_token=EOT, bos_token=EOT)
    fast.save_pretrained(tmp_path / "gpt2ish")
    ours = Tokenizer.from_file(tmp_path / "gpt2ish")  # a folder holding tokenizer.json
    for text in PROBES + [SAMPLE[:2000]]:
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == fast.decode(ids)
        assert b"".join(ours.id_to_bytes(i) for i in ids) == text.encode("utf-8")
    assert ours.eot_id == fast.convert_tokens_to_ids(EOT)
    assert ours.vocab_size == len(fast)


def test_llama3_style_tokenizer_json_loads_and_encodes_identically(tmp_path):
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=llama3_style(), bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")
    fast.save_pretrained(tmp_path / "llama3ish")
    ours = Tokenizer.from_file(tmp_path / "llama3ish" / "tokenizer.json")
    for text in PROBES + [SAMPLE[:2000]]:
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids
        assert ours.decode(ids) == text
        assert b"".join(ours.id_to_bytes(i) for i in ids) == text.encode("utf-8")
    assert ours.eot_id == fast.convert_tokens_to_ids("<|end_of_text|>") == 1
    assert ours.id_to_piece(ours.eot_id) == "<|end_of_text|>"


def test_sentencepiece_style_pieces_map_to_bytes():
    """A SentencePiece-style (Llama 2) vocabulary: '▁' is a space, '<0x0A>' a byte."""
    vocab = {"<unk>": 0, "</s>": 1, "<0x0A>": 2, "▁the": 3, "▁": 4, "a": 5}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.add_special_tokens(["</s>"])
    ours = Tokenizer(tk)
    assert ours.id_to_bytes(2) == b"\n" and ours.id_to_bytes(3) == b" the" and ours.id_to_bytes(1) == b"</s>"
    assert ours.eot_id == 1


def test_save_and_reload_is_the_same_tokenizer(tok, tmp_path):
    tok.save(tmp_path / "t.json")
    again = Tokenizer.from_file(tmp_path / "t.json")
    assert json.loads(again.to_str()) == json.loads(tok.to_str())
    assert again.encode(SAMPLE[:500]) == tok.encode(SAMPLE[:500])


@pytest.mark.parametrize("size", [0, 100, MIN_VOCAB - 1, MAX_VOCAB + 1])
def test_vocab_size_out_of_range(size):
    with pytest.raises(UserError, match="out of range"):
        Tokenizer.train(["abc"], vocab_size=size)


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(UserError, match="holds no tokenizer.json"):
        Tokenizer.from_file(tmp_path)


def test_out_of_range_id(tok):
    with pytest.raises(UserError, match="out of range"):
        tok.id_to_piece(tok.vocab_size)


def test_vocab_size_covers_the_largest_id_even_with_gaps():
    tk = HFTokenizer(models.WordLevel(vocab={"a": 0, "[UNK]": 1, "b": 700}, unk_token="[UNK]"))
    assert tk.get_vocab_size() == 3
    assert Tokenizer(tk).vocab_size == 701  # an embedding of 701 rows holds id 700
