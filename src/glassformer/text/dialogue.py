"""Conversations from the embedded plays' dialogue, for the chat demo (`make chat-demo`).

Within a scene, one speaker's speech is the user's turn and the next speaker's reply the
assistant's, for a few exchanges; the held-out plays (corpus.VAL_WORKS) come last in the JSONL, as
many as `prepare --chat`'s default --val-fraction holds out. docs/chat.md#the-chat-demo.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator

from .corpus import Document, default_corpus, read_text

SPEAKER = re.compile(r"^[A-Z][A-Za-z'&\- ]{0,28}\.$")  # "Hor.", "ROSALIND.", "FIRST LORD."
SCENE = re.compile(r"^(ACT|SCENE)\b", re.IGNORECASE)
DIRECTION = re.compile(r"\[[^\]]*\]", re.DOTALL)  # [Enter Ghost.], [Aside.]
MAX_EXCHANGES = 3  # user/assistant pairs in one conversation
MAX_CHARS = 600  # of content in one conversation: with the demo's tokenizer it fits the chat preset's context
VAL_FRACTION = 0.1  # prepare --chat's default: the share of the JSONL's last conversations it holds out


def speeches(text: str) -> Iterator[tuple[str, str] | None]:
    """(speaker, speech) in order, None at a scene break or any block that is not a speech."""
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [ln.strip() for ln in block.strip().split("\n")]
        if not lines[0] or lines[0].startswith("["):
            continue  # a stage direction: the scene goes on
        if SCENE.match(lines[0]) or not SPEAKER.match(lines[0]) or len(lines) < 2:
            yield None
            continue
        speech = re.sub(r"\s+\n|\n\s+", "\n", DIRECTION.sub("", "\n".join(lines[1:]))).strip()
        yield (lines[0][:-1], speech) if speech else None


def _runs(items: Iterable[tuple[str, str] | None]) -> Iterator[list[str]]:
    """Runs of speeches between breaks, a speaker's speeches split by a direction joined as one."""
    run: list[tuple[str, str]] = []
    for item in [*items, None]:
        if item is None:
            if len(run) >= 2:
                yield [s for _, s in run]
            run = []
        elif run and run[-1][0] == item[0]:
            run[-1] = (item[0], run[-1][1] + "\n" + item[1])
        else:
            run.append(item)


def conversations(text: str) -> Iterator[dict]:
    """{"messages": [...]} dicts: consecutive speeches alternate user and assistant, at most
    MAX_EXCHANGES pairs and MAX_CHARS characters each; a longer speech ends one and is skipped."""
    for run in _runs(speeches(text)):
        turns: list[str] = []
        for speech in [*run, None]:
            fits = speech is not None and sum(map(len, turns)) + len(speech) <= MAX_CHARS
            if not fits or len(turns) == 2 * MAX_EXCHANGES:
                if len(turns) >= 2:
                    pairs = turns[:len(turns) // 2 * 2]
                    yield {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                        for i, t in enumerate(pairs)]}
                turns = [] if speech is None or len(speech) > MAX_CHARS else [speech]
            else:
                turns.append(speech)


def _split_counts(n_train: int, n_val: int) -> tuple[int, int]:
    """(training, held-out) conversations to write, held-out last, so that prepare --chat's split
    (the last round(total * VAL_FRACTION)) takes exactly the held-out ones."""
    n_train = min(n_train, int(n_val * (1 - VAL_FRACTION) / VAL_FRACTION))  # too few held out: train on fewer
    k = next((k for k in range(n_val, 0, -1) if round((n_train + k) * VAL_FRACTION) == k), 0)
    return n_train, k


def _spread(items: list, k: int) -> list:
    """k of the items, evenly spaced (all of them when k >= len)."""
    if k >= len(items):
        return list(items)
    return [items[i * len(items) // k] for i in range(k)]


def _play_docs(docs: list[Document]) -> list[Document]:
    return [d for d in docs if not d.name.endswith("_f.txt")]  # first versions only: folios repeat the plays


def write_jsonl(out: str | Path, train: list[Document] | None = None, val: list[Document] | None = None) -> dict:
    """Write the demo's conversations (default: the embedded plays); returns the counts."""
    if train is None or val is None:
        corpus = default_corpus()
        train, val = corpus.train, corpus.val
    fit = [c for d in _play_docs(train) for c in conversations(read_text(d))]
    held = [c for d in _play_docs(val) for c in conversations(read_text(d))]
    n_train, k = _split_counts(len(fit), len(held))
    fit, held = _spread(fit, n_train), _spread(held, k)  # spread over the plays
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for c in fit + held:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    return {"train": len(fit), "val": len(held), "path": str(out)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m glassformer.text.dialogue OUT.jsonl", file=sys.stderr)
        return 2
    counts = write_jsonl(args[0])
    print(f"wrote {counts['path']}: {counts['train']} training and {counts['val']} held-out conversations "
          f"(the held-out plays' last, for prepare --chat --val-fraction {VAL_FRACTION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
