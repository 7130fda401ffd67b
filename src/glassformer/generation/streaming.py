"""Token ids to text that is safe to print as it arrives: whole UTF-8 characters, stop strings
held back and never printed (docs/generation.md#streaming-text). `glassformer generate` and chat
stream through it."""

from __future__ import annotations

import codecs


class TextStream:
    """Turn token ids into text that is safe to print as they arrive.

    A token's bytes go through an incremental UTF-8 decoder, which keeps an unfinished character
    until later tokens complete it (tokenizers without `id_to_bytes` are decoded whole and an
    unfinished U+FFFD tail held back); text that could start a stop string is held back too, so
    a stop string is never printed (docs/generation.md#streaming-text).
    """

    def __init__(self, tokenizer, stops=()):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.bytes_of = getattr(tokenizer, "id_to_bytes", None)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.text, self.shown, self.done = "", 0, False

    def push(self, token: int) -> str:
        """Add one token; return the text that became printable (maybe empty)."""
        if self.done:
            return ""
        self.ids.append(token)
        if self.bytes_of is not None:
            self.text += self.utf8.decode(self.bytes_of(token))
        else:
            self.text = self.tok.decode(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of generation (up to a stop string, if one came)."""
        if self.bytes_of is not None and not self.done:
            self.text += self.utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self.text
        hits = [i for i in (text.find(s, max(0, self.shown - len(s))) for s in self.stops) if i >= 0]
        if hits:
            self.done, end = True, min(hits)
        elif final or self.done:
            end = len(text)
        else:
            end = len(text) if self.bytes_of is not None else len(text.rstrip("\ufffd"))
            hold = 0
            for s in self.stops:  # hold back a tail that may grow into a stop string
                hold = max([hold] + [k for k in range(1, min(len(s) - 1, end) + 1) if text[end - k:end] == s[:k]])
            end -= hold
        end = max(end, self.shown)
        out, self.shown = text[self.shown:end], end
        return out
