"""The CPU decode steps' attention: a small C++ kernel (cpu_decode.cpp), built once per machine.

At one query attention only streams the cached keys and values, which the library route (sdpa.py's
batched products) does slowly (bench/decode_attention.py); this reads each row once for its group of
query heads, each row up to its own position where a continuous-batching step's rows stand at theirs
(bench/batching.py --library-attention). The same library holds a batched step's few-row weight products
(`panels`, `few_rows_product`: bench/batching.py --onednn-products). Session(compile=True) and the
batching Engine on the CPU load it; where it cannot be built load() warns once and the library route
stays. Why, how and where it is cached: docs/generation.md#compiled-steps."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from ..files import cache_dir

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
HEAD_DIMS = (16, 32, 64, 128)  # what the kernel is built for (its registers per query head)
MIN_CHUNK = 256  # positions: a thread gets a stretch at least this long (shorter ones cost more to merge)

enabled = True  # False: steps keep the library products (compiled: set before a step is compiled; for benchmarks)
# False: a few-row product (model.packed) keeps oneDNN's packed weight instead of the kernel's panels
# (set before the held copies are packed; bench/batching.py --onednn-products)
products = True
_lib: ctypes.CDLL | None = None
_tried = False


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_id() -> str:
    """What -march=native builds for: the CPU's model and feature flags where Linux says them
    (a cache folder shared by several machines must not hand one's build to another)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(next((ln for ln in info if ln.startswith(k)), "") for k in ("model name", "flags", "Features"))
    except OSError:
        return platform.processor()


def _build(cxx: str) -> Path:
    """The kernel's shared library for this source, machine and compiler (built if need be)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), version, platform.machine(), _cpu_id(),
                                    torch.backends.cpu.get_cpu_capability()]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"cpu_decode-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then moved in whole
        part = Path(tmp) / out.name
        run = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(part)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {(run.stderr or run.stdout).strip()[-800:]}")
        os.replace(part, out)
    return out


def load() -> bool:
    """Build (once) and load the kernel; False, with one warning saying why, where it cannot be."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    _tried = True
    cxx = _compiler()
    try:
        if cxx is None:
            raise RuntimeError("no C++ compiler found (set CXX)")
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError) as e:
        warnings.warn(f"the CPU decode attention kernel could not be built, compiled and batched steps use the library "
                      f"products instead: {e}", RuntimeWarning, stacklevel=2)
        return False
    fn = lib.glassformer_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 9 + [ctypes.c_float] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    fn = lib.glassformer_few_rows_product
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
    lib.glassformer_panel_width.restype = ctypes.c_int
    _lib = lib
    return True


def _strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple | None:
    """k's and v's strides where the kernel can read these tensors, else None: fp32 on the CPU, a
    head size it is built for, each cached row contiguous (the cache's own layout), q one query
    per row and its heads a whole number of groups."""
    B, N, one, H = q.shape
    ks, vs = k.stride(), v.stride()
    fits = (one == 1 and H in HEAD_DIMS and k.shape == v.shape and k.shape[0] == B and k.shape[3] == H
            and N % k.shape[1] == 0 and ks[2:] == vs[2:] == (H, 1) and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu")
    return (ks, vs) if fits else None


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel serves this step: enabled, loaded, and the tensors fit it."""
    return enabled and _lib is not None and _strides(q, k, v) is not None


def chunks_for(rows: int, T: int, threads: int) -> int:
    """Stretches of positions per (row, KV head): enough items for every thread, none under MIN_CHUNK."""
    want = -(-threads // rows)  # ceil
    return max(1, min(want, T // MIN_CHUNK))


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunks: int = 0,
         lens: torch.Tensor | None = None) -> torch.Tensor:
    if _lib is None:
        raise RuntimeError("cpu_decode.load() has not built the kernel")
    strides = _strides(q, k, v)
    if strides is None:
        raise ValueError(
            f"cpu_decode: wants q (B, N, 1, H) and k, v (B, K, T, H), fp32 on the CPU, rows contiguous, "
            f"H in {HEAD_DIMS}; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)}")
    (ks, vs), (B, N, _, H), (K, T) = strides, q.shape, k.shape[1:3]
    if lens is not None and (lens.shape != (B,) or lens.dtype != torch.int64 or lens.device.type != "cpu"):
        raise ValueError(f"cpu_decode: wants lens (B,) = ({B},) int64 on the CPU; got {tuple(lens.shape)} {lens.dtype}")
    qc = q.contiguous()
    lc = None if lens is None else lens.contiguous()
    out = torch.empty_like(qc)
    threads = torch.get_num_threads()
    n = chunks or chunks_for(B * K, T, threads)
    err = _lib.glassformer_decode_attention(qc.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                            B, K, N // K, H, T, ks[0], ks[1], vs[0], vs[1], scale, threads, n,
                                            None if lc is None else lc.data_ptr())
    if err:
        raise ValueError(f"cpu_decode: shapes it is not built for (head size {H}, {T} positions)")
    return out


# An operator of its own, so that a compiled graph calls it as one opaque step; registered with
# torch.library's plain API rather than its custom_op decorator, which wraps every call for autograd.
_OPS = torch.library.Library("glassformer", "DEF")
_OPS.define("cpu_decode_attention(Tensor q, Tensor k, Tensor v, float scale, int chunks=0, Tensor? lens=None) -> Tensor")
_OPS.impl("cpu_decode_attention", _run, "CPU")


@torch.library.register_fake("glassformer::cpu_decode_attention")
def _(q, k, v, scale, chunks=0, lens=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunks: int = 0,
              lens: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T · scale) v for one query per row: q (B, N, 1, H); k, v (B, K, T, H) with
    contiguous rows (views into a longer cache are fine); (B, N, 1, H). chunks 0: chunks_for.
    lens (B,) int64: row b reads only its first lens[b] keys (clipped to 0..T; none: zeros), as a
    continuous-batching step's rows at their own positions do; None: every row all T."""
    return torch.ops.glassformer.cpu_decode_attention(q, k, v, scale, chunks, lens)


# ---------------------------------------------------------------------------------------------- few-row products


class Panels(NamedTuple):
    """A weight (out, in) held for the kernel's few-row product: w (P, in, NP), P panels of NP columns each
    a row of `in` at a time, the last zero-padded; n = out; bias padded alike (or None)."""

    w: torch.Tensor
    n: int
    bias: torch.Tensor | None


def products_ready() -> bool:
    """Whether a few-row product may use the kernel's panels: wanted (`products`) and the kernel loaded."""
    return products and _lib is not None


def panels(in_out: torch.Tensor, bias: torch.Tensor | None = None) -> Panels:
    """A weight as its (in, out) fp32 copy (model.fresh_rows holds one) and its bias (out,), as the
    kernel's panels: column blocks of that copy, one after another (built once per held copy)."""
    if _lib is None:
        raise RuntimeError("cpu_decode.load() has not built the kernel")
    K, N = in_out.shape
    NP = _lib.glassformer_panel_width()
    P = -(-N // NP)
    w = in_out.new_zeros(K, P * NP)
    w[:, :N] = in_out
    b = None
    if bias is not None:
        b = bias.new_zeros(P * NP)
        b[:N] = bias
    return Panels(w.view(K, P, NP).permute(1, 0, 2).contiguous(), N, b)  # (P, K, NP)


def few_rows_product(x2: torch.Tensor, p: Panels) -> torch.Tensor:
    """x2 (M, in) fp32 on the CPU times a Panels weight, plus its bias: (M, out)."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    if x2.dtype != torch.float32 or K != p.w.shape[1]:
        raise ValueError(f"cpu_decode: wants x (M, {p.w.shape[1]}) fp32; got {tuple(x2.shape)} {x2.dtype}")
    y = torch.empty(M, p.n, dtype=x2.dtype)  # (M, out)
    bias = None if p.bias is None else p.bias.data_ptr()
    if _lib.glassformer_few_rows_product(x2.data_ptr(), M, K, x2.stride(0), p.w.data_ptr(), p.n, bias,
                                         y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"cpu_decode: a product it cannot run ({M} x {K} by {p.n})")
    return y
