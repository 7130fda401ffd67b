"""Flags several verbs share, each added by one function and read by one, so that every verb
(generate, eval, trace, view, chat, serve) takes and applies it the same way. Not a verb itself."""

from __future__ import annotations


def add_quantize_argument(p, doing: str = "run") -> None:
    """`--quantize TYPE`: the model's weights as TYPE once loaded (docs/quantize.md). `doing` says
    what the verb does with them, for the help ("decode", "score", ...)."""
    # The choices are checked by quantize_method, not argparse: --help must not import torch.
    p.add_argument("--quantize", metavar="TYPE", default=None,
                   help=f"{doing} with TYPE weights (int8: per output channel; docs/quantize.md); "
                        "unset keeps them as stored")


def quantize_method(args) -> str | None:
    """--quantize's value, checked (a UserError naming the choices, or saying that --worked's toy
    model is not quantized): call it before reading any weights, so a bad type fails at once."""
    from ..convert.quantize import check_method
    from ..errors import UserError

    method = check_method(getattr(args, "quantize", None))
    if method is not None and getattr(args, "worked", False):
        raise UserError("--quantize goes with --checkpoint CKPT: the walkthrough's toy model keeps its own weights")
    return method


def apply_quantize(model, args):
    """The loaded model with --quantize applied (convert.quantize.quantize): as stored when unset,
    as it is when it already is that type."""
    from ..convert.quantize import quantize

    return quantize(model, quantize_method(args))


def add_base_argument(p) -> None:
    """`--base CKPT`: the base of an adapter run given as --checkpoint, when it has moved from where
    the adapter records it (docs/lora.md); load(..., base=args.base) reads it."""
    p.add_argument("--base", metavar="CKPT", default=None,
                   help="with a LoRA adapter run as --checkpoint: its base checkpoint, when it has moved "
                        "from where the adapter records it (docs/lora.md)")


def device_type(auto: bool = False):
    """An argparse type for `--device`: the name, checked as text (devices.check_device_name), so a
    bad one fails as the command line is read, naming the choices. auto: whether 'auto' is one."""
    import argparse

    from ..devices import bad_device_name

    def parse(text: str) -> str:
        why = bad_device_name(text, auto)
        if why:
            raise argparse.ArgumentTypeError(why)
        return text

    parse.__name__ = "device"  # what argparse names the type in its messages
    return parse


def add_device_argument(p, default: str = "cpu", auto: bool = False) -> None:
    """`--device NAME`, checked when the command line is read (device_type); its availability is
    checked where the verb resolves it (devices.resolve_device), before anything is loaded."""
    from ..devices import AUTO, NAMES

    p.add_argument("--device", default=default, type=device_type(auto), metavar="NAME",
                   help=f"{NAMES}" + (f", or {AUTO}" if auto else ""))


SEED_LIMIT = 1 << 63  # seeds are 0 … 2**63-1: a non-negative int64, what torch.manual_seed and Generator take
HARNESS_SEED_LIMIT = 1 << 32  # lm-evaluation-harness also seeds numpy with it, which takes 0 … 2**32-1


def seed_type(limit: int = SEED_LIMIT):
    """An argparse type for `--seed`: a whole number from 0 to limit-1, refused as the command line is
    read (not as an overflow deep in torch)."""
    import argparse

    def parse(text: str) -> int:
        try:
            seed = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give a seed from 0 to {limit - 1}") from None
        if not 0 <= seed < limit:
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a seed from 0 to {limit - 1} (2**{limit.bit_length() - 1}-1)")
        return seed

    parse.__name__ = "seed"
    return parse


def check_output_file(flag: str, path: str) -> None:
    """A UserError, before any work, when the file a flag names cannot be written: it is a folder, or
    it lies under a file. (A missing folder above it is made when the file is written.)"""
    from pathlib import Path

    from ..errors import UserError

    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path} is a folder: give a file name")
    existing = next(a for a in p.parents if a.exists())  # the nearest existing folder above it ('.' at last)
    if not existing.is_dir():
        raise UserError(f"{flag} {path} lies under {existing}, which is a file: choose another path")
