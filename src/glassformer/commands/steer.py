"""`glassformer steer`: a steering vector from contrasting texts (docs/research.md#steering-vectors).

The mean difference of the residual stream entering block L between the --positive texts and the
--negative ones, written as VEC (.safetensors); `generate`, `chat` and `serve` take it back with
`--steer VEC[:SCALE]`, and `convert --control-vector VEC` writes it for llama.cpp.
"""

from __future__ import annotations

from .options import add_device_argument

HELP = "make a steering vector: the mean stream difference between positive and negative texts at one layer"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint or run folder")
    p.add_argument("--positive", required=True, metavar="FILE", help="text file, one example of the behaviour per line")
    p.add_argument("--negative", required=True, metavar="FILE", help="text file, one example of its opposite per line")
    p.add_argument("--layer", required=True, type=int, metavar="L", help="the stream entering block L (0-based)")
    p.add_argument("--reduce", choices=["last", "mean"], default="last",
                   help="which positions stand for a text: its last token (contrastive activation addition's "
                        "choice), or the mean over its tokens")
    p.add_argument("--out", required=True, metavar="VEC", help="the vector file to write (.safetensors)")
    add_device_argument(p)
    p.add_argument("--json", action="store_true", help="the last stdout line is a JSON summary")


def add_steer_argument(p) -> None:
    """`--steer VEC[:SCALE]` (repeatable), shared by generate, chat and serve; apply_steer reads it."""
    p.add_argument("--steer", action="append", default=[], metavar="VEC[:SCALE]",
                   help="add the steering vector VEC (from `glassformer steer`) times SCALE (default 1) to the stream "
                        "it was made at, in every forward (repeatable: they add up)")


def read_steer(args) -> list:
    """--steer's vector files read and checked as files, before any model is loaded."""
    from ..research.steering import load_vector

    return [load_vector(spec) for spec in getattr(args, "steer", None) or []]


def _lines(path: str, flag: str) -> list[str]:
    from ..errors import UserError

    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read {flag} {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path} is not UTF-8 text (byte offset {e.start}): one text per line") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise UserError(f"{flag} {path} holds no text: one text per line")
    return lines


def run(args) -> int:
    import json

    from ..checkpoint.loading import load
    from ..devices import resolve_device
    from ..errors import UserError
    from ..research.steering import check_layer, contrastive, save_vector
    from .options import check_output_file

    positive, negative = _lines(args.positive, "--positive"), _lines(args.negative, "--negative")
    check_output_file("--out", args.out)
    resolve_device(args.device)
    model, tok = load(args.checkpoint, device=args.device)
    if tok is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json, so the texts cannot be encoded")
    check_layer(args.layer, model.config.n_layers)
    vec = contrastive(model, tok, positive, negative, args.layer, args.reduce)
    path = save_vector(args.out, vec)
    norm, stream = float(vec.direction.norm()), float(vec.meta["stream_norm"])
    print(f"wrote {path}: the stream entering block {vec.layer}, width {vec.dim}, |v| = {norm:.4g} "
          f"({norm / max(stream, 1e-30):.3g} of the stream's mean length {stream:.4g}), from {len(positive)} positive "
          f"and {len(negative)} negative texts")
    if args.json:
        print(json.dumps({"out": str(path), "layer": vec.layer, "dim": vec.dim, "norm": norm, "stream_norm": stream,
                          "positive": len(positive), "negative": len(negative), "reduce": args.reduce}))
    return 0
