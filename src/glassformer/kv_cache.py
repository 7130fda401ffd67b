"""A preallocated key/value cache: sized once, written in place, one slot per position.

Prefill writes a whole prompt's keys and values; each decode step writes one more. Slot j
holds position j, so the causal rule "read keys at positions <= mine" (attention/mask.py)
is all the masking that a cache needs, even for rows that sit at different positions.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config import ModelConfig


class LayerKV(nn.Module):
    """One layer's cache: k and v of shape (B, K, S, H) (its own storage, or a view of a larger cache's)."""

    def __init__(self, parent: "KVCache", k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self._parent = [parent]  # a list, so the parent is not registered as a submodule
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    def update(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, K, T, H) at positions pos (B, T); return the keys and values readable now."""
        parent = self._parent[0]
        start = parent.start
        if start is not None:  # every row at the same positions: one slice write
            T = k.shape[2]
            self.k.narrow(2, start, T).copy_(k)
            self.v.narrow(2, start, T).copy_(v)
        else:  # rows at different positions: scatter each row's tokens to its own slots
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
            self.k[rows, :, pos] = k.transpose(1, 2)  # (B, T, K, H) into slots pos
            self.v[rows, :, pos] = v.transpose(1, 2)
        end = parent.end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)  # (B, K, end, H)


class KVCache(nn.Module):
    """Keys and values of every layer for up to `max_len` positions of `batch_size` rows."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int | None = None, dtype=None, device=None):
        super().__init__()
        self.max_len = config.max_seq_len if max_len is None else max_len
        if not 1 <= self.max_len <= config.max_seq_len:
            raise ValueError(f"cache length must be in 1..{config.max_seq_len} (the model's context), got {self.max_len}")
        shape = (batch_size, config.n_kv_heads, self.max_len, config.head_dim)  # (B, K, S, H)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.layers = nn.ModuleList(LayerKV(self, torch.zeros(shape, dtype=dtype, device=device),
                                            torch.zeros(shape, dtype=dtype, device=device))
                                    for _ in range(config.n_layers))
        self.start: int | None = 0
        self.end: int = 0

    def view(self, lo: int, hi: int, length: int | None = None) -> "KVCache":
        """Rows lo..hi-1 and slots 0..length-1 of this cache as a cache of their own, on the same
        storage (what a forward writes lands here): a serving engine runs its active rows only, and
        reads only the slots they have filled. Built without allocating; cheap, but not free."""
        length = self.max_len if length is None else int(length)
        if not (0 <= lo < hi <= self.batch_size and 1 <= length <= self.max_len):
            raise ValueError(f"a view needs rows within 0..{self.batch_size} and 1..{self.max_len} slots, "
                             f"got rows {lo}..{hi - 1} and {length} slots")
        part = KVCache.__new__(KVCache)
        nn.Module.__init__(part)
        part.max_len, part.start, part.end = length, 0, 0
        part.layers = nn.ModuleList(LayerKV(part, lay.k[lo:hi, :, :length], lay.v[lo:hi, :, :length])
                                    for lay in self.layers)  # (hi - lo, K, length, H) views
        return part

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy row src's first `length` slots of every layer into row dst (an engine moving a row)."""
        for lay in self.layers:
            lay.k[dst, :, :length].copy_(lay.k[src, :, :length])  # (K, length, H)
            lay.v[dst, :, :length].copy_(lay.v[src, :, :length])

    def row_bytes(self) -> int:
        """Bytes of keys and values that one row of this cache holds, every layer and slot."""
        return sum(2 * lay.k[0].numel() * lay.k.element_size() for lay in self.layers)

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_len: int | None = None) -> "KVCache":
        p = next(model.parameters())
        return cls(model.config, batch_size, max_len, dtype=p.dtype, device=p.device)

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    def prepare(self, pos, T: int) -> None:
        """Called by the model once per forward: where this call writes, how much it reads."""
        if isinstance(pos, torch.Tensor) and pos.dim() > 0:
            # Per-row positions: read the whole cache (a fixed shape, friendly to compile);
            # slots beyond a row's position are hidden by the causal rule.
            self.start, self.end = None, self.max_len
            if not torch.compiler.is_compiling() and int(pos.max()) + T > self.max_len:
                raise ValueError(f"the cache holds {self.max_len} positions; positions up to {int(pos.max()) + T - 1} were asked for")
        else:
            pos = int(pos)
            if pos + T > self.max_len:
                raise ValueError(
                    f"the cache holds {self.max_len} positions; positions {pos}..{pos + T - 1} were asked for: "
                    "make the cache longer (up to the model's max_seq_len) or shorten the text"
                )
            self.start, self.end = pos, pos + T

    def reset(self) -> None:
        for layer in self.layers:
            layer.k.zero_()
            layer.v.zero_()
