"""`glassformer trace`: one text through the model, every probe written to a trace file."""

from __future__ import annotations

from .options import add_base_argument, add_device_argument, add_quantize_argument

HELP = "run one text through the model and write every probe to a trace file (JSON) or page"


def _int_list(text: str) -> list[int]:
    """'0,2,5-7' -> [0, 2, 5, 6, 7]."""
    from ..errors import UserError

    out = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                a, b = part.split("-")
                out += list(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise UserError(f"{text!r} is not a list of numbers: write e.g. 0,2,5-7") from None
    return out


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="CKPT", help="checkpoint, training run or Hugging Face folder, or a Hub name org/name[@revision]")
    src.add_argument("--worked", action="store_true", help="the walkthrough's toy model (glassformer worked)")
    p.add_argument("--variant", default="one_head",
                   help="which toy model with --worked: one_head, two_blocks_pre, two_blocks_post, mha, gqa, mqa")
    p.add_argument("--text", help="the text to trace (default for --worked: the walkthrough's sentence)")
    p.add_argument("--out", metavar="FILE.json", help="write the trace file here (docs/trace-format.md)")
    p.add_argument("--html", metavar="FILE.html", help="write the explorer page for this trace (one self-contained file)")
    p.add_argument("--with-weights", action="store_true",
                   help="also store the traced layers' weights in math layout [in, out], so explain needs no model")
    p.add_argument("--layers", type=_int_list, default=None, help="trace only these blocks, e.g. 0,3-5 (default: all)")
    p.add_argument("--heads", type=_int_list, default=None, help="keep only these query heads (default: all)")
    p.add_argument("--top-k", type=int, default=None, help="keep only the k largest logits and probabilities per token")
    p.add_argument("--attention", choices=["naive", "tiled", "sdpa"], default="naive",
                   help="attention kernel for the trace; 'tiled' adds the FlashAttention tile states (.tiles)")
    p.add_argument("--query", type=int, default=None, help="token index whose row .tiles walks through (default: the last)")
    p.add_argument("--tile", type=int, default=None, help="tile size for --attention tiled (default: the model's attention_tile)")
    p.add_argument("--digits", type=int, default=7, help="significant digits of each number in the file")
    p.add_argument("--no-analysis", action="store_true",
                   help="leave out the 'analysis' key (norm RMS, head summary, logit lens, decode step)")
    add_device_argument(p)
    add_quantize_argument(p, "trace")
    add_base_argument(p)


def _load(args):
    from ..errors import UserError
    from .options import apply_quantize, quantize_method

    quantize_method(args)  # before the weights are read
    if args.worked:
        from ..worked import model as worked

        model, tok = worked.load_worked(args.variant)
        return model, tok, worked.SENTENCE
    if not args.checkpoint:
        raise UserError("say which model to trace: --checkpoint CKPT or --worked")
    from ..checkpoint.loading import load
    from ..devices import resolve_device

    model, tok = load(args.checkpoint, device=resolve_device(args.device), base=args.base)
    return apply_quantize(model, args), tok, None


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """How each token reads: the tokenizer's piece for it, or '#id' without a tokenizer."""
    if tokenizer is None:
        return [f"#{i}" for i in ids]
    if hasattr(tokenizer, "id_to_piece"):
        return [tokenizer.id_to_piece(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def run(args) -> int:
    import os
    from pathlib import Path

    from ..errors import UserError
    from .options import check_output_file

    if not args.out and not args.html:
        raise UserError("say where to write the trace: --out FILE.json and/or --html FILE.html")
    for flag, path in (("--out", args.out), ("--html", args.html)):
        if path:
            check_output_file(flag, path)  # before the model is loaded
    model, tok, default_text = _load(args)
    text = args.text if args.text is not None else default_text
    if text is None:
        raise UserError("give the text to trace with --text")
    if len(text) > 100_000:
        raise UserError("the text is over 100,000 characters: trace a shorter passage")
    if tok is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json, so --text cannot be turned into tokens")
    ids = tok.encode(text)

    from ..tracing.analysis import analysis_for
    from ..tracing.trace import trace

    tr = trace(model, ids, tokens=token_strings(tok, ids), layers=args.layers, heads=args.heads, top_k=args.top_k,
               with_weights=args.with_weights or args.worked, attention=args.attention, query=args.query, tile=args.tile)
    if not args.no_analysis:
        tr.analysis = analysis_for(model, tr, tokenizer=tok)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # as --html makes its folder
        tr.to_json(args.out, digits=args.digits)
        size = os.path.getsize(args.out)
        print(f"wrote {args.out}: {len(ids)} tokens, layers {tr.layers}, {len(tr.probes)} probes, {size / 1e6:.2f} MB")
    if args.html:
        write_html(tr, args.html, args.digits, model=model, tokenizer=tok, sentence=text)
    return 0


def write_html(tr, path: str, digits: int, model=None, tokenizer=None, sentence=None) -> None:
    """The hook for the explorer page (glassformer.viewer): one self-contained HTML file of this trace.

    The viewer provides `glassformer.viewer.write_trace_html(trace_dict, path)`; until it is
    there, --html says so.
    """
    import json

    from ..errors import UserError

    try:
        from ..viewer import write_trace_html
    except ImportError:
        raise UserError("--html needs the explorer page (glassformer.viewer), which this build does not have; "
                        "write --out FILE.json instead") from None
    write_trace_html(json.loads(tr.to_json(digits=digits)), path, model=model, tokenizer=tokenizer, sentence=sentence)
    print(f"wrote {path}")
