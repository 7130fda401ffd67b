"""Token labels a reader can see: a space is ␣, a newline ↵, a tab ⇥, a carriage return ␍, and
any other invisible character an escape, so a leading-space or newline token is never an empty box.
One function, shared by `glassformer tokenize --steps` and every token label the explorer draws.

    >>> token_label(" the"), token_label("\\n\\n"), token_label("a\\tb\\r")
    ('␣the', '↵↵', 'a⇥b␍')
    >>> token_label(b"\\xc3"), token_label("\\u00a0")  # half of 'é'; a no-break space
    ('\\\\xc3', '\\\\xa0')
"""

from __future__ import annotations

SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}  # ␣ ↵ ⇥ ␍


def visible_char(c: str) -> str:
    """One character as drawn: its sign in SHOWN, itself when printable, else its Python escape."""
    if c in SHOWN:
        return SHOWN[c]
    return c if c.isprintable() else repr(c)[1:-1]


def token_label(piece: str | bytes) -> str:
    """A token's text with its whitespace drawn; bytes that are not whole UTF-8 characters read \\xNN."""
    if isinstance(piece, (bytes, bytearray)):
        piece = bytes(piece).decode("utf-8", errors="backslashreplace")
    return "".join(visible_char(c) for c in piece)
