"""`glassformer generate --logprobs K [--json]`: each new token's log-probability and its K most
likely alternatives, read from the logits of the forward that chose it (generation.logprobs.LogitsTap)."""

from __future__ import annotations

import json

import torch

from ..generation.logprobs import LogitsTap, TokenLogprob, logprobs_of


class Scores:
    """Scores of the tokens a Session yields, step by step: one JSON object per token written as it
    comes (json_lines), or kept for a table after the text."""

    def __init__(self, tok, k: int, json_lines: bool, out):
        self.tok, self.k, self.json, self.out = tok, k, json_lines, out
        self.tap = LogitsTap()
        self.records: list[dict] = []

    def listening(self) -> LogitsTap:
        """The recorder to hold installed while the session runs (a context manager)."""
        return self.tap

    def step(self, toks: list) -> None:
        """One step's tokens (None for rows that have stopped), scored by that step's forward."""
        logits = self.tap.logits.popleft()  # (B, V): the forward that chose these tokens
        rows = [b for b, t in enumerate(toks) if t is not None]
        if not rows:
            return
        chosen = torch.tensor([toks[b] for b in rows])  # (n,)
        for b, e in zip(rows, logprobs_of(logits[rows], chosen, self.k)):
            record = self.record(b, e)
            if self.json:
                self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.out.flush()
            else:
                self.records.append(record)

    def record(self, row: int, e: TokenLogprob) -> dict:
        """{"row", "id", "token", "bytes", "logprob", "top": [{"id", "token", "logprob"}]}: token is the
        printable piece (bytes that are not whole UTF-8 characters as \\xNN), bytes its bytes as ints."""
        piece = self.tok.id_to_piece
        return {"row": row, "id": e.id, "token": piece(e.id), "bytes": list(self.tok.id_to_bytes(e.id)),
                "logprob": e.logprob, "top": [{"id": i, "token": piece(i), "logprob": lp} for i, lp in e.top]}

    def write_table(self) -> None:
        """The kept records as a table: row, id, token, logprob, then the alternatives."""
        self.out.write("=== log-probabilities (raw distribution) ===\n")
        self.out.write(f"{'row':>3} {'id':>6}  {'token':<16} {'logprob':>9}  top\n")
        for r in self.records:
            top = "  ".join(f"{json.dumps(t['token'], ensure_ascii=False)} {t['logprob']:.4f}" for t in r["top"])
            token = json.dumps(r["token"], ensure_ascii=False)
            self.out.write(f"{r['row']:>3} {r['id']:>6}  {token:<16} {r['logprob']:>9.4f}  {top}\n")
