"""`glassformer patch`: an activation patching sweep over every layer × position (or layer × head)."""

from __future__ import annotations

from .options import add_base_argument, add_device_argument

HELP = "activation patching sweep: clean activations patched into the corrupted run, layer by position (or head)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", metavar="CKPT", required=True,
                   help="checkpoint, training run or Hugging Face folder, or a Hub name org/name[@revision]")
    p.add_argument("--clean", required=True, metavar="TEXT", help="the clean text (its activations are patched in)")
    p.add_argument("--corrupt", required=True, metavar="TEXT",
                   help="the corrupted text (the run patched), as many tokens as --clean")
    p.add_argument("--answer", required=True, metavar="TOK", help="the right next token (one token, or #ID)")
    p.add_argument("--wrong", required=True, metavar="TOK", help="the wrong next token (one token, or #ID)")
    p.add_argument("--site", default="resid_pre", metavar="SITE",
                   help="resid_pre (the stream entering each block), attn_out, mlp_out, or z (each head, all positions)")
    p.add_argument("--method", default="exact", metavar="METHOD",
                   help="exact (one patched run per cell, batched), attribution (gradient estimate: one forward and "
                        "backward), or both (and their correlation)")
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="patches per forward (default: as many as fit in about 128 MB of activations)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (the last line)")
    p.add_argument("--html", metavar="FILE.html", help="also write the grid as a self-contained page")
    add_device_argument(p)
    add_base_argument(p)


def load_model(args):
    """(model, tokenizer) of --checkpoint, in eval mode, on --device."""
    from ..checkpoint.loading import load
    from ..devices import resolve_device

    model, tok = load(args.checkpoint, device=resolve_device(args.device), base=args.base)
    return model.eval(), tok


def finish(args, out: dict, key: str, lines) -> int:
    """--html's page, then the JSON line (--json) or the text lines."""
    import json

    out["checkpoint"] = str(args.checkpoint)
    if args.html:
        from ..viewer.research_page import write_page

        write_page(args.html, {key: out})
        if not args.json:
            print(f"wrote {args.html}")
    print(json.dumps(out) if args.json else "\n".join(lines(out)))
    return 0


def run(args) -> int:
    from ..errors import UserError
    from ..research.reports import check_names, patch_report
    from .options import check_output_file

    check_names(args.site, args.method)  # before the model is read; a site this model lacks is checked once it is
    if args.batch is not None and args.batch < 1:
        raise UserError(f"--batch must be at least 1, got {args.batch}")
    if args.html:
        check_output_file("--html", args.html)
    model, tok = load_model(args)
    out = patch_report(model, tok, args.clean, args.corrupt, args.answer, args.wrong, args.site, args.method,
                       args.batch, prefix="--")
    return finish(args, out, "patch", table)


def table(out: dict) -> list[str]:
    """The grid as text: one row per layer, each cell the patched metric."""
    cols = out["axes"][1]
    labels = ([f"h{j}" for j in range(len(out["grid"][0]))] if cols == "head"
              else [f"{j}:{t}"[:9] for j, t in enumerate(out["clean_tokens"])])
    lines = [f"site {out['site']} ({out['transformer_lens']}), method {out['method']}; metric "
             f"logit({out['answer']['token']!r}) - logit({out['wrong']['token']!r}) at the last position",
             f"clean {out['clean']:.4f}   corrupt {out['corrupt']:.4f}"]
    if out.get("correlation") is not None:
        lines.append(f"attribution vs exact: Pearson r = {out['correlation']:.4f}")
    lines.append("layer " + " ".join(f"{c:>9}" for c in labels))
    for i, row in enumerate(out["grid"]):
        lines.append(f"{i:>5} " + " ".join(f"{v:>9.4f}" for v in row))
    return lines
