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
    import json

    from ..research.attribution import check_model, direct_logit_attribution
    from ..research.tokens import pieces
    from .options import check_output_file
    from .patch import load_checked

    if args.html:
        check_output_file("--html", args.html)
    model, tok, ids, answer, wrong = load_checked(args, [("--text", args.text)])
    check_model(model)
    out = direct_logit_attribution(model, ids["--text"], answer, wrong, args.position)
    out.update(tokens=pieces(tok, ids["--text"]), answer={"id": answer, "token": pieces(tok, [answer])[0]},
               wrong={"id": wrong, "token": pieces(tok, [wrong])[0]}, checkpoint=str(args.checkpoint))
    if args.html:
        from ..research.page import write_page

        write_page(args.html, {"attribute": out})
        if not args.json:
            print(f"wrote {args.html}")
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"logit({out['answer']['token']!r}) - logit({out['wrong']['token']!r}) at position {out['position']}: "
          f"{out['logit_diff']:.6f} (parts sum to {out['sum']:.6f}; final norm scale frozen at {out['scale']:.6f})")
    if "note" in out:
        print(out["note"])
    width = max(len(k) for k in out["parts"])
    for name, v in sorted(out["parts"].items(), key=lambda kv: -abs(kv[1])):
        print(f"{name:<{width}} {v:>+10.5f}")
    return 0
