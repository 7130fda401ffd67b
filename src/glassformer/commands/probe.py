"""`glassformer probe train`: a linear (logistic) probe per layer on a labelled JSONL set, with its
held-out accuracy, a picture and the weights (docs/research.md#linear-probes)."""

from __future__ import annotations

from .options import add_device_argument

HELP = "train linear probes: per layer, how well a logistic regression reads a label from one probe site"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    t = sub.add_parser("train", help="train a logistic probe per layer and score it on held-out texts",
                       description="train a logistic probe per layer and score it on held-out texts")
    t.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint or run folder")
    t.add_argument("--data", required=True, metavar="LABELLED.jsonl",
                   help='one {"text": ..., "label": ...} object per line (a label: string, whole number or true/false)')
    t.add_argument("--site", required=True, metavar="NAME",
                   help="resid_pre, resid_mid, resid_post (the stream entering, inside, leaving block L), or a probe "
                        "inside the block: attn.out, ffn.down, ffn.act, attn.z, ... (a wrong name lists them)")
    t.add_argument("--layers", default=None, metavar="L,L,...",
                   help="the blocks to probe, comma-separated, ranges allowed (0-3,5); default every block")
    t.add_argument("--position", choices=["last", "mean"], default="last",
                   help="which tokens stand for a text: its last, or the mean over all of them")
    t.add_argument("--heldout", type=float, default=0.25, help="share of each class scored and not trained on")
    t.add_argument("--l2", type=float, default=1e-3, help="L2 penalty on the weights (standardised features)")
    t.add_argument("--seed", type=int, default=0, help="the split's shuffle")
    t.add_argument("--out", required=True, metavar="DIR",
                   help="folder to write: probes.safetensors, probes.json, accuracy.svg (+ accuracy.png with matplotlib)")
    add_device_argument(t)
    t.add_argument("--json", action="store_true", help="the last stdout line is probes.json's summary")


def parse_layers(text: str | None, n_layers: int) -> list[int] | None:
    """'0-2,5' -> [0, 1, 2, 5]; None -> None (every block). Out of range or unreadable: one line.

    >>> parse_layers("0-2,5", 6), parse_layers(None, 4)
    ([0, 1, 2, 5], None)
    """
    from ..errors import UserError

    if text is None:
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise UserError(f"--layers {text}: give block numbers and ranges, e.g. 0-2,5") from None
    bad = [L for L in out if not 0 <= L < n_layers]
    if not out or bad:
        raise UserError(f"--layers {text}: this model has {n_layers} blocks (0..{n_layers - 1})")
    return list(dict.fromkeys(out))


def run(args) -> int:
    import json
    from pathlib import Path

    from ..checkpoint.loading import load
    from ..devices import resolve_device
    from ..errors import UserError
    from ..research.probing import read_labelled, save_probes, train_probes

    texts, labels = read_labelled(args.data)  # bad data fails before the model is read
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists; choose a new folder or remove it first")
    resolve_device(args.device)
    model, tok = load(args.checkpoint, device=args.device)
    if tok is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json, so the texts cannot be encoded")
    layers = parse_layers(args.layers, model.config.n_layers)
    result = train_probes(model.eval(), tok, texts, labels, args.site, layers, args.position, args.heldout, args.seed,
                          args.l2)
    summary = save_probes(result, out, {"checkpoint": str(args.checkpoint), "data": str(args.data), "l2": args.l2,
                                        "seed": args.seed})
    print(f"{len(texts)} texts, {len(result.classes)} classes; trained on {result.n_train}, scored on "
          f"{result.n_heldout} held out (majority class: {result.baseline:.3f})")
    for p in result.layers:
        print(f"  layer {p.layer:>3}  {result.names[p.layer]:<28} held-out {p.heldout_accuracy:.3f}  "
              f"training {p.train_accuracy:.3f}")
    print(f"wrote {out}: probes.safetensors, probes.json, accuracy.svg" +
          (", accuracy.png" if (out / "accuracy.png").exists() else ""))
    if args.json:
        print(json.dumps(summary))
    return 0
