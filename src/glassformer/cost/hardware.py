"""Hardware presets: dense peak FLOP/s per dtype, memory size and bandwidth.

The figures are the dense rates, half the datasheets' "with sparsity" headline; fp32 is the
plain fp32 rate (PyTorch leaves TF32 off for matmul; the TF32 rate is kept for reference).
'cpu' has no datasheet: its peak and bandwidth are measured here, its memory is the RAM.
See docs/cost.md#hardware-presets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

TFLOP = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    memory_bytes: int
    bandwidth: float  # bytes/s
    source: str
    extra: dict = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        return self.peak_flops[dtype]


HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 80GB. Datasheet (nvidia.com/en-us/data-center/h100, "H100 SXM"):
    # FP32 67 TFLOPS; TF32 989, BF16 1,979, FP16 1,979 TFLOPS "with sparsity" -> dense
    # 494.5 / 989.5 / 989.5; GPU memory 80 GB HBM3 at 3.35 TB/s.
    "h100": Hardware("h100", {"fp32": 67 * TFLOP, "bf16": 989.5 * TFLOP, "fp16": 989.5 * TFLOP},
                     80 * 10**9, 3.35e12, "NVIDIA H100 SXM5 datasheet (dense = half the sparse figure)",
                     {"tf32": 494.5 * TFLOP}),
    # NVIDIA H200 SXM 141GB. Datasheet (nvidia.com/en-us/data-center/h200): the same compute
    # as H100 SXM (FP32 67; BF16/FP16 1,979 with sparsity -> 989.5 dense), 141 GB HBM3e at 4.8 TB/s.
    "h200": Hardware("h200", {"fp32": 67 * TFLOP, "bf16": 989.5 * TFLOP, "fp16": 989.5 * TFLOP},
                     141 * 10**9, 4.8e12, "NVIDIA H200 SXM datasheet (dense = half the sparse figure)",
                     {"tf32": 494.5 * TFLOP}),
    # NVIDIA A100 SXM4 80GB. Datasheet (nvidia.com/en-us/data-center/a100): FP32 19.5 TFLOPS;
    # TF32 156, BF16 312, FP16 312 TFLOPS dense (312 / 624 / 624 with sparsity);
    # 80 GB HBM2e at 2,039 GB/s.
    "a100": Hardware("a100", {"fp32": 19.5 * TFLOP, "bf16": 312 * TFLOP, "fp16": 312 * TFLOP},
                     80 * 10**9, 2.039e12, "NVIDIA A100 SXM4 80GB datasheet (dense)",
                     {"tf32": 156 * TFLOP}),
}

NAMES = (*HARDWARE, "cpu")

_cpu_cache: Hardware | None = None


def ram_bytes() -> int | None:
    """This machine's physical memory in bytes (os.sysconf), None where the system does not say
    (not POSIX). Also the limit a checkpoint's config may ask for (checkpoint/checks.py)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def measure_cpu(n: int = 1024, repeats: int = 3, budget_s: float = 0.2) -> Hardware:
    """This machine's CPU: best of a few square matmuls per dtype, a 64 MB copy for bandwidth.

    A measured peak, not a datasheet one: what PyTorch reaches here with its current thread
    count, the right ceiling for an MFU on this machine. Each dtype's matrix size is cut
    (from n) so that one product takes about budget_s: some CPUs have no fast fp16 path and
    multiply fp16 far slower than fp32.
    """
    global _cpu_cache
    if _cpu_cache is not None:
        return _cpu_cache
    import time

    import torch

    def best(fn) -> float:
        fn()  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def rate(size: int, dt) -> float:
        a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
        return 2 * size**3 / best(lambda: a @ b)

    peaks, sizes = {}, {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            rough = rate(256, dt)
        except RuntimeError:  # a dtype this CPU build cannot multiply
            peaks[name] = peaks["fp32"]
            continue
        size = int(min(n, max(256, (rough * budget_s / 2) ** (1 / 3))) // 64 * 64)
        sizes[name] = size
        peaks[name] = max(rough, rate(size, dt))
    src = torch.empty(2**24, dtype=torch.float32)  # 64 MB, far beyond the caches
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # read + write
    _cpu_cache = Hardware("cpu", peaks, ram_bytes() or 16 * 2**30, bw,  # not POSIX: a guess
                          f"measured on this machine ({torch.get_num_threads()} threads; square matmuls of "
                          f"{', '.join(f'{k} {v}' for k, v in sizes.items())}; a 64 MB copy)")
    return _cpu_cache


def get_hardware(name: str) -> Hardware:
    if name == "cpu":
        return measure_cpu()
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(NAMES)}")
    return HARDWARE[name]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'80GB' -> 80·10⁹, '24GiB' -> 24·2³⁰, '1e9' -> 10⁹ (decimal units as datasheets use them)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = None
    if value is None or unit not in _UNITS or value <= 0:
        raise ValueError(f"cannot read memory size {text!r}: write a number with a unit, e.g. 80GB, 24GiB or 512MB")
    return int(value * _UNITS[unit])
