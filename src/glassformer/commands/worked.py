"""`glassformer worked`: the walkthrough's toy model, every number recomputed by the real model."""

from __future__ import annotations

HELP = "the hand-calculation walkthrough's toy model: print it section by section, or its figures as JSON"


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print every figure as one JSON object (the walkthrough's keys)")
    p.add_argument("--html", metavar="FILE.html", help="write the explorer page of the toy model (needs the viewer)")


def run(args) -> int:
    import json

    from ..errors import UserError
    from ..worked.figures import figures
    from ..worked.text import walkthrough

    fig = figures()
    if args.html:
        try:
            from ..viewer import write_worked_html
        except ImportError as e:
            raise UserError(
                "--html needs the explorer page (glassformer.viewer.write_worked_html), which this install lacks; "
                "use --json or the plain printout instead"
            ) from e
        path = write_worked_html(args.html)
        print(f"wrote {path}")
    if args.json:
        print(json.dumps(fig, indent=1))
    elif not args.html:
        print(walkthrough(fig))
    return 0
