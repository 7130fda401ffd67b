"""Token shards in llm.c's format, and a set of shards read as one array.

A shard is a header of 256 little-endian int32 followed by the ids: header[0] is the magic,
header[1] the version, header[2] the number of ids after the header. The two formats are llm.c's
and modded-nanogpt's own (llm.c's dev/data/data_common.py): ids below 65,536 as uint16 (magic
20240520, version 1, "gpt-2"), larger vocabularies as uint32 (magic 20240801, version 7,
"llama-3"). So a folder prepared with `--shard-tokens` trains there unchanged, and their shards
train here. docs/data.md#shards.

`ShardSet` maps every shard of a split and reads them as one run of ids (a window that crosses a
shard's end continues in the next), so the batch rule of text/data.py (`get_batch`) draws from it
exactly as from one file: the same (seed, step) gives the same global batch at any world size.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ..errors import UserError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# dtype name -> (magic, version), llm.c's HEADERS_INFO
FORMATS = {"uint16": (20240520, 1), "uint32": (20240801, 7)}
MAX_IDS = 2**31 - 1  # header[2] is an int32


def header(n_ids: int, dtype: str) -> np.ndarray:
    """The 256-int32 header of a shard of n_ids ids of `dtype` ('uint16' or 'uint32')."""
    if dtype not in FORMATS:
        raise ValueError(f"a shard holds uint16 or uint32 ids, not {dtype}")
    if not 0 <= n_ids <= MAX_IDS:
        raise ValueError(f"a shard holds at most {MAX_IDS} ids (its header counts them in an int32); got {n_ids}")
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[0], h[1] = FORMATS[dtype]
    h[2] = n_ids
    return h


def write_shard(path: str | Path, ids: np.ndarray, dtype: str) -> None:
    """Write ids as one shard (header, then the ids little-endian)."""
    ids = np.asarray(ids)
    with open(path, "wb") as f:
        f.write(header(len(ids), dtype).tobytes())
        f.write(ids.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())


def read_header(path: str | Path) -> tuple[str, int]:
    """(dtype, number of ids) of a shard, checked against its size; a UserError naming the file and
    what is wrong (not a shard, an unknown format, a count its size disagrees with)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise UserError(f"{path} is {size} bytes, shorter than a shard's {HEADER_BYTES}-byte header: it is not a "
                        f"token shard or was cut short; prepare it again")
    h = np.fromfile(path, dtype="<i4", count=3)
    formats = {v: k for k, v in FORMATS.items()}
    dtype = formats.get((int(h[0]), int(h[1])))
    if dtype is None:
        raise UserError(f"{path} has magic {int(h[0])} version {int(h[1])}, not a token shard's "
                        f"(20240520 version 1 for uint16 ids, 20240801 version 7 for uint32): prepare it again")
    n, item = int(h[2]), np.dtype(dtype).itemsize
    if n < 0 or HEADER_BYTES + n * item != size:
        raise UserError(f"{path}'s header counts {n} ids ({HEADER_BYTES + max(n, 0) * item} bytes with the header) "
                        f"but the file is {size} bytes: it is damaged or was cut short; prepare it again")
    return dtype, n


def read_shard(path: str | Path) -> np.ndarray:
    """A read-only memory map of a shard's ids (checked by read_header)."""
    dtype, n = read_header(path)
    if n == 0:
        return np.zeros(0, dtype=np.dtype(dtype).newbyteorder("<"))
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=HEADER_BYTES, shape=(n,))


def sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    """The file's sha256 in hex (meta.json lists one per shard)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_name(split: str, index: int) -> str:
    """train_000000.bin, val_000003.bin, …"""
    return f"{split}_{index:06d}.bin"


class ShardSet:
    """Several shards read as one array of ids: len(), integer and slice reads (step 1), `.array`
    (itself, as a TokenFile offers), `.paths`. A slice that crosses a shard's end is joined."""

    def __init__(self, paths: list[str | Path]):
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise UserError("a split with no shards: prepare the folder again")
        self.shards = [read_shard(p) for p in self.paths]
        dtypes = {s.dtype.name for s in self.shards if len(s)}
        if len(dtypes) > 1:
            raise UserError(f"the shards {', '.join(str(p) for p in self.paths)} mix {' and '.join(sorted(dtypes))} "
                            f"ids: they come from two preparations; prepare the folder again")
        self.dtype = self.shards[0].dtype
        self.ends = np.cumsum([len(s) for s in self.shards])  # (shards,) where each shard's ids end

    @property
    def array(self) -> "ShardSet":
        return self

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, idx):
        n = len(self)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(n)
            if step != 1:
                raise ValueError("a ShardSet reads slices with step 1")
            return self._read(start, max(start, stop))
        i = int(idx) + (n if idx < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"id {idx} of {n}")
        return self._read(i, i + 1)[0]

    def _read(self, start: int, stop: int) -> np.ndarray:
        k = int(np.searchsorted(self.ends, start, side="right"))  # the shard holding `start`
        parts = []
        while start < stop:
            first = int(self.ends[k - 1]) if k else 0
            take = min(stop, int(self.ends[k])) - start
            parts.append(self.shards[k][start - first:start - first + take])
            start += take
            k += 1
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __repr__(self) -> str:
        return f"ShardSet({len(self.paths)} shards, {self.dtype.name}, {len(self)} tokens)"
