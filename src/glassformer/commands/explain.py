"""`glassformer explain`: how a number was computed. Today: one optimizer update of one weight of a
training run, number by number (glassformer.explaining.optimizer, docs/explain.md#explaining-one-optimizer-update)."""

from __future__ import annotations

HELP = "explain one optimizer update of a training run's weight, number by number, equal to training's bitwise"


def add_arguments(p) -> None:
    p.add_argument("--run", required=True, metavar="RUN",
                   help="a training run's folder (what `glassformer train --out` wrote)")
    p.add_argument("--step", required=True, type=int, metavar="S",
                   help="a checkpoint step of the run: the update explained is the next one, step S+1")
    p.add_argument("--param", required=True, metavar="NAME",
                   help="the weight, by its state-dict name, e.g. blocks.0.attn.wq.weight (shape (out, in) for a product)")
    p.add_argument("--index", required=True, metavar="I,J", help="the element: one index per axis, e.g. 3,5")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="the prepared data folder the run trained on, when it has moved (default: the run's own)")
    p.add_argument("--json", action="store_true",
                   help="print the calculation as one JSON object (what POST /api/update answers)")


def run(args) -> int:
    import json

    from ..explaining.optimizer import explain_update

    e = explain_update(args.run, args.step, args.param, args.index, data=args.data)
    if args.json:
        print(json.dumps(e.to_dict(), ensure_ascii=False))
        return 0
    s = e.summary
    print(f"{e.title}   (update {s['update_step']} of {args.run}, from checkpoint step {s['step']}, {s['optimizer']})")
    for k, step in enumerate(e.steps, 1):
        print(f"{k:2d}. {step['text']}")
    print(e.text.splitlines()[-1])
    if s.get("note"):
        print(f"note: {s['note']}")
    return 0
