"""Conversation data: JSONL reading, encoding with assistant masks (`Tokenizer.apply_chat_template`;
1 where a loss is taken), and packing into blocks of context+1 tokens, each conversation followed
by the end-of-text token, so a window drawn at a block's start holds whole conversations only
(docs/data.md#conversation-data, docs/chat.md#fine-tuning-on-conversations).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from .chat_template import check_messages
TRAIN_ON = ("assistant", "all")


@dataclass
class Conversation:
    messages: list[dict]
    where: str  # "FILE:LINE", for messages about it


@dataclass
class ChatCorpus:
    description: str
    train: list[Conversation]
    val: list[Conversation]
    meta: dict = field(default_factory=dict)


def parse_line(line: str, where: str) -> Conversation:
    """One JSONL line as a Conversation, or a UserError naming `where` (file:line)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or "messages" not in obj:
        raise UserError(f'{where}: no "messages": each line must be {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    check_messages(messages, where)
    return Conversation([{"role": m["role"], "content": m["content"]} for m in messages], where)


def read_jsonl(path: Path, name: str | None = None) -> list[Conversation]:
    """Every non-blank line of a JSONL file as a Conversation."""
    name = name or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 ({e.reason} at byte {e.start})") from None
    return [parse_line(line, f"{name}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def chat_corpus(path: str | Path, val_fraction: float = 0.1) -> ChatCorpus:
    """A JSONL file (its last val_fraction of conversations held out) or a folder of .jsonl files,
    recursive (whole files held out, in an order fixed by a hash of their relative paths, as
    text/corpus.py holds out text files)."""
    path = Path(path)
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be between 0 and 1 (e.g. 0.1)")
    if not path.exists():
        raise UserError(f"--chat {path} does not exist: give a .jsonl file or a folder of them")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    root = path.parent if path.is_file() else path
    per_file = {f: read_jsonl(f, f.relative_to(root).as_posix()) for f in files}
    per_file = {f: c for f, c in per_file.items() if c}
    total = sum(len(c) for c in per_file.values())
    if total < 2:
        raise UserError(f"--chat {path} holds {total} conversation(s): at least 2 are needed (one to hold out)")
    meta = {"val_fraction": val_fraction}
    if len(per_file) == 1:
        (convs,) = per_file.values()
        n_val = min(len(convs) - 1, max(1, round(len(convs) * val_fraction)))
        meta["split"] = f"last {n_val} of {len(convs)} conversations"
        return ChatCorpus(str(path), convs[:-n_val], convs[-n_val:], meta)
    rel = {f: f.relative_to(root).as_posix() for f in per_file}
    order = sorted(per_file, key=lambda f: hashlib.sha256(rel[f].encode()).hexdigest())
    val, held = set(), 0
    for f in order[:-1]:  # at least one file stays in training
        if held >= val_fraction * total:
            break
        val.add(f)
        held += len(per_file[f])
    meta["val_files"] = sorted(rel[f] for f in val)[:1000]
    train = [c for f in per_file if f not in val for c in per_file[f]]
    held_out = [c for f in per_file if f in val for c in per_file[f]]
    return ChatCorpus(str(path), train, held_out, meta)


# -- encoding -------------------------------------------------------------------------------


def encode_conversation(tok, conv: Conversation, train_on: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation under the tokenizer's template; mask 1 where a loss is taken."""
    ids, mask = tok.apply_chat_template(conv.messages, return_assistant_mask=True)
    ids, mask = list(ids), [int(bool(m)) for m in mask]
    return ids, [1] * len(ids) if train_on == "all" else mask


def scored_bytes(tok, ids: np.ndarray, mask: np.ndarray) -> int:
    """UTF-8 bytes of the text the scored tokens stand for (special tokens, like end-of-text, stand for none)."""
    uniq, counts = np.unique(ids[mask.astype(bool)], return_counts=True)
    sizes = [0 if i in tok.special_ids else len(tok.id_to_bytes(i)) for i in uniq.tolist()]
    return int(np.dot(np.asarray(sizes, dtype=np.int64), counts))


@dataclass
class Packed:
    ids: np.ndarray  # (n_blocks * (context+1),) token ids
    mask: np.ndarray  # same shape, uint8: 1 where the token is a scored target
    conversations: int  # kept (not too long)
    dropped_long: int = 0  # longer than the context
    no_assistant: int = 0  # no assistant token under an assistant-only mask (kept, none of it trained)


def pack(encoded: list[tuple[list[int], list[int]]], context: int, eot_id: int) -> tuple[list[int], list[int], int]:
    """Greedy packing into blocks of context+1 tokens: each conversation followed by eot (mask 0),
    a block's unused tail filled with eot (mask 0); a conversation longer than `context` tokens
    is dropped. (ids, mask, number dropped)."""
    block = context + 1
    ids, mask, used, dropped = [], [], 0, 0
    for c_ids, c_mask in encoded:
        n = len(c_ids) + 1  # with its separator
        if n > block:
            dropped += 1
            continue
        if used + n > block:
            ids += [eot_id] * (block - used)
            mask += [0] * (block - used)
            used = 0
        ids += c_ids + [eot_id]
        mask += c_mask + [0]
        used += n
    if used:
        ids += [eot_id] * (block - used)
        mask += [0] * (block - used)
    return ids, mask, dropped


def encode_split(tok, convs: list[Conversation], context: int, train_on: str) -> Packed:
    """Encode and pack one split's conversations."""
    if tok.eot_id is None:
        raise UserError("the tokenizer has no end-of-text token to separate conversations with")
    encoded = [encode_conversation(tok, c, train_on) for c in convs]
    no_assistant = sum(1 for _, m in encoded if not any(m)) if train_on == "assistant" else 0
    ids, mask, dropped = pack(encoded, context, tok.eot_id)
    return Packed(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8), len(encoded) - dropped,
                  dropped, no_assistant)


def template_sha256(template: str | None) -> str | None:
    return None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest()


def block_starts(n_tokens: int, block: int, window: int) -> int:
    """How many block starts k*block leave room for a window of `window` tokens in n_tokens."""
    return 0 if n_tokens < window else (n_tokens - window) // block + 1
