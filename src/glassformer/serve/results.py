"""The response objects of the OpenAI-compatible API: log-probabilities in each endpoint's shape,
usage, and the envelope every completion and chunk shares (docs/serve.md#endpoints).

A token's text here is `Tokenizer.id_to_piece`: its bytes as UTF-8, with a byte that is only part
of a character written as \\xNN; chat's `bytes` field gives the exact bytes. An id past the
tokenizer's vocabulary (a padded model vocabulary) has no bytes and the empty text.
"""

from __future__ import annotations

import codecs
import time
import uuid

from ..errors import UserError


def token_bytes(tok, i: int) -> bytes:
    """Token i's bytes; none for an id past the tokenizer's vocabulary (a model's vocabulary is often
    padded past its tokenizer's, and a sampled or top-k id may land there)."""
    try:
        return tok.id_to_bytes(i)
    except UserError:
        return b""


def piece(tok, i: int) -> str:
    """Token i's text as sent: Tokenizer.id_to_piece's form, '' for an id the tokenizer lacks."""
    return token_bytes(tok, i).decode("utf-8", errors="backslashreplace")


class KnownIds:
    """The tokenizer as TextStream reads it, with ids past its vocabulary giving no bytes."""

    def __init__(self, tok):
        self.tok = tok

    def id_to_bytes(self, i: int) -> bytes:
        return token_bytes(self.tok, i)

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def new_id(prefix: str) -> str:
    """A response id: 'cmpl-…' or 'chatcmpl-…' (OpenAI's prefixes)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(rid: str, kind: str, model_id: str, created: int | None = None) -> dict:
    """The fields every response and chunk starts with."""
    return {"id": rid, "object": kind, "created": int(time.time()) if created is None else created, "model": model_id}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's usage object.

    >>> usage(5, 3)
    {'prompt_tokens': 5, 'completion_tokens': 3, 'total_tokens': 8}
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ----------------------------------------------------------------------------- chat's shape


def _chat_entry(tok, token_id: int, logprob: float) -> dict:
    return {"token": piece(tok, token_id), "logprob": logprob, "bytes": list(token_bytes(tok, token_id))}


def chat_logprobs(tok, entries) -> list[dict]:
    """Chat's `logprobs.content`: one {token, logprob, bytes, top_logprobs} per TokenLogprob."""
    return [{**_chat_entry(tok, e.id, e.logprob), "top_logprobs": [_chat_entry(tok, i, lp) for i, lp in e.top]}
            for e in entries]


# ----------------------------------------------------------------------------- completions' shape


class CompletionLogprobs:
    """Completions' `logprobs` {tokens, token_logprobs, top_logprobs, text_offset}, built a token at
    a time. text_offset counts characters of the choice's whole text from `offset` on (the echoed
    prompt, when there is one, starts at 0)."""

    def __init__(self, tok, offset: int = 0):
        self.tok, self.offset = tok, offset
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        """One token: its logprob and top alternatives (None for a prompt's first token, as OpenAI)."""
        self.tokens.append(piece(self.tok, token_id))
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(None if top is None else {piece(self.tok, i): lp for i, lp in top})
        self.text_offset.append(self.offset)
        self.offset += len(self.utf8.decode(token_bytes(self.tok, token_id)))

    def add_prompt(self, ids: list[int], entries) -> None:
        """The echoed prompt: its first token unscored, each later one by the entry that predicts it."""
        if ids:
            self.add(ids[0], None, None)
        for e in entries:
            self.add(e.id, e.logprob, e.top)

    def take(self) -> dict:
        """What was added since the last take (a stream sends each chunk's own tokens)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
