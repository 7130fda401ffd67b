"""`glassformer attribute`: direct logit attribution, the logit difference split into each part's share."""

from __future__ import annotations

from .options import add_base_argument, add_device_argument

HELP = "direct logit attribution: logit(answer) - logit(wrong) split into the embedding's, each head's and each MLP's share"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", metavar="CKPT", required=True,
                   help="checkpoint, training run or Hugging Face folder, or a Hub name org/name[@revision]")
    p.add_argument("--text", required=True, metavar="TEXT", help="the text whose next token is attributed")
    p.add_argument("--answer", required=True, metavar="TOK", help="the right next token (one token, or #ID)")
    p.add_argument("--wrong", required=True, metavar="TOK", help="the wrong next token (one token, or #ID)")
    p.add_argument("--position", type=int, default=-1, help="the position whose next token is attributed")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (the last line)")
    p.add_argument("--html", metavar="FILE.html", help="also write the bars as a self-contained page")
    add_device_argument(p)
    add_base_argument(p)


def run(args) -> int:
    from ..research.reports import attribute_report
    from .options import check_output_file
    from .patch import finish, load_model

    if args.html:
        check_output_file("--html", args.html)
    model, tok = load_model(args)
    out = attribute_report(model, tok, args.text, args.answer, args.wrong, args.position, prefix="--")
    return finish(args, out, "attribute", lines)


def lines(out: dict) -> list[str]:
    """The parts as text, largest first."""
    shown = [f"logit({out['answer']['token']!r}) - logit({out['wrong']['token']!r}) at position {out['position']}: "
             f"{out['logit_diff']:.6f} (parts sum to {out['sum']:.6f}; final norm scale frozen at {out['scale']:.6f})"]
    if "note" in out:
        shown.append(out["note"])
    width = max(len(k) for k in out["parts"])
    shown += [f"{name:<{width}} {v:>+10.5f}" for name, v in sorted(out["parts"].items(), key=lambda kv: -abs(kv[1]))]
    return shown
