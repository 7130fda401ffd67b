"""The inputs every research routine checks the same way: a single answer token, and two texts of
equal token length, each refused with one line that shows what the tokenizer made of it."""

from __future__ import annotations

import re

from ..errors import UserError


def pieces(tokenizer, ids: list[int]) -> list[str]:
    """How each token reads (the tokenizer's piece; '#id' without one or for an id it cannot show)."""
    out = []
    for i in ids:
        try:
            out.append(tokenizer.id_to_piece(i) if hasattr(tokenizer, "id_to_piece") else tokenizer.decode([i]))
        except Exception:  # an id past the tokenizer's vocabulary (a padded head)
            out.append(f"#{i}")
    return out


def token_id(tokenizer, text: str, flag: str, vocab_size: int) -> int:
    """The id of `text` as one token, or of '#ID' written out; a text that is not one token is
    refused, showing how it splits.

    >>> token_id(None, "#7", "--answer", 10)
    7
    """
    if not isinstance(text, str) or text == "":
        raise UserError(f"{flag} is empty: give one token (or #ID)")
    if re.fullmatch(r"#\d+", text):
        i = int(text[1:])
        if i >= vocab_size:
            raise UserError(f"{flag} {text}: the model's vocabulary has ids 0..{vocab_size - 1}")
        return i
    if tokenizer is None:
        raise UserError(f"{flag} {text!r}: this model has no tokenizer, so give the token as #ID")
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise UserError(f"{flag} {text!r} is {len(ids)} tokens, {pieces(tokenizer, ids)}, not one: "
                        f"give a single token (or #ID)")
    if ids[0] >= vocab_size:
        raise UserError(f"{flag} {text!r} is id {ids[0]}, past the model's {vocab_size} logits")
    return ids[0]


def encode(tokenizer, text: str, flag: str, max_len: int) -> list[int]:
    """`text`'s ids, not empty and within the model's context."""
    if tokenizer is None:
        raise UserError(f"{flag}: this model has no tokenizer.json, so text cannot be turned into tokens")
    ids = tokenizer.encode(text)
    if not ids:
        raise UserError(f"{flag} is empty: give a text of at least one token")
    if len(ids) > max_len:
        raise UserError(f"{flag} is {len(ids)} tokens; this model reads at most {max_len}: shorten it")
    return ids


def encode_texts(tokenizer, texts: list[str], what: str, max_len: int) -> list[list[int]]:
    """Each text's ids; one line naming `what` and the text's number for an empty or too long one."""
    if not texts:
        raise UserError(f"{what} holds no text (one text per line)")
    rows = []
    for n, t in enumerate(texts, 1):
        ids = tokenizer.encode(t)
        if not ids:
            raise UserError(f"{what}, text {n} encodes to no tokens: give some text")
        if len(ids) > max_len:
            raise UserError(f"{what}, text {n} is {len(ids)} tokens; this model reads at most {max_len}: shorten it")
        rows.append(ids)
    return rows


def same_length(tokenizer, clean: list[int], corrupt: list[int]) -> None:
    """Refuse two texts of different token lengths (a patch moves activations position by position),
    showing both tokenizations."""
    if len(clean) != len(corrupt):
        raise UserError(f"the clean and corrupt texts must have the same number of tokens: clean is {len(clean)} "
                        f"{pieces(tokenizer, clean)}, corrupt is {len(corrupt)} {pieces(tokenizer, corrupt)}")
