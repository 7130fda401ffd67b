"""Token files and batches.

A prepared data folder (`glassformer prepare --out DIR`) holds

    tokenizer.json   the tokenizer that made the ids
    train.bin        raw little-endian token ids, uint16 when the vocabulary fits, else uint32
    val.bin          the held-out split, same format
    meta.json        {"dtype", "vocab_size", "eot_id", "train_tokens", "val_tokens",
                      "train_bytes", "val_bytes", "corpus", "val_works" or "val_fraction", ...}
    COMPLETE         written last (the folder is written under a temporary name and renamed)

Documents are joined with the end-of-text token, which stands for zero bytes of text:
`val_bytes` is the UTF-8 size of the validation text itself, so a model's bits per byte is
    bpb = (sum of per-token losses in nats over val.bin) / (ln 2 * val_bytes).

Batches (design.md, Determinism): `get_batch(tokens, B, T, seed, step, rank, world_size)`
draws the start of every row of the global batch from a generator seeded by (seed, step),
then returns rank `rank`'s rows, so N ranks together see exactly what one process would.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .errors import UserError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


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
    """meta.json of a prepared data folder, with a clear error if the folder is not one."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"{folder} is not a prepared data folder (no meta.json): run `glassformer prepare --out {folder}`")
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{meta_path} is not valid JSON ({e}); prepare the folder again") from None


def load_split(folder: str | Path, split: str) -> TokenFile:
    """TokenFile of a prepared folder's `train` or `val` split."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    meta = read_meta(folder)
    return TokenFile(Path(folder) / f"{split}.bin", meta["dtype"])


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


def batch_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets (B,) of the global batch's windows of T+1 tokens in a file of n_tokens."""
    if n_tokens < seq_len + 1:
        raise UserError(f"the token file has {n_tokens} tokens, too few for one window of {seq_len}+1: "
                        f"use a longer corpus or a shorter context")
    return torch.randint(0, n_tokens - seq_len, (batch_size,), generator=batch_generator(seed, step))  # (B,)


def get_batch(tokens, batch_size: int, seq_len: int, seed: int, step: int,
              rank: int = 0, world_size: int = 1, device: str | torch.device | None = None):
    """(x, y): this rank's rows of the global batch drawn from (seed, step).

    tokens: a TokenFile, numpy array or 1-D tensor of ids. batch_size is the GLOBAL batch B
    (divisible by world_size); each rank gets B / world_size rows, rank r the rows
    r*B/W … (r+1)*B/W - 1, so concatenating the ranks' x in rank order gives world_size=1's x.
    x, y: int64 tensors (B/W, T); y is x shifted left by one token (the next-token targets).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0 … world_size-1 (world_size {world_size})")
    if batch_size % world_size:
        raise UserError(f"global batch size {batch_size} is not divisible by {world_size} ranks: choose a multiple of {world_size}")
    arr = tokens.array if isinstance(tokens, TokenFile) else tokens
    starts = batch_starts(len(arr), batch_size, seq_len, seed, step)  # (B,)
    per = batch_size // world_size
    mine = starts[rank * per:(rank + 1) * per].tolist()  # (B/W,) only this rank's windows are read
    if isinstance(arr, torch.Tensor):
        rows = torch.stack([arr[s:s + seq_len + 1].long() for s in mine])  # (B/W, T+1)
    else:
        rows = torch.from_numpy(np.stack([np.asarray(arr[s:s + seq_len + 1], dtype=np.int64) for s in mine]))  # (B/W, T+1)
    x, y = rows[:, :-1], rows[:, 1:]  # (B/W, T) each
    if device is not None:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x.contiguous(), y.contiguous()
