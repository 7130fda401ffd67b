"""Byte-level BPE on the `tokenizers` library: train, save and load `tokenizer.json`. Every
string round-trips exactly, any tokenizer.json (GPT-2, Llama 3, SmolLM) encodes as `tokenizers`
does, `<|endoftext|>` (`eot_id`) separates documents: docs/data.md#the-tokenizer-glassformertexttokenizer.
    >>> tok = Tokenizer.train(["to be or not to be"] * 50, vocab_size=300)
    >>> tok.decode(tok.encode("to be, or not?")) == "to be, or not?"
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ..errors import UserError

EOT = "<|endoftext|>"
# End-of-text names used by common tokenizer.json files, in the order we look for them.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
MIN_VOCAB = 256 + 1  # every byte, plus the end-of-text token
MAX_VOCAB = 1 << 20


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte -> a printable character, so byte-level pieces are strings.

    Printable Latin-1 bytes map to themselves; the rest (controls, space) to U+0100 onwards,
    e.g. the space byte 0x20 -> 'Ġ' and newline 0x0A -> 'Ċ'.
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


def resolve_tokenizer_path(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one inside a prepared
    data folder, a checkpoint folder, or a training run folder (its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"tokenizer {path} does not exist: give a tokenizer.json, a prepared data folder or a checkpoint folder")
    if path.is_file():
        return path
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip() / "tokenizer.json").is_file():
        return path / latest.read_text().strip() / "tokenizer.json"
    raise UserError(f"{path} holds no tokenizer.json: give a tokenizer.json, a prepared data folder or a checkpoint folder")


def check_vocab_size(vocab_size: int) -> int:
    if not MIN_VOCAB <= int(vocab_size) <= MAX_VOCAB:
        raise UserError(f"vocabulary size {vocab_size} is out of range: choose {MIN_VOCAB} (256 bytes + end-of-text) to {MAX_VOCAB}")
    return int(vocab_size)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the few things a language model needs from it."""

    def __init__(self, tk):
        self.tk = tk
        # The number of ids a model needs: one past the largest id (a vocabulary may have gaps).
        self.vocab_size: int = max(tk.get_vocab_size(with_added_tokens=True),
                                   max(tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        self.eot_id: int | None = next((tk.token_to_id(t) for t in EOT_CANDIDATES if tk.token_to_id(t) is not None), None)
        self.special_ids: set[int] = {i for i, a in tk.get_added_tokens_decoder().items() if a.special}
        self._byte_level = _uses_byte_level(tk)

    # -- building -----------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, length: int | None = None,
              show_progress: bool = False, special_tokens: tuple[str, ...] = (EOT,)) -> "Tokenizer":
        """Train byte-level BPE on an iterable of strings (streamed: only word counts are kept)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        vocab_size = check_vocab_size(vocab_size)
        tk = HFTokenizer(models.BPE())
        # No normaliser: any normalisation (NFC, lowercasing) would break the exact round trip.
        # add_prefix_space=False: a text's first word is encoded as written.
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
            show_progress=show_progress,
        )
        tk.train_from_iterator(texts, trainer=trainer, length=length)
        return cls(tk)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a tokenizer.json (ours or any Hugging Face one), or the one in a data/checkpoint folder."""
        from tokenizers import Tokenizer as HFTokenizer

        path = resolve_tokenizer_path(path)
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exception on malformed JSON
            raise UserError(f"{path} is not a valid tokenizer.json ({str(e).splitlines()[0][:120]})") from None

    @classmethod
    def from_str(cls, json_text: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(json_text))

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    def to_str(self) -> str:
        return self.tk.to_str()

    # -- using ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any BOS/EOS a template would add (a language model's
        input is the text itself; documents are joined with eot_id by the data pipeline)."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() over many texts, in parallel threads inside `tokenizers`."""
        return [e.ids for e in self.tk.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept, so decode(encode(s)) == s for every s."""
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (a piece may be part of one UTF-8 character)."""
        i = int(i)
        piece = self.tk.id_to_token(i)
        if piece is None:
            raise UserError(f"token id {i} is out of range: this tokenizer has ids 0 to {self.vocab_size - 1}")
        if i in self.special_ids:
            return piece.encode("utf-8")
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        # SentencePiece-style vocabularies: '▁' is a space, '<0x0A>' a raw byte.
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def id_to_piece(self, i: int) -> str:
        """A printable form of token `i`: its text, with bytes that are not whole UTF-8
        characters written as \\xNN (e.g. the first byte of 'é' is '\\xc3')."""
        return self.id_to_bytes(i).decode("utf-8", errors="backslashreplace")

    def pieces(self, text: str) -> list[tuple[int, str]]:
        """(id, piece) for each token of `text`."""
        return [(i, self.id_to_piece(i)) for i in self.encode(text)]

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _uses_byte_level(tk) -> bool:
    """Whether the tokenizer maps bytes through GPT-2's table (a ByteLevel pre-tokenizer or decoder)."""
    spec = json.loads(tk.to_str())

    def has(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(has(v) for v in node.values())
        if isinstance(node, list):
            return any(has(v) for v in node)
        return False

    return has(spec.get("pre_tokenizer")) or has(spec.get("decoder"))

