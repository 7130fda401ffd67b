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
