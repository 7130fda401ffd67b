"""Token files and batches: the prepared data folder (tokenizer.json, train.bin and val.bin or
their shards train_000000.bin …, meta.json, COMPLETE) and `get_batch`, deterministic in (seed,
step) across ranks. Shards, worker processes, resuming: docs/data.md#shards.

Documents are joined with the end-of-text token, which stands for zero bytes of text, so
bpb = (sum of per-token losses in nats over val.bin) / (ln 2 * val_bytes). The folder's
files, meta.json's keys and the batch rule: docs/data.md#the-prepared-folder, #batches-glassformertextdata.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import numpy as np
import torch

from ..config import DEFAULT_VOCAB_SIZE, SAMPLINGS, TrainConfig
from ..errors import UserError
from ..files import read_json
from .shards import HEADER_BYTES, ShardSet

DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "uint8": np.uint8}  # uint8: loss masks


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token dtype that holds ids 0 … vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class TokenFile:
    """A read-only memory map of a token file: len(), slicing, and .array (numpy)."""

    def __init__(self, path: str | Path, dtype: str | np.dtype = "uint16"):
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"token file {self.path} does not exist: run `glassformer prepare --out DIR` first")
        self.dtype = np.dtype(DTYPES.get(str(dtype), dtype)).newbyteorder("<")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise UserError(f"{self.path} is {size} bytes, not a whole number of {self.dtype.name} ids: it is damaged; prepare it again")
        # np.memmap cannot map an empty file; an empty split is a plain empty array.
        self.array = np.memmap(self.path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, idx):
        return self.array[idx]

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.dtype.name}, {len(self)} tokens)"


def read_meta(folder: str | Path) -> dict:
    """meta.json of a prepared data folder, checked (check_meta), with a clear error if the folder is not one."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{folder} is not a prepared data folder (no meta.json): run `glassformer prepare --out {folder}`")
    return check_meta(read_json(meta_path, "; prepare the folder again"), meta_path)


TOKEN_DTYPES = ("uint16", "uint32")  # what meta.json's "dtype" may say (uint8 is the masks' alone)
# meta.json's counts: key -> the least value it may hold (present keys are checked; only vocab_size and dtype must be there).
META_COUNTS = {"eot_id": 0, "train_tokens": 0, "val_tokens": 0, "train_bytes": 0, "val_bytes": 0, "context": 1, "block": 2}


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(meta, path: str | Path) -> dict:
    """meta (the JSON in meta.json at path) if what training and eval read from it makes sense: an
    object whose vocab_size is a whole number in 1 … MAX_VOCAB (so a model is never sized from
    nonsense), dtype a token dtype, each count whole and not negative, eot_id a vocabulary id.
    Else a UserError naming the file and the key."""
    from .tokenizer import MAX_VOCAB

    again = f"prepare it again (glassformer prepare --out {Path(path).parent})"
    if not isinstance(meta, dict):
        raise UserError(f"{path} must hold a JSON object of the folder's facts, not a {type(meta).__name__}: {again}")
    vocab = meta.get("vocab_size")
    if not _whole(vocab) or not 1 <= vocab <= MAX_VOCAB:
        raise UserError(f"{path}: vocab_size {vocab!r} must be a whole number from 1 to {MAX_VOCAB}: {again}")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise UserError(f"{path}: dtype {meta.get('dtype')!r} must be {' or '.join(TOKEN_DTYPES)}: {again}")
    for key, least in META_COUNTS.items():
        value = meta.get(key)
        if value is not None and (not _whole(value) or value < least):
            raise UserError(f"{path}: {key} {value!r} must be a whole number of at least {least}: {again}")
    if meta.get("eot_id") is not None and meta["eot_id"] >= vocab:
        raise UserError(f"{path}: eot_id {meta['eot_id']} is not an id of the vocabulary of {vocab}: {again}")
    chat = meta.get("chat")
    if chat is not None and not (isinstance(chat, dict) and isinstance(chat.get("train_on"), str) and "context" in meta):
        raise UserError(f"{path}: \"chat\" must be an object with \"train_on\", beside \"context\": {again}")
    if "shards" in meta:
        check_shard_list(meta, path, again)
    return meta


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_shard_list(meta: dict, path: str | Path, again: str) -> None:
    """A UserError unless meta.json's "shards" is {"train": [...], "val": [...]}, each a non-empty list
    of {"file": a file name in the folder, "tokens": a whole number, "sha256": 64 hex digits}
    whose tokens add up to the split's *_tokens."""
    shards = meta["shards"]
    if not isinstance(shards, dict) or not all(isinstance(shards.get(s), list) and shards[s] for s in ("train", "val")):
        raise UserError(f"{path}: \"shards\" must be an object of non-empty \"train\" and \"val\" lists: {again}")
    for split in ("train", "val"):
        for i, e in enumerate(shards[split]):
            name = e.get("file") if isinstance(e, dict) else None
            if not (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
                    and _whole(e.get("tokens")) and e["tokens"] >= 0
                    and isinstance(e.get("sha256"), str) and SHA256_HEX.fullmatch(e["sha256"])):
                raise UserError(f"{path}: shards.{split}[{i}] must be {{\"file\": a file name in the folder, \"tokens\": "
                                f"a whole number, \"sha256\": 64 hex digits}}, not {e!r:.80}: {again}")
        total, said = sum(e["tokens"] for e in shards[split]), meta.get(f"{split}_tokens")
        if said is not None and said != total:
            raise UserError(f"{path}: the {split} shards count {total} tokens but {split}_tokens is {said}: {again}")


def check_ids(tokens: "TokenFile | ShardSet", vocab_size: int) -> None:
    """A UserError unless every id in the token file (or each shard) is below vocab_size (the model's
    embedding has that many rows). The ids are read a chunk at a time rather than through the memory
    map, so checking a folder holds one chunk (32 MB of uint16) however large the folder is: mapped
    pages, once read, would count in the process's memory until it ends (bench/prepare_throughput.py
    --only-memory; docs/data.md#what-train-checks-in-a-data-folder)."""
    if isinstance(tokens, ShardSet):
        files = [(p, s.dtype, HEADER_BYTES, len(s)) for p, s in zip(tokens.paths, tokens.shards)]
    else:
        files = [(tokens.path, tokens.dtype, 0, len(tokens))]
    for path, dtype, offset, count in files:
        if not count or np.iinfo(dtype).max < vocab_size:  # empty, or no id it can hold is too large
            continue
        top, first = -1, None
        for start, part in _id_chunks(path, dtype, offset, count):
            top = max(top, int(part.max()))
            if first is None and top >= vocab_size:
                first = start + int(np.flatnonzero(part >= vocab_size)[0])
        if first is not None:
            raise UserError(f"{path} holds token id {top} (first bad one at position {first}) but the vocabulary has "
                            f"{vocab_size} ids (0 to {vocab_size - 1}): the file does not belong to this folder's "
                            f"tokenizer; prepare the folder again")


def _id_chunks(path, dtype, offset: int, count: int, chunk: int = 1 << 24):
    """(position, ids) of a token file's `count` ids after `offset` bytes, `chunk` at a time, read with
    plain file reads (no mapping)."""
    with open(path, "rb") as f:
        f.seek(offset)
        done = 0
        while done < count:
            part = np.fromfile(f, dtype=dtype, count=min(chunk, count - done))
            if not len(part):
                raise UserError(f"{path} ends after {done} of the {count} ids it should hold: it was cut short; "
                                f"prepare the folder again")
            yield done, part
            done += len(part)


def check_tokenizer(folder: str | Path, vocab_size: int):
    """The data folder's tokenizer (with its configs), loaded as a checkpoint trained on the folder will
    load it; a UserError unless it loads and has vocab_size ids (meta.json's)."""
    from .tokenizer import Tokenizer

    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json: it is not a prepared data folder; "
                        f"run `glassformer prepare --out {folder}`")
    try:
        tok = Tokenizer.from_folder(folder)
    except UserError as e:
        raise UserError(f"{str(e).splitlines()[0]}: a checkpoint trained on {folder} could not be loaded; "
                        f"prepare the folder again") from None
    if tok.vocab_size != vocab_size:
        raise UserError(f"{path} has {tok.vocab_size} ids but {folder / 'meta.json'} says vocab_size {vocab_size}: "
                        f"the tokenizer is not the one that made the ids; prepare the folder again")
    return tok


def check_prepared(folder: str | Path, splits: tuple[str, ...] = ("train", "val")) -> dict:
    """meta.json of a prepared folder after checking everything a run reads from it, cheapest first:
    meta.json (check_meta), the tokenizer (check_tokenizer), each split's length against meta.json's
    count and its ids against the vocabulary (check_ids). docs/data.md#what-train-checks-in-a-data-folder."""
    folder = Path(folder)
    meta = read_meta(folder)
    check_tokenizer(folder, meta["vocab_size"])
    for split in splits:
        tokens = load_split(folder, split, meta)  # a sharded split: every shard's header read and checked here
        check_split_length(tokens, meta, split)
        check_ids(tokens, meta["vocab_size"])
    return meta


def check_split_length(tokens: "TokenFile | ShardSet", meta: dict, split: str) -> None:
    """A UserError when meta.json counts another number of ids for the split (or for a shard) than its
    file holds, or a shard holds ids of another dtype (a folder copied in part, or files from two folders)."""
    again = "the folder is damaged or mixes two folders' files; prepare it again"
    if isinstance(tokens, ShardSet):
        for path, ids, entry in zip(tokens.paths, tokens.shards, meta["shards"][split]):
            if len(ids) != entry["tokens"]:
                raise UserError(f"{path} holds {len(ids)} ids but meta.json lists {entry['tokens']} for it: {again}")
            if ids.dtype.name != meta["dtype"]:
                raise UserError(f"{path} holds {ids.dtype.name} ids but meta.json says dtype {meta['dtype']}: {again}")
        return  # check_meta found the shards' counts add up to {split}_tokens
    said = meta.get(f"{split}_tokens")
    if said is not None and said != len(tokens):
        raise UserError(f"{tokens.path} holds {len(tokens)} ids but meta.json says {split}_tokens {said}: {again}")


def load_split(folder: str | Path, split: str, meta: dict | None = None) -> "TokenFile | ShardSet":
    """A prepared folder's `train` or `val` split: a TokenFile of {split}.bin, or, where meta.json lists
    "shards", a ShardSet of the split's shards in their order (each header checked as it is mapped).
    meta: the folder's meta.json when already read (else it is read and checked)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    if "shards" not in meta:
        return TokenFile(folder / f"{split}.bin", meta["dtype"])
    paths = [folder / e["file"] for e in meta["shards"][split]]
    for p in paths:
        if not p.is_file():
            raise UserError(f"{p} is listed in {folder / 'meta.json'} but does not exist: the folder was copied in "
                            f"part; copy the rest, or prepare it again")
    return ShardSet(paths)


def load_mask(folder: str | Path, split: str, n_tokens: int) -> TokenFile | None:
    """The uint8 loss mask of a conversation folder's split (None for plain data), checked to be
    aligned with its n_tokens tokens."""
    path = Path(folder) / f"{split}.mask.bin"
    if not path.is_file():
        if "chat" in read_meta(folder) or "block" in read_meta(folder):
            raise UserError(f"{folder} holds conversation or block data but no {path.name}: prepare it again")
        return None
    mask = TokenFile(path, "uint8")
    if len(mask) != n_tokens:
        raise UserError(f"{path} has {len(mask)} entries for {n_tokens} tokens: it is damaged; prepare it again")
    return mask


def chat_block(meta: dict) -> int | None:
    """The window block of a conversation folder (context+1 tokens), or a folder's own "block"
    (the induction demo's repeat blocks, train/induction.py), None for plain data."""
    return meta["context"] + 1 if "chat" in meta else meta.get("block")


def batch_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator seeded by (seed, step) alone, so a batch never depends on earlier draws
    (resuming at step s gives the batch an uninterrupted run would have had).

    The two numbers are mixed with a splitmix64 step so neighbouring (seed, step) pairs do
    not give related streams.
    """
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return torch.Generator().manual_seed(x & 0x7FFFFFFFFFFFFFFF)


def batch_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int, sampling: str) -> torch.Tensor:
    """Start offsets (B,) of the global batch's windows of T+1 tokens in a file of n_tokens. With
    sampling "epochs", an epoch's windows tile the file T tokens apart from the epoch's offset, so
    each token is read once an epoch (`epoch_draws`); with "random", each start is drawn anew from
    anywhere (some text then comes twice in an epoch's worth of windows, other text not at all)."""
    if n_tokens < seq_len + 1:
        raise UserError(f"the token file has {n_tokens} tokens, too few for one window of {seq_len}+1: "
                        f"use a longer corpus or a shorter context")
    if sampling == "epochs":
        n_windows = max(1, (n_tokens - seq_len) // seq_len)
        slack = n_tokens - seq_len - 1 - (n_windows - 1) * seq_len  # room left after the last window: >= T-1 unless tiny
        units, offsets = epoch_draws(n_windows, batch_size, seed, step, slack)  # (B,) each
        return units * seq_len + offsets  # (B,)
    return torch.randint(0, n_tokens - seq_len, (batch_size,), generator=batch_generator(seed, step))  # (B,)


def epoch_draws(n_units: int, batch_size: int, seed: int, step: int, slack: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling without replacement (random reshuffling): the units (B,) of 0 … n_units-1 that
    step `step`'s global batch takes, and their epoch's offset (B,) in 0 … slack. The batches of
    steps 0, 1, 2, … take epoch 0's units in the order of a permutation drawn from (seed, epoch 0),
    then epoch 1's in another, and so on: every unit once an epoch, and still a function of
    (seed, step) alone."""
    j = step * batch_size + torch.arange(batch_size)  # (B,) the global numbers of this batch's windows
    epochs, at = j // n_units, j % n_units  # (B,) each
    units, offsets = torch.empty(batch_size, dtype=torch.int64), torch.empty(batch_size, dtype=torch.int64)
    for e in epochs.unique().tolist():
        here = epochs == e
        offset, order = _epoch(n_units, seed, e, slack)
        units[here], offsets[here] = order[at[here]], offset
    return units, offsets  # (B,) each


@functools.lru_cache(maxsize=8)
def _epoch(n_units: int, seed: int, epoch: int, slack: int) -> tuple[int, torch.Tensor]:
    """(offset, permutation of the units) of one epoch, from the generator of (seed, -1 - epoch), a
    step no batch draws from. The offset moves the windows' boundaries from one epoch to the next."""
    g = batch_generator(seed, -1 - epoch)
    offset = int(torch.randint(0, slack + 1, (1,), generator=g))
    return offset, torch.randperm(n_units, generator=g)


def block_batch_starts(n_tokens: int, block: int, batch_size: int, seq_len: int, seed: int, step: int,
                       sampling: str) -> torch.Tensor:
    """Start offsets (B,) of windows of T+1 tokens drawn at block boundaries (k * block), so a
    window of conversation data begins with a whole conversation; each block start once an epoch
    (sampling "epochs") or drawn anew ("random")."""
    from .conversations import block_starts

    n_starts = block_starts(n_tokens, block, seq_len + 1)
    if n_starts < 1:
        raise UserError(f"the token file has {n_tokens} tokens, too few for one window of {seq_len}+1: "
                        f"use more conversations or a shorter context")
    if sampling == "epochs":
        return epoch_draws(n_starts, batch_size, seed, step)[0] * block  # (B,)
    return torch.randint(0, n_starts, (batch_size,), generator=batch_generator(seed, step)) * block  # (B,)


def document_starts(tokens, eot_id: int, chunk: int = 1 << 24) -> np.ndarray:
    """(D,) int64, ascending: where each document begins in a split of documents joined by eot_id,
    i.e. 0 and every position right after an eot_id (short of the end). One scan, a chunk at a time
    (a byte per id of the chunk, not of the split); the result costs 8 bytes a document."""
    arr = tokens.array if isinstance(tokens, TokenFile) else tokens
    n, parts = len(arr), [np.zeros(1, np.int64)]
    for start in range(0, n, chunk):
        parts.append(np.flatnonzero(np.asarray(arr[start:start + chunk]) == eot_id).astype(np.int64) + (start + 1))
    starts = np.concatenate(parts)  # (D+1,) the last may be n: a split ends with its last document's eot_id
    return starts[starts < n]


def doc_batch_starts(doc_starts: np.ndarray, n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int,
                     sampling: str) -> torch.Tensor:
    """Start offsets (B,) of windows of T+1 tokens that each begin a document (--align-docs): the
    document starts with room for a whole window, each once an epoch in a shuffled order (sampling
    "epochs", `epoch_draws` over them as over windows) or drawn anew ("random"); a function of
    (seed, step) alone, as every batch rule here."""
    n_units = int(np.searchsorted(doc_starts, n_tokens - seq_len - 1, side="right"))  # starts s with s+T+1 <= n
    if n_units < 1:
        raise UserError(f"the token file has {n_tokens} tokens, too few for one window of {seq_len}+1 from a "
                        f"document's start: use a longer corpus or a shorter context")
    if sampling == "epochs":
        units = epoch_draws(n_units, batch_size, seed, step)[0]  # (B,)
    else:
        units = torch.randint(0, n_units, (batch_size,), generator=batch_generator(seed, step))  # (B,)
    return torch.from_numpy(doc_starts[units.numpy()])  # (B,)


def _rows(arr, starts: list[int], n: int) -> np.ndarray:
    """(len(starts), n) int64 rows arr[s:s+n] (arr: numpy, a memory map, a ShardSet or a CPU tensor)."""
    return np.stack([np.asarray(arr[s:s + n], dtype=np.int64) for s in starts])


def get_batch(tokens, batch_size: int, seq_len: int, seed: int, step: int,
              rank: int = 0, world_size: int = 1, device: str | torch.device | None = None,
              mask=None, block: int | None = None, sampling: str = TrainConfig.sampling,
              doc_starts: np.ndarray | None = None):
    """(x, y): this rank's rows of the global batch drawn from (seed, step).

    tokens: a TokenFile, numpy array or 1-D tensor of ids. batch_size is the GLOBAL batch B
    (divisible by world_size); each rank gets B / world_size rows, rank r the rows
    r*B/W … (r+1)*B/W - 1, so concatenating the ranks' x in rank order gives world_size=1's x.
    x, y: int64 (B/W, T), y shifted left one token; mask, block: docs/data.md#conversation-data;
    sampling: "epochs" (each window once an epoch; training's default) or "random" (batch_starts).
    doc_starts: `document_starts` of tokens, to begin every window at a document (--align-docs,
    doc_batch_starts; docs/data.md#batches-from-shards).
    """
    if sampling not in SAMPLINGS:
        raise UserError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0 … world_size-1 (world_size {world_size})")
    if batch_size % world_size:
        raise UserError(f"global batch size {batch_size} is not divisible by {world_size} ranks: choose a multiple of {world_size}")
    arr = tokens.array if isinstance(tokens, TokenFile) else tokens
    if doc_starts is not None:
        if block is not None:
            raise ValueError("windows start at conversation blocks or at documents, not both")
        starts = doc_batch_starts(doc_starts, len(arr), batch_size, seq_len, seed, step, sampling)  # (B,)
    elif block is None:
        starts = batch_starts(len(arr), batch_size, seq_len, seed, step, sampling)  # (B,)
    else:
        starts = block_batch_starts(len(arr), block, batch_size, seq_len, seed, step, sampling)  # (B,)
    per = batch_size // world_size
    mine = starts[rank * per:(rank + 1) * per].tolist()  # (B/W,) only this rank's windows are read
    rows = _rows(arr, mine, seq_len + 1)  # (B/W, T+1)
    # Copied in numpy: torch's copies of (B/W, T) go through its intra-op threads, which on a machine
    # whose cores are busy took 36 ms a batch for 0.03 ms of work (docs/benchmarks-log.md#the-loaders-share-of-a-step).
    x, y = np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])  # (B/W, T) each
    if mask is not None:
        keep = _rows(mask.array if isinstance(mask, TokenFile) else mask, mine, seq_len + 1)[:, 1:]  # (B/W, T)
        y[keep == 0] = -1
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


# -- prepare: corpus -> tokenizer + token files -------------------------------------------
BATCH_CHUNKS = 8  # chunks encoded together (2 MB of text; tokenizers spreads a batch over its threads)


def _chunk_batches(docs, stats, progress):
    """Lists of (text chunk, whether it ends its document), BATCH_CHUNKS at a time, with the
    UTF-8 byte count of each list."""
    from .corpus import iter_text

    batch, nbytes = [], 0
    for doc in docs:
        prev = None
        for chunk in iter_text(doc, stats):
            if prev is not None:
                batch.append((prev, False))
            prev = chunk
            nb = len(chunk.encode("utf-8"))
            nbytes += nb
            if progress is not None:
                progress.update(nb)
            if len(batch) >= BATCH_CHUNKS:
                yield batch, nbytes
                batch, nbytes = [], 0
        if prev is not None:
            batch.append((prev, True))
    if batch:
        yield batch, nbytes


def write_split(tok, docs, path, dtype: str, stats=None, progress=None, dropout: float = 0.0,
                seed: int = 0, append: bool = False, encoders=None, start: tuple | None = None) -> tuple[int, int]:
    """Encode docs into a token file, each document followed by eot_id; (tokens, bytes).

    path: a file for the raw ids, or a sink with write(ids, where) and .tokens (a text/encoding.py
    ShardWriter: shards). dropout > 0: BPE-dropout (`bpe_steps.merge_all` with dropout) in place of
    the tokenizer's own ids, each batch's draws seeded by (seed, the batch's number), so the same
    arguments write the same file. append: add to the file instead of starting it. encoders: an
    entered text/encoding.py Encoders (worker processes) to encode with; else this process's threads.
    start: (batch, offset) to resume at: earlier batches are read (their bytes counted) but not
    encoded, and the first `offset` ids of that batch are dropped (docs/data.md#shards).

    Streams: a few batches of BATCH_CHUNKS text chunks and their ids are in memory at a time, encoded
    by `tokenizers` while this thread reads and writes (docs/data.md#streaming-and-exactness). bytes
    counts the UTF-8 bytes of the text that was encoded (after any U+FFFD replacement), what bits per
    byte divides by; eot counts none.
    """
    from .encoding import Encoders, FileSink

    np_dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
    eot = np.asarray([] if tok.eot_id is None else [tok.eot_id], dtype=np_dtype)
    sink = path if hasattr(path, "write") else FileSink(path, append)
    first, skip = start or (0, 0)
    before, n_bytes = sink.tokens, 0

    def jobs():  # ((number, documents ended), texts, ends) of each batch to encode
        nonlocal n_bytes
        for number, (batch, nb) in enumerate(_chunk_batches(docs, stats, progress)):
            n_bytes += nb
            if number >= first:
                ends = [e for _, e in batch]
                yield (number, sum(ends)), [t for t, _ in batch], ends

    if dropout > 0 or encoders is None:
        encoders = Encoders(tok.tk, eot, 1, _dropout_encoder(tok, dropout, seed, np_dtype, eot) if dropout > 0 else None)
    try:
        for (number, n_docs), ids in encoders.ordered(jobs()):  # ids: (n,) the batch's, in order
            offset = skip if number == first else 0
            sink.write(ids[offset:], (seed, number, offset))
            if hasattr(progress, "add"):
                progress.add(n_docs, len(ids) - offset)
    finally:
        if sink is not path:
            sink.close()
    return sink.tokens - before, n_bytes


def _dropout_encoder(tok, dropout: float, seed: int, np_dtype, eot: np.ndarray):
    """encode(texts, ends, (number, _)) -> ids with BPE-dropout, draws seeded by (seed, number)."""
    from .bpe_steps import ByteLevelBpe

    bpe = ByteLevelBpe(tok)

    def encode(texts: list[str], ends: list[bool], key) -> np.ndarray:
        draw = random.Random(f"{seed}:{key[0]}").random
        parts = []
        for t, last in zip(texts, ends):
            parts.append(np.asarray(bpe.encode(t, dropout, draw), dtype=np_dtype))
            if last:
                parts.append(eot)
        return np.concatenate(parts) if parts else eot[:0]

    return encode


def prepare(corpus, out: str | Path, *, vocab_size: int | None = None, tokenizer=None,
            context: int = 256, tokenizer_sample_mb: float = 256, show_progress: bool | None = None,
            add_chat_tokens: bool = False, bpe_dropout: float = 0.0, dropout_copies: int = 6,
            shard_tokens: int = 0, workers: int | None = 1) -> dict:
    """Write a prepared data folder at `out` (atomically) and return its meta.json.
    corpus: a glassformer.corpus.Corpus. tokenizer: a Tokenizer to reuse; if None, byte-level
    BPE is trained on the training split alone, to vocab_size (default DEFAULT_VOCAB_SIZE). context: the
    longest window a model will draw; both splits must hold context+1 tokens. tokenizer_sample_mb:
    train the tokenizer on about this many MB, taken evenly (docs/data.md#streaming-and-exactness);
    add_chat_tokens: the chat tokens and default template too (docs/data.md#conversation-data).
    bpe_dropout > 0: train.bin holds dropout_copies encodings of the training split, each with
    BPE-dropout of that probability and seeded by its number; val.bin stays the tokenizer's own
    (docs/data.md#bpe-dropout). shard_tokens N > 0: each split as shards of N ids in llm.c's format
    (train_000000.bin, …), resumable after an interruption; 0: one train.bin and val.bin (the
    command's default is 100M: docs/data.md#shards). workers: processes that encode (1: this one;
    None: auto_workers, the cores for a large corpus).
    """
    import sys

    from .encoding import auto_workers, check_shard_tokens, check_workers

    out = Path(out)
    vocab_size, train_size, val_size = _check_prepare(corpus, out, tokenizer, vocab_size, context, tokenizer_sample_mb)
    check_dropout(bpe_dropout, dropout_copies)
    check_shard_tokens(shard_tokens)
    copies = dropout_copies if bpe_dropout > 0 else 1
    workers = auto_workers(copies * train_size + val_size) if workers is None else check_workers(workers)
    job = _PrepareJob(corpus, out, context, bpe_dropout, copies, shard_tokens, workers,
                      None if show_progress is None else not show_progress,  # None: show on a terminal only
                      copies * train_size + val_size, add_chat_tokens)
    make_tokenizer = functools.partial(_make_tokenizer, corpus, tokenizer, vocab_size, tokenizer_sample_mb,
                                       train_size, add_chat_tokens, job.disable)
    meta = job.run_sharded(make_tokenizer, (vocab_size, tokenizer_sample_mb, add_chat_tokens, tokenizer)) \
        if shard_tokens else job.run_single(make_tokenizer)
    if job.stats.warning():
        print(job.stats.warning(), file=sys.stderr)
    return meta


def _make_tokenizer(corpus, tokenizer, vocab_size, sample_mb, train_size, add_chat_tokens, disable) -> tuple:
    """(the tokenizer to encode with, whether it was trained here, the bytes it trained on)."""
    trained, sampled = tokenizer is None, None
    if trained:
        tokenizer, sampled = _train_tokenizer(corpus, vocab_size, sample_mb, train_size, disable)
    if add_chat_tokens:
        chat_ready(tokenizer, True)
    return tokenizer, trained, sampled


def _save_tokenizer(tokenizer, folder: Path, with_configs: bool) -> None:
    if with_configs:
        tokenizer.save_folder(folder)  # with tokenizer_config.json and the template
    else:
        tokenizer.save(folder / "tokenizer.json")


class _PrepareJob:
    """One `prepare` of a text corpus: the arguments its steps share, and the two ways to write the
    folder: whole into a temporary folder renamed in (one file a split), or resumably (shards)."""

    def __init__(self, corpus, out: Path, context: int, dropout: float, copies: int, shard_tokens: int,
                 workers: int, disable, total_bytes: int, add_chat: bool):
        from .corpus import DecodeStats

        self.corpus, self.out, self.context, self.dropout, self.copies = corpus, out, context, dropout, copies
        self.shard_tokens, self.workers, self.disable, self.total_bytes = shard_tokens, workers, disable, total_bytes
        self.add_chat = add_chat
        self.stats = DecodeStats()  # invalid UTF-8 counted while encoding

    def run_single(self, make_tokenizer) -> dict:
        from ..files import atomic_folder

        tokenizer, trained, sampled = make_tokenizer()
        meta = {}

        def write(tmp: Path) -> None:
            _save_tokenizer(tokenizer, tmp, self.add_chat)
            _written_check(tmp, self.out, lambda: check_tokenizer(tmp, tokenizer.vocab_size))  # before the long encoding
            if self.dropout > 0:
                check_dropout_tokenizer(tokenizer)
            counts = _encode_splits(tmp, self.corpus, tokenizer, self.context, self.stats, self.total_bytes,
                                    self.disable, self.dropout, self.copies, workers=self.workers)
            meta.update(self.meta(tokenizer, counts, trained, sampled))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _written_check(tmp, self.out, lambda: check_prepared(tmp))  # what train will check, before the rename

        atomic_folder(self.out, write)
        return meta

    def meta(self, tokenizer, counts: dict, trained: bool, sampled) -> dict:
        meta = _prepared_meta(self.corpus, tokenizer, counts, self.context, trained, sampled, self.stats)
        meta.update(bpe_dropout=self.dropout, dropout_copies=self.copies)
        return meta

    def run_sharded(self, make_tokenizer, asked: tuple) -> dict:
        """Write into .OUT.partial beside out, keeping it (and its whole shards, listed in its progress
        file) when interrupted, so the same command again continues there; renamed to out once whole."""
        import shutil
        import sys

        from .encoding import Progress

        tmp = self.out.parent / f".{self.out.name}.partial"
        tmp.mkdir(parents=True, exist_ok=True)
        progress = Progress.resume(tmp, self.inputs(asked))
        try:
            return self._write_sharded(tmp, progress, make_tokenizer)
        except UserError:
            shutil.rmtree(tmp, ignore_errors=True)  # bad input: the command must change, so nothing is worth keeping
            raise
        except BaseException as e:
            from ..errors import DiskFullError
            from ..files import disk_full

            kept = sum(len(progress.shards(s)) for s in ("train", "val"))
            if not (kept or progress.data["tokenizer"]):
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if disk_full(e):
                raise DiskFullError(f"the disk filled while writing {tmp} ({e.strerror if isinstance(e, OSError) else e}); "
                                    f"its {kept} whole shard(s) are kept: free some space and run the same command "
                                    f"again to continue") from None
            print(f"prepare stopped; {tmp} keeps {kept} whole shard(s) and the tokenizer: the same command "
                  f"continues from them (delete it to start over)", file=sys.stderr)
            raise

    def inputs(self, asked: tuple) -> str:
        """A digest of everything the shards' bytes depend on: an earlier run's progress is used only
        when it is the same (the documents by name and size, the tokenizer or how it is trained, the
        shard size, BPE-dropout and the chunking)."""
        from .corpus import CHUNK_BYTES
        from .encoding import digest

        vocab_size, sample_mb, add_chat, tokenizer = asked
        c = self.corpus
        return digest({"corpus": c.description, "meta": c.meta, "chunking": [CHUNK_BYTES, BATCH_CHUNKS],
                       "docs": [docs.fingerprint() if hasattr(docs, "fingerprint") else [(d.name, d.nbytes) for d in docs]
                                for docs in (c.train, c.val)],  # a row corpus's without another pass
                       "tokenizer": tokenizer.tk.to_str() if tokenizer is not None else [vocab_size, sample_mb],
                       "chat_tokens": add_chat, "shard_tokens": self.shard_tokens,
                       "dropout": [self.dropout, self.copies]})

    def _write_sharded(self, tmp: Path, progress, make_tokenizer) -> dict:
        from ..files import _fsync_files, _swap_in

        tokenizer, trained, sampled = self._tokenizer(tmp, progress, make_tokenizer)
        if self.dropout > 0:
            check_dropout_tokenizer(tokenizer)
        counts = _encode_splits(tmp, self.corpus, tokenizer, self.context, self.stats, self.total_bytes,
                                self.disable, self.dropout, self.copies, workers=self.workers,
                                shard_tokens=self.shard_tokens, progress=progress)
        meta = self.meta(tokenizer, counts, trained, sampled)
        meta.update(shard_tokens=self.shard_tokens, shards={s: progress.shard_list(s) for s in ("train", "val")})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _written_check(tmp, self.out, lambda: check_prepared(tmp))  # what train will check, before the rename
        progress.path.unlink()
        (tmp / "COMPLETE").write_text("ok\n")
        _fsync_files(tmp)
        _swap_in(tmp, self.out)
        return meta

    def _tokenizer(self, tmp: Path, progress, make_tokenizer) -> tuple:
        """make_tokenizer()'s answer, saved in tmp; or, resuming, the one an earlier run of the same
        inputs saved there (training it again could take long)."""
        from .tokenizer import Tokenizer

        saved = progress.data["tokenizer"]
        if saved is not None and (tmp / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_folder(tmp) if saved["chat"] else Tokenizer.from_file(tmp / "tokenizer.json")
            return tokenizer, saved["trained"], saved["sampled"]
        tokenizer, trained, sampled = make_tokenizer()
        _save_tokenizer(tokenizer, tmp, self.add_chat)
        _written_check(tmp, self.out, lambda: check_tokenizer(tmp, tokenizer.vocab_size))  # before the long encoding
        progress.set_tokenizer({"trained": trained, "sampled": sampled, "chat": self.add_chat})
        return tokenizer, trained, sampled


def _written_check(tmp: Path, out: Path, check) -> None:
    """Run one of train's checks on the folder prepare is writing (tmp, renamed to out once whole), its
    errors naming out: a folder train would refuse is never put in place."""
    try:
        check()
    except UserError as e:
        raise UserError(str(e).replace(str(tmp), str(out))) from None


def _check_prepare(corpus, out: Path, tokenizer, vocab_size, context: int, sample_mb: float) -> tuple:
    """(vocab size to train, training bytes, validation bytes), after checking prepare's arguments."""
    from .tokenizer import check_vocab_size

    if out.exists() and not (out / "meta.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not a prepared data folder: choose a new or empty folder")
    if tokenizer is None:
        vocab_size = check_vocab_size(DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size)
    if context < 1:
        raise UserError(f"--context {context} must be at least 1")
    if not sample_mb > 0:
        raise UserError(f"--tokenizer-sample-mb {sample_mb} must be positive")
    from .corpus import split_bytes

    train_size, val_size = split_bytes(corpus.train), split_bytes(corpus.val)  # a row corpus's without a pass
    if train_size == 0 or val_size == 0:
        raise UserError(f"corpus {corpus.description} is empty or has no {'training' if train_size == 0 else 'validation'} text: give more text")
    return vocab_size, train_size, val_size


def _train_tokenizer(corpus, vocab_size: int, sample_mb: float, train_size: int, disable) -> tuple:
    """(byte-level BPE trained on the training split, bytes it trained on): about sample_mb MB,
    a chunk kept whenever the sample is below its share of what was read so far."""
    import sys

    from tqdm import tqdm

    from .corpus import DecodeStats, iter_text
    from .tokenizer import Tokenizer

    share = min(1.0, sample_mb * 1e6 / train_size)
    stats, sampled = DecodeStats(), 0  # these stats are dropped: encoding counts again

    def texts():
        nonlocal sampled
        seen = 0
        for d in corpus.train:
            for chunk in iter_text(d, stats):
                nb = len(chunk.encode("utf-8"))
                seen += nb
                bar.update(nb)
                if sampled <= seen * share:
                    sampled += nb
                    yield chunk

    with tqdm(total=train_size, unit="B", unit_scale=True, desc="tokenizer", disable=disable, file=sys.stderr) as bar:
        tokenizer = Tokenizer.train(texts(), vocab_size)
    return tokenizer, sampled


def check_dropout(p: float, copies: int) -> None:
    """UserError unless 0 <= p < 1 and copies >= 1."""
    if not 0 <= p < 1:
        raise UserError(f"--bpe-dropout {p} must be at least 0 and below 1 (0.05 is a usual choice; 0 turns it off)")
    if int(copies) != copies or copies < 1:
        raise UserError(f"--dropout-copies {copies} must be a whole number of at least 1")


def check_dropout_tokenizer(tokenizer) -> None:
    """UserError unless BPE-dropout can segment with this tokenizer (a byte-level BPE, as ours or GPT-2's)."""
    from .bpe_steps import check_byte_level_bpe

    try:
        check_byte_level_bpe(json.loads(tokenizer.tk.to_str()))
    except UserError as e:
        raise UserError(f"--bpe-dropout needs a byte-level BPE tokenizer: {str(e).split(':')[0]}; "
                        "prepare without --bpe-dropout, or with a tokenizer of ours or GPT-2's kind") from None


def _encode_splits(folder: Path, corpus, tokenizer, context: int, stats, total_bytes: int, disable,
                   dropout: float = 0.0, copies: int = 1, workers: int = 1, shard_tokens: int = 0,
                   progress=None) -> dict:
    """The splits' ids in folder, {split: (tokens, bytes)}, each split checked to hold context+1 tokens:
    train.bin and val.bin, or with progress (text/encoding.py Progress) the shards it sizes, resumed
    where it left off. With dropout, the training split is `copies` BPE-dropout encodings of the text
    one after another (copy k seeded by k), its bytes counted in each. workers: encoding processes."""
    from .encoding import EncodeBar, Encoders

    eot = np.asarray([] if tokenizer.eot_id is None else [tokenizer.eot_id],
                     dtype=np.dtype(DTYPES[dtype_for_vocab(tokenizer.vocab_size)]).newbyteorder("<"))
    with EncodeBar(total_bytes, disable) as bar, Encoders(tokenizer.tk, eot, workers) as encoders:
        counts = {split: _encode_split(folder, split, docs, tokenizer, stats, bar, encoders,
                                       dropout if split == "train" else 0.0, copies if split == "train" else 1,
                                       shard_tokens, progress)
                  for split, docs in (("train", corpus.train), ("val", corpus.val))}
    for split, (n_tok, _) in counts.items():
        if n_tok < context + 1:
            raise UserError(f"the {split} split has {n_tok} tokens, too few for a context of {context} (+1): "
                            f"give a longer corpus or a smaller --context")
    return counts


def _encode_split(folder: Path, split: str, docs, tokenizer, stats, bar, encoders, dropout: float, copies: int,
                  shard_tokens: int, progress) -> tuple[int, int]:
    """(tokens, bytes) of one split written by write_split, copy after copy: into {split}.bin, or
    (progress given) into shards, skipping what progress has finished. Invalid UTF-8 is counted once,
    in the first copy."""
    from .corpus import DecodeStats
    from .encoding import ShardWriter

    dtype = dtype_for_vocab(tokenizer.vocab_size)
    if progress is not None and progress.done(split):
        done = progress.done(split)
        stats.bytes_replaced += done["invalid_bytes"]
        stats.n_files += done["invalid_files"]
        stats.files.extend(done["invalid_names"][:100 - len(stats.files)])
        bar.update(done["bytes"])
        return sum(r["tokens"] for r in progress.shards(split)), done["bytes"]
    sink = folder / f"{split}.bin" if progress is None else ShardWriter(folder, split, dtype, shard_tokens, progress)
    at = None if progress is None else progress.resume_at(split)  # (copy, batch, offset) to continue from
    before = (stats.bytes_replaced, stats.n_files, len(stats.files))
    tokens = nbytes = 0
    try:
        for k in range(copies):
            start = _start_of(at, k)
            t, b = write_split(tokenizer, docs, sink, dtype, stats if k == 0 else DecodeStats(), bar,
                               dropout=dropout, seed=k, append=k > 0, encoders=encoders, start=start)
            tokens, nbytes = tokens + t, nbytes + b
        if progress is None:
            return tokens, nbytes
        sink.close()
    except BaseException:
        if progress is not None:
            sink.abandon()  # only whole shards stay
        raise
    progress.finish(split, nbytes, {"invalid_bytes": stats.bytes_replaced - before[0],
                                              "invalid_files": stats.n_files - before[1],
                                              "invalid_names": stats.files[before[2]:]})
    return sink.tokens, nbytes


def _start_of(at: tuple | None, copy: int) -> tuple | None:
    """write_split's `start` for a copy when the split's stream continues at `at` = (copy, batch, offset)
    (None: from the beginning; (None, None, None): after the last id, its last shard finished)."""
    if at is None or (at[0] is not None and copy > at[0]):
        return None
    if at[0] is None or copy < at[0]:
        return (1 << 62, 0)  # the copy is written whole: read for its byte count, nothing encoded
    return at[1], at[2]


def _prepared_meta(corpus, tokenizer, counts: dict, context: int, trained: bool, sampled, stats) -> dict:
    """meta.json's fields (the module docstring lists them)."""
    return {
        "dtype": dtype_for_vocab(tokenizer.vocab_size), "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
        "train_tokens": counts["train"][0], "val_tokens": counts["val"][0],
        "train_bytes": counts["train"][1], "val_bytes": counts["val"][1],
        "corpus": corpus.description, **corpus.meta,
        "documents": {"train": len(corpus.train), "val": len(corpus.val)},
        "context": context, "tokenizer": "trained" if trained else "given",
        "tokenizer_trained_on_bytes": sampled if trained else None,
        "invalid_utf8_bytes": stats.bytes_replaced, "invalid_utf8_files": stats.files,
    }


# -- prepare --chat: conversations -> tokenizer + token files + loss masks ------------------


def prepare_chat(corpus, out: str | Path, *, tokenizer=None, vocab_size: int | None = None, context: int = 256,
                 train_on: str = "assistant", add_chat_tokens: bool = True) -> dict:
    """Write a prepared folder of conversations at `out` (atomically) and return its meta.json.

    corpus: a conversations.ChatCorpus. tokenizer: one to reuse (its template, else the chat
    tokens added and the default ChatML template); None trains byte-level BPE on the training
    conversations' text. Files and keys: docs/data.md#conversation-data.
    """
    from ..files import atomic_folder
    from .conversations import TRAIN_ON, encode_split, template_sha256

    out = Path(out)
    if train_on not in TRAIN_ON:
        raise UserError(f"--train-on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
    if out.exists() and not (out / "meta.json").is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not a prepared data folder: choose a new or empty folder")
    if context < 1:
        raise UserError(f"--context {context} must be at least 1")
    trained = tokenizer is None
    if trained:
        tokenizer = _train_chat_tokenizer(corpus, vocab_size)
    added = chat_ready(tokenizer, add_chat_tokens)
    packed = {split: encode_split(tokenizer, convs, context, train_on)
              for split, convs in (("train", corpus.train), ("val", corpus.val))}
    _report_packing(packed, train_on, context)
    meta = _chat_meta(corpus, tokenizer, packed, context, trained, train_on, added, template_sha256(tokenizer.chat_template))

    def write(tmp: Path) -> None:
        tokenizer.save_folder(tmp)
        np_dtype = np.dtype(DTYPES[meta["dtype"]]).newbyteorder("<")
        for split, p in packed.items():
            p.ids.astype(np_dtype).tofile(tmp / f"{split}.bin")
            p.mask.tofile(tmp / f"{split}.mask.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _written_check(tmp, out, lambda: check_prepared(tmp))

    atomic_folder(out, write)
    return meta


def chat_ready(tok, add_chat_tokens: bool) -> list[str]:
    """Give a tokenizer without a template the chat tokens and the default ChatML template
    (or, with add_chat_tokens, the chat tokens in any case); the tokens added."""
    from .chat_template import CHATML_TEMPLATE

    added = tok.add_chat_tokens() if add_chat_tokens or tok.chat_template is None else []
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
        tok.chat_templates = {"default": CHATML_TEMPLATE}
    return added


def _train_chat_tokenizer(corpus, vocab_size: int | None):
    """Byte-level BPE trained on the training conversations' message text."""
    from .tokenizer import Tokenizer, check_vocab_size

    vocab_size = check_vocab_size(DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size)
    return Tokenizer.train((m["content"] for c in corpus.train for m in c.messages), vocab_size)


def _report_packing(packed: dict, train_on: str, context: int) -> None:
    """The counted warnings (conversations dropped as too long, conversations with nothing to
    train), and an error when a split is left with nothing to train at all."""
    import sys

    for split, p in packed.items():
        if p.dropped_long:
            print(f"warning: {p.dropped_long} {split} conversation(s) longer than the context of {context} "
                  f"tokens were dropped (a larger --context keeps them)", file=sys.stderr)
        if p.no_assistant and train_on == "assistant":
            print(f"warning: {p.no_assistant} {split} conversation(s) have no assistant turn: none of their tokens "
                  f"are trained (--train-on all trains every token)", file=sys.stderr)
    for split, p in packed.items():
        if not p.mask.any():
            raise UserError(f"the {split} split has no token to train on (every conversation was dropped or has no "
                            f"assistant turn): give more conversations, a larger --context, or --train-on all")


def _chat_meta(corpus, tokenizer, packed: dict, context: int, trained: bool, train_on: str,
               added: list[str], sha: str | None) -> dict:
    """meta.json of a conversation folder: the plain folder's keys (bytes counting the scored
    tokens' text, what bits per byte divides by) plus "chat"."""
    from .conversations import scored_bytes

    from .corpus import DecodeStats

    counts = {s: (len(p.ids), scored_bytes(tokenizer, p.ids, p.mask)) for s, p in packed.items()}
    meta = _prepared_meta(corpus, tokenizer, counts, context, trained, None, DecodeStats())
    meta["chat"] = {"train_on": train_on, "template_sha256": sha, "chat_tokens_added": added,
                    "scored_tokens": {s: int(p.mask.sum()) for s, p in packed.items()},
                    "conversations": {s: p.conversations for s, p in packed.items()},
                    "dropped_too_long": {s: p.dropped_long for s, p in packed.items()},
                    "no_assistant_turn": {s: p.no_assistant for s, p in packed.items()}}
    return meta
