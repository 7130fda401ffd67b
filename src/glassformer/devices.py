"""The devices a `--device` flag may name, and what a name means on this machine.

A name is checked twice: as text when the command line is read (`check_device_name`: cpu, cuda,
cuda:N, mps, and auto where the verb picks one), and against what PyTorch sees before anything is
loaded (`resolve_device`). Imports torch only inside resolve_device, so the parser stays light.

    >>> check_device_name("cuda:1")
    'cuda:1'
    >>> bad_device_name("gpu")
    "'gpu' is not a device: choose cpu, cuda, cuda:N or mps (or auto: cuda if present, else cpu)"
"""

from __future__ import annotations

import re

from .errors import UserError

NAMES = "cpu, cuda, cuda:N or mps"
AUTO = "auto: cuda if present, else cpu"


def bad_device_name(name: str, auto: bool = True) -> str | None:
    """Why `name` is not a device name (None when it is one)."""
    if name in ("cpu", "cuda", "mps") or re.fullmatch(r"cuda:[0-9]+", name) or (auto and name == "auto"):
        return None
    return f"{name!r} is not a device: choose {NAMES}" + (f" (or {AUTO})" if auto else "")


def check_device_name(name: str, auto: bool = True) -> str:
    """name, if it names a device (auto: whether 'auto' is one); else a UserError listing them."""
    why = bad_device_name(name, auto)
    if why:
        raise UserError(f"--device {why}")
    return name


def resolve_device(name: str, local_rank: int | None = None):
    """The torch.device `name` means here ('auto': cuda if PyTorch sees a GPU, else cpu); local_rank:
    the GPU a plain 'cuda' means for this process under torchrun. A UserError when PyTorch lacks it."""
    import torch

    check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} asked for, but PyTorch sees no CUDA GPU here: use --device cpu")
        if name == "cuda" and local_rank is not None:
            return torch.device("cuda", local_rank)
        n, index = torch.cuda.device_count(), int(name.partition(":")[2] or 0)
        if index >= n:
            raise UserError(f"--device {name}: PyTorch sees {n} CUDA GPU(s), cuda:0 to cuda:{n - 1}: choose one of them")
    if name == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UserError("--device mps asked for, but this PyTorch has no MPS backend here: use --device cpu")
    return torch.device(name)
