"""Byte-level BPE one step at a time, ending in exactly the ids of the `tokenizers` library:
added (special) tokens are cut out first, the rest goes through the tokenizer's own normalizer
and pre-tokenizer into chunks, each chunk is its UTF-8 bytes, and then each BPE merge is
applied in rank order until no neighbouring pair is a merge; the pieces left are the ids.
Works for ours (text/tokenizer.py) and any GPT-2-style tokenizer.json: docs/data.md#tokenizer-steps.

    >>> from glassformer.text.tokenizer import Tokenizer
    >>> tok = Tokenizer.train(["the cat saw the hat"] * 20, vocab_size=268)
    >>> s = bpe_steps(tok, "the hat<|endoftext|>")
    >>> s.ids == tok.encode("the hat<|endoftext|>")
    True
    >>> [c.text for c in s.chunks]
    ['the', ' hat', '<|endoftext|>']
    >>> [(m.rank, m.left, m.right) for m in s.chunks[1].merges]
    [(0, b'a', b't'), (5, b'h', b'at'), (9, b' ', b'hat')]
    >>> s.chunks[1].ids == [tok.tk.token_to_id('Ġhat')]  # GPT-2's alphabet writes the space Ġ
    True
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..errors import UserError
from .tokenizer import bytes_to_unicode

BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}


@dataclass(frozen=True)
class Merge:
    """One merge applied: the pair (left, right) of rank `rank` became one piece."""
    rank: int
    left: bytes
    right: bytes


@dataclass
class Chunk:
    """One pre-tokenizer chunk (or one added token, matched whole) and how it became ids."""
    text: str
    raw: bytes
    merges: list[Merge] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    added: bool = False


@dataclass
class Steps:
    ids: list[int]
    chunks: list[Chunk]

    def to_json(self) -> dict:
        """{"ids", "chunks": [{"text", "bytes", "merges": [{"rank", "left", "right"}], "ids"}]};
        left/right are text, bytes that are not whole UTF-8 characters written \\xNN."""
        return {"ids": self.ids, "chunks": [
            {"text": c.text, "bytes": list(c.raw),
             "merges": [{"rank": m.rank, "left": _text(m.left), "right": _text(m.right)} for m in c.merges],
             "ids": c.ids} for c in self.chunks]}


def bpe_steps(tokenizer, text: str) -> Steps:
    """The steps from `text` to its ids (`tokenizer`: ours or a `tokenizers.Tokenizer`)."""
    return ByteLevelBpe(tokenizer).steps(text)


# ----------------------------------------------------------------------------- the merges


def merge_all(symbols: list[str], ranks: dict[tuple[str, str], int], dropout: float = 0.0,
              draw=None) -> tuple[list[str], list[tuple[int, str, str]]]:
    """Merge the neighbouring pair of lowest rank (the leftmost on a tie) until no pair is a
    merge, as `tokenizers` does; returns the pieces left and each (rank, left, right) merged.

    dropout > 0 is BPE-dropout (Provilkov et al. 2020, arXiv:1910.13267): at each merge step every
    merge the pieces allow is left out with that probability (`draw()` is uniform in [0, 1)), and
    it stops when every one is left out: another segmentation of the same bytes into tokens of the
    same vocabulary.

    >>> merge_all(list("aaab"), {("a", "a"): 0, ("a", "b"): 1})
    (['aa', 'ab'], [(0, 'a', 'a'), (1, 'a', 'b')])
    >>> merge_all(list("aaab"), {("a", "a"): 0, ("a", "b"): 1}, 0.6, iter([0.1, 0.9, 0.0]).__next__)[0]
    ['a', 'aa', 'b']
    """
    symbols, done = list(symbols), []
    while True:
        found = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:]))
                 if pair in ranks and not (dropout > 0 and draw() < dropout)]
        if not found:
            return symbols, done
        rank, i = min(found)
        done.append((rank, symbols[i], symbols[i + 1]))
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]  # two pieces -> one


def merge_ranks(merges: list, vocab: dict[str, int]) -> dict[tuple[str, str], int]:
    """(left, right) -> rank from tokenizer.json's merges ("a b" strings or [a, b] pairs); as in
    `tokenizers`, a pair listed twice keeps its last rank.

    >>> merge_ranks(["a b", ["ab", "c"]], {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4})
    {('a', 'b'): 0, ('ab', 'c'): 1}
    """
    ranks = {}
    for rank, m in enumerate(merges):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        if left in vocab and right in vocab and left + right in vocab:
            ranks[(left, right)] = rank
    return ranks


# ----------------------------------------------------------------------------- added tokens


def _is_space(c: str) -> bool:
    """Rust's char::is_whitespace (Python's isspace also counts the separators U+001C-U+001F)."""
    return c.isspace() and not "\x1c" <= c <= "\x1f"


# Letters outside the categories L and M that Unicode still counts Alphabetic (circled, squared Latin).
_OTHER_ALPHABETIC = (("\u24b6", "\u24e9"), ("\U0001f130", "\U0001f149"), ("\U0001f150", "\U0001f169"),
                     ("\U0001f170", "\U0001f189"))


def _is_word(c: str) -> bool:
    """Rust regex's \\w, which `tokenizers` tests single_word with: Alphabetic, marks, decimal
    digits, connectors, joiners (Python's \\w differs: no marks, but digits like '²')."""
    cat = unicodedata.category(c)
    return (cat[0] in "LM" or cat in ("Nd", "Nl", "Pc") or c in "\u200c\u200d"
            or any(lo <= c <= hi for lo, hi in _OTHER_ALPHABETIC))


def split_added(text: str, tokens: dict[str, tuple[int, object]]) -> list[tuple[str, int | None]]:
    """`text` cut around the added tokens in it (content -> (id, AddedToken)), leftmost-longest
    as `tokenizers` matches them: single_word needs no word character beside the match, lstrip
    and rstrip take the whitespace beside it. Pieces that are no token have id None.

    >>> split_added("a<s>b", {"<s>": (7, None)})
    [('a', None), ('<s>', 7), ('b', None)]
    """
    if not tokens or not text:
        return [(text, None)]
    pattern = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
    out, offset = [], 0
    for m in pattern.finditer(text):
        start, stop = m.span()
        tid, added = tokens[m.group()]
        if getattr(added, "single_word", False) and (
                (start > 0 and _is_word(text[start - 1])) or (stop < len(text) and _is_word(text[stop]))):
            continue
        if getattr(added, "lstrip", False):
            while start > offset and _is_space(text[start - 1]):
                start -= 1
        if getattr(added, "rstrip", False):
            while stop < len(text) and _is_space(text[stop]):
                stop += 1
        if offset < start:
            out.append((text[offset:start], None))
        out.append((text[start:stop], tid))
        offset = stop
    if offset < len(text):
        out.append((text[offset:], None))
    return out


# ----------------------------------------------------------------------------- the tokenizer's parts


def _has_byte_level(node) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_has_byte_level(v) for v in node.values())
    return isinstance(node, list) and any(_has_byte_level(v) for v in node)


def check_byte_level_bpe(spec: dict) -> dict:
    """The BPE model of a tokenizer.json, or a UserError saying why its steps cannot be shown."""
    model = spec.get("model") or {}
    kind = model.get("type") or ("BPE" if "merges" in model else "unknown")
    if kind != "BPE":
        raise UserError(f"this is a {kind} tokenizer: --steps shows byte-level BPE merges only "
                        "(tokenizers like GPT-2's or ours); drop --steps to see its tokens")
    if not (_has_byte_level(spec.get("pre_tokenizer")) or _has_byte_level(spec.get("normalizer"))):
        raise UserError("this BPE tokenizer is not byte-level (no ByteLevel pre-tokenizer, e.g. SentencePiece-style "
                        "BPE): --steps shows byte-level BPE only; drop --steps to see its tokens")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise UserError("this BPE tokenizer marks word pieces (continuing_subword_prefix/end_of_word_suffix): "
                        "--steps shows GPT-2-style byte-level BPE only; drop --steps to see its tokens")
    if model.get("dropout"):
        raise UserError("this BPE tokenizer uses dropout, so its merges are random: "
                        "set model.dropout to null in its tokenizer.json to see its steps")
    return model


def _bytes(piece: str) -> bytes:
    """A piece in GPT-2's byte alphabet back to its bytes (any other character as its UTF-8)."""
    return b"".join(bytes([BYTE_OF_CHAR[c]]) if c in BYTE_OF_CHAR else c.encode("utf-8") for c in piece)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="backslashreplace")


class ByteLevelBpe:
    """What the steps read from a tokenizer: its BPE vocabulary, merge ranks and flags from
    tokenizer.json, its normalizer and pre-tokenizer objects, its added tokens."""

    def __init__(self, tokenizer):
        self.tk = tk = getattr(tokenizer, "tk", tokenizer)  # ours wraps a tokenizers.Tokenizer
        model = check_byte_level_bpe(json.loads(tk.to_str()))
        self.vocab: dict[str, int] = model["vocab"]
        self.ranks = merge_ranks(model.get("merges") or [], self.vocab)
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.unk, self.fuse_unk = model.get("unk_token"), bool(model.get("fuse_unk"))
        self.byte_fallback = bool(model.get("byte_fallback"))
        added = [(i, a) for i, a in sorted(tk.get_added_tokens_decoder().items())
                 if a.content and not (a.special and tk.encode_special_tokens)]
        norm = tk.normalizer.normalize_str if tk.normalizer is not None else (lambda s: s)
        self.normalize = norm
        # Tokens matched in the raw text, and those matched after the normalizer (normalized=True).
        self.raw_tokens = {a.content: (i, a) for i, a in added if not a.normalized}
        self.normalized_tokens = {norm(a.content): (i, a) for i, a in added if a.normalized and norm(a.content)}

    def steps(self, text: str) -> Steps:
        chunks = [Chunk(piece, piece.encode("utf-8"), [], [tid], added=True) if tid is not None else self.chunk(piece)
                  for piece, tid in self.pieces(text)]
        return Steps([i for c in chunks for i in c.ids], chunks)

    def encode(self, text: str, dropout: float = 0.0, draw=None) -> list[int]:
        """The ids of `text`: the tokenizer's own (dropout 0), or a BPE-dropout segmentation of it
        (`merge_all`'s dropout, drawing from `draw`, e.g. a seeded random.Random's .random) that
        decodes to the same text."""
        ids: list[int] = []
        for piece, tid in self.pieces(text):
            ids.extend([tid] if tid is not None else self.chunk_ids(piece, dropout, draw))
        return ids

    def chunk_ids(self, piece: str, dropout: float = 0.0, draw=None) -> list[int]:
        """`chunk(piece).ids` without the record of its merges (prepare's BPE-dropout runs this per chunk)."""
        if self.ignore_merges and piece in self.vocab:
            return [self.vocab[piece]]
        return [self.vocab[p] for p in merge_all(self.initial_symbols(piece), self.ranks, dropout, draw)[0]]

    def pieces(self, text: str) -> Iterator[tuple[str, int | None]]:
        """`text` as the model sees it: (added token, its id) matched whole, and (pre-tokenizer chunk, None)."""
        for piece, tid in split_added(text, self.raw_tokens):
            if tid is not None:
                yield piece, tid
                continue
            for part, tid in split_added(self.normalize(piece), self.normalized_tokens):
                if tid is not None:
                    yield part, tid
                else:
                    yield from ((c, None) for c in self.pre_tokenize(part))

    def pre_tokenize(self, part: str) -> list[str]:
        if self.tk.pre_tokenizer is None:
            return [part] if part else []
        return [c for c, _ in self.tk.pre_tokenizer.pre_tokenize_str(part) if c]

    def chunk(self, piece: str) -> Chunk:
        """One chunk (in GPT-2's byte alphabet) through the BPE model."""
        raw = _bytes(piece)
        if self.ignore_merges and piece in self.vocab:  # a chunk that is a token stays one
            return Chunk(_text(raw), raw, [], [self.vocab[piece]])
        pieces, done = merge_all(self.initial_symbols(piece), self.ranks)
        merges = [Merge(rank, _bytes(left), _bytes(right)) for rank, left, right in done]
        return Chunk(_text(raw), raw, merges, [self.vocab[p] for p in pieces])

    def initial_symbols(self, piece: str) -> list[str]:
        """One symbol per character; one the vocabulary lacks becomes its <0xNN> bytes
        (byte_fallback), the unknown token (fused into one with fuse_unk), or nothing."""
        out, last_unk = [], False
        for c in piece:
            if c in self.vocab:
                out.append(c)
                last_unk = False
            elif self.byte_fallback and all(f"<0x{b:02X}>" in self.vocab for b in c.encode("utf-8")):
                out.extend(f"<0x{b:02X}>" for b in c.encode("utf-8"))
                last_unk = False
            elif self.unk is not None and self.unk in self.vocab:
                if not (self.fuse_unk and last_unk):
                    out.append(self.unk)
                last_unk = True
        return out
