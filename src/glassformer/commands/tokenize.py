"""`glassformer tokenize`: how a text splits into tokens, with ids and byte pieces."""

from __future__ import annotations

HELP = "show the tokens of a text: ids and the bytes each stands for"
NO_DEFAULT = "%(default).0s"  # formats as nothing: keeps the help formatter from adding "(default: None)"


def add_arguments(p) -> None:
    p.add_argument("--tokenizer", required=True,
                   help="a tokenizer.json, a prepared data folder, a checkpoint or run folder" + NO_DEFAULT)
    p.add_argument("text", metavar="TEXT", help="the text to split (use - to read standard input)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table" + NO_DEFAULT)
    p.add_argument("--steps", action="store_true",
                   help="show how byte-level BPE gets there: the chunks, their bytes, each merge in rank order" + NO_DEFAULT)


def run(args) -> int:
    import json

    from ..text.tokenizer import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    text = read_stdin() if args.text == "-" else args.text
    if args.steps:
        from ..text.bpe_steps import bpe_steps

        steps = bpe_steps(tok, text)
        print(json.dumps(steps.to_json(), ensure_ascii=False) if args.json else "\n".join(steps_lines(steps, tok)))
        return 0
    ids = tok.encode(text)
    if args.json:
        print(json.dumps({"ids": ids, "pieces": [tok.id_to_piece(i) for i in ids],
                          "bytes": [list(tok.id_to_bytes(i)) for i in ids]}, ensure_ascii=False))
        return 0
    n_bytes = len(text.encode("utf-8"))
    print(f"{len(ids)} tokens, {n_bytes} bytes ({n_bytes / max(len(ids), 1):.2f} bytes per token), vocabulary {tok.vocab_size}")
    print(f"{'#':>4}  {'id':>7}  {'piece':<20}  bytes")
    for n, i in enumerate(ids):
        raw = tok.id_to_bytes(i)
        piece = _show(tok.id_to_piece(i))
        print(f"{n:>4}  {i:>7}  {piece:<20}  {raw.hex(' ')}")
    return 0


def read_stdin() -> str:
    """Standard input as UTF-8 text (read as bytes: the locale's decoder would let bad bytes through
    as lone surrogates, which no tokenizer encodes)."""
    import sys

    from ..errors import UserError

    raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"standard input is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}): "
                        "give UTF-8 text, or the text itself as TEXT") from None


def _show(piece: str) -> str:
    """The piece in quotes, with newlines, tabs and other invisible characters escaped
    (bytes that are part of a UTF-8 character already read as \\xNN)."""
    return "'" + "".join(c if c.isprintable() else repr(c)[1:-1] for c in piece) + "'"


def steps_lines(steps, tok) -> list[str]:
    """The steps as text: each chunk with its bytes, each merge (rank: left + right -> both), its ids."""
    from ..text.labels import token_label

    out = [f"{len(steps.chunks)} chunks, {len(steps.ids)} tokens (␣ is a space, ↵ a newline)"]
    for n, c in enumerate(steps.chunks, 1):
        kind = "added token, matched whole" if c.added else "bytes " + c.raw.hex(" ")
        out.append(f"[{n}] {token_label(c.raw):<16} {kind}")
        out += [f"      rank {m.rank:>6}:  {token_label(m.left)} + {token_label(m.right)} -> {token_label(m.left + m.right)}"
                for m in c.merges]
        out.append("      ids " + "  ".join(f"{i}={token_label(tok.id_to_bytes(i))}" for i in c.ids))
    out.append("ids " + " ".join(map(str, steps.ids)))
    return out
