"""What a training run measures: FLOPs per token, the machine's peak, MFU, metrics.jsonl, loss.png."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..config import ModelConfig
from ..cost.flops import train_flops_per_token

# Published dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (design.md's 3C/(B·T)), the figure MFU divides by: cost.flops counts it."""
    return float(train_flops_per_token(cfg, seq_len))


def gpu_peak(device: torch.device) -> float | None:
    """The published dense bf16 peak of this GPU, or None if it is not in the table."""
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_BF16_PEAK.items():
        if key in name:
            return peak
    return None


def cpu_matmul_peak(n: int = 1024, seconds: float = 0.5, dtype=torch.float32) -> float:
    """FLOP/s of the best n×n×n matmul timed here for about `seconds`: the CPU's practical fp32 peak."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up: thread pool, caches
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def pick_threads(most: int, seconds: float = 0.2) -> tuple[int, float, float]:
    """(threads, FLOP/s with 1, FLOP/s with `most`): the faster of one thread and all of them on a
    training-sized matmul. On a CPU shared with other busy processes, cooperating threads wait
    for each other and can be several times slower than one thread alone."""
    a, b = torch.randn(2048, 256), torch.randn(256, 768)

    def rate(n: int) -> float:
        torch.set_num_threads(n)
        a @ b
        best, start = float("inf"), time.perf_counter()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        return 2.0 * 2048 * 256 * 768 / best

    one = rate(1)
    many = rate(most) if most > 1 else one
    n = most if many > one else 1
    torch.set_num_threads(n)
    return n, one, many


def machine_peak(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from) for MFU."""
    if device.type == "cuda":
        peak = gpu_peak(device)
        return peak, f"published dense bf16 peak of {torch.cuda.get_device_name(device)}" if peak else "unknown GPU"
    if device.type == "cpu":
        return cpu_matmul_peak(), "fp32 matmul peak measured at start"
    return None, "no peak for this device"


class MetricsLog:
    """metrics.jsonl: one JSON object a line, appended and flushed (a resumed run appends to it)."""

    def __init__(self, path: str | Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        if truncate_after_step is not None and self.path.exists():
            # On resume, drop lines from steps after the checkpoint: they are about to be redone.
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= truncate_after_step]
            self.path.write_text("".join(k + "\n" for k in kept))
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def load_plotting() -> None:
    """Import matplotlib now (if installed), so that the first loss picture costs what later ones do."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def plot_losses(metrics_path: str | Path, png_path: str | Path) -> bool:
    """Draw train and held-out loss against step into png_path (atomically); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="held-out loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    tmp = png_path.with_name(f".{png_path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, png_path)
    return True
