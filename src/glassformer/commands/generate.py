"""`glassformer generate`: sample text from a checkpoint, streamed to the terminal as it comes."""

from __future__ import annotations

import contextlib
import sys

from ..generation.streaming import TextStream
from .logprob_lines import Scores
from .options import add_base_argument, add_device_argument, add_quantize_argument, seed_type
from .sae import add_generate_arguments as add_sae_arguments
from .steer import add_steer_argument

HELP = "sample text from a checkpoint, streamed as tokens come (KV cache, batched prompts)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint folder, training run folder, Hugging Face folder or Hub name org/name[@revision]")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompts-file", help="a text file with one prompt per line, generated as one batch")
    add_sampling_arguments(p)
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a sample when this text appears (repeatable); the text itself is not printed")
    p.add_argument("--attention", choices=["naive", "tiled", "sdpa"], default=None,
                   help="attention kernel (default: the checkpoint's)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt, generated together as a batch")
    p.add_argument("--context-policy", choices=["error", "slide"], default="error",
                   help="when prompt + new tokens outgrow the context: stop with an error, or slide the window")
    p.add_argument("--compile", action="store_true", help="compile the model with torch.compile")
    add_device_argument(p)
    add_quantize_argument(p, "decode")
    add_base_argument(p)
    add_steer_argument(p)
    add_sae_arguments(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: as stored)")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="show each new token's log-probability (of the raw distribution, before temperature and "
                        "filters) and its K most likely alternatives; decode steps then run eagerly")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per new token instead of the text: row, id, token, bytes, logprob, "
                        "top (K from --logprobs, default 0)")
    p.add_argument("--html", metavar="FILE", default=None,
                   help="also write the explorer's page of the prompt and its continuation to FILE (.html), its "
                        "generated-text view filled in (one --prompt, at most 64 new tokens; docs/viewer.md#generated-text)")


def add_sampling_arguments(p, max_new_tokens: int = 200) -> None:
    """The sampling flags, shared with `glassformer chat`."""
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this; 0 means greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample among the smallest set of tokens whose probabilities reach p")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than min-p times the most likely one")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL penalty on tokens already in the text: positive logits / r, negative ones * r")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--seed", type=seed_type(), default=None, help="fix the random draws (same seed, same text)")


def _prompts(args) -> list[str]:
    """The prompts to continue: --prompt, or the non-blank lines of --prompts-file."""
    from ..errors import UserError

    if args.prompts_file is not None:
        try:
            lines = open(args.prompts_file, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise UserError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"--prompts-file {args.prompts_file} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                            f"offset {e.start}): it must be a UTF-8 text file, one prompt per line") from None
        prompts = [ln for ln in lines if ln.strip()]
        if not prompts:
            raise UserError(f"--prompts-file {args.prompts_file} holds no prompt (one prompt per line)")
    else:
        prompts = [args.prompt]
    if any(not p for p in prompts):
        raise UserError("the prompt is empty: give some text to continue")
    return prompts


def _check_args(args) -> None:
    from ..errors import UserError
    from ..generation.session import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty)
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {args.num_samples}")
    logprobs = getattr(args, "logprobs", None)  # chat shares these checks and has no --logprobs
    if logprobs is not None and logprobs < 0:
        raise UserError(f"--logprobs must be >= 0 (how many alternatives to show), got {logprobs}")


def _load_model(args):
    """(model, tokenizer) from --checkpoint on --device in --dtype, with --attention, --quantize and --steer set."""
    import torch

    from ..checkpoint.folders import read_config, resolve
    from ..checkpoint.loading import load
    from ..devices import resolve_device
    from ..errors import UserError
    from ..research.steering import steer
    from .options import apply_quantize, quantize_method
    from .sae import check_sae_flags, sae_edit
    from .steer import read_steer

    quantize_method(args)  # before the weights are read
    vectors = read_steer(args)  # and the steering vectors' files
    check_sae_flags(args)  # and the SAE's (--sae)
    resolve_device(args.device)  # a GPU asked for that is not here
    folder = resolve(args.checkpoint)
    meta = read_config(folder)
    if meta.get("format") == "glassformer" and "lora" not in meta and not (folder / "model.safetensors").is_file():
        raise UserError(f"checkpoint {folder} is incomplete: it has no model.safetensors")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    model, tok = load(folder, device=args.device, dtype=dtype, base=getattr(args, "base", None))
    if tok is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json, so text cannot be encoded")
    model = apply_quantize(model, args)
    if args.attention:
        model.set_attention(args.attention)
    if vectors:  # forward pre-hooks on the model's blocks: every forward from here on is steered
        steer(model, vectors)
    sae_edit(args, model)  # --sae-ablate / --sae-steer: forward hooks at the SAE's site
    return model, tok


def _stream(session, steps, streams, eot, out, clock, scores=None) -> tuple[int, list[tuple[float, int]]]:
    """Run the steps, feeding each row's tokens to its TextStream; one row is written as it comes
    (unless `scores`, a logprob_lines.Scores, writes JSON lines instead). Returns (tokens made,
    [(seconds, tokens)] after the prefill and after the first decode step)."""
    single, made, marks = len(streams) == 1 and not (scores and scores.json), 0, []
    for step in steps:
        step = [step] if len(streams) == 1 else step
        if scores is not None:
            scores.step(step)
        for b, t in enumerate(step):
            if t is None or t == eot:
                continue
            made += 1
            piece = streams[b].push(t)
            if streams[b].done:
                session.finish(b)
            if single and piece:
                out.write(piece)
                out.flush()
        if len(marks) < 2:
            marks.append((clock(), made))
        if len(streams) == 1 and streams[0].done:
            break
    return made, marks


def _write_batch(out, prompts: list[str], streams: list[TextStream], num_samples: int) -> None:
    for b, s in enumerate(streams):
        p, k = divmod(b, num_samples)
        out.write(f"=== prompt {p + 1}" + (f", sample {k + 1}" if num_samples > 1 else "") + " ===\n")
        out.write(prompts[p] + s.text[:s.shown] + s.flush() + "\n")


def _summary(made: int, seconds: float, marks: list[tuple[float, int]], compiled: bool) -> str:
    summary = f"{made} tokens in {seconds:.2f} s"
    if len(marks) == 2 and made > marks[1][1]:  # the steady decode rate, apart from the prefill and any compiling
        rate = (made - marks[1][1]) / max(seconds - marks[1][0], 1e-9)
        compiling = f", first decode step {marks[1][0] - marks[0][0]:.2f} s with compiling" if compiled else ""
        summary += f" (prefill {marks[0][0]:.2f} s{compiling}; then {rate:.1f} tokens/s)"
    return summary


def _check_html(args) -> None:
    """--html draws one prompt's continuation: what it cannot be combined with, said before any loading."""
    from ..errors import UserError
    from ..viewer.generated import MAX_TOKENS
    from .options import check_output_file

    if not args.html.lower().endswith((".html", ".htm")):
        raise UserError(f"--html writes a page: give a file name ending in .html, got {args.html!r}")
    check_output_file("--html", args.html)
    if args.prompts_file is not None or args.num_samples != 1:
        raise UserError("--html draws one text: give --prompt (not --prompts-file) and --num-samples 1")
    others = [flag for flag, on in (("--json", args.json), ("--logprobs", args.logprobs is not None), ("--stop", args.stop),
                                    ("--compile", args.compile), ("--context-policy slide", args.context_policy != "error")) if on]
    if others:
        raise UserError(f"--html cannot be combined with {', '.join(others)}: the page shows each token's probabilities itself")
    if not 1 <= args.max_new_tokens <= MAX_TOKENS:
        raise UserError(f"--html draws at most {MAX_TOKENS} new tokens: give --max-new-tokens {MAX_TOKENS} or fewer "
                        f"(got {args.max_new_tokens})")


def _write_page(args, prompt: str) -> int:
    """--html: the prompt continued by glassformer.generate (the same tokens as without --html), printed,
    and drawn as the explorer's self-contained page (viewer.source.write_generated_page)."""
    from ..viewer.source import write_generated_page

    _check_html(args)
    model, tok = _load_model(args)
    settings = dict(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    path, part = write_generated_page(args.html, model, tok, prompt, args.max_new_tokens, settings,
                                      model_name=str(args.checkpoint))
    sys.stdout.write(part["text"] + "\n")
    sys.stdout.flush()
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): {len(part['tokens'])} new tokens; "
          f"open it in a browser", file=sys.stderr)
    return 0


def run(args) -> int:
    import time

    from ..errors import UserError
    from ..generation.session import Session, cache_length

    _check_args(args)
    prompts = _prompts(args)
    if args.html is not None:
        return _write_page(args, prompts[0])
    model, tok = _load_model(args)
    rows = [tok.encode(p) for p in prompts for _ in range(args.num_samples)]
    if any(not r for r in rows):
        raise UserError("a prompt encodes to no tokens: give some text to continue")
    eot = getattr(tok, "eot_id", None)
    max_len = cache_length(model, rows, args.max_new_tokens, args.context_policy)  # as glassformer.generate sizes it
    session = Session(model, len(rows), max_len=max_len, context_policy=args.context_policy, compile=args.compile)
    steps = session.send(rows if len(rows) > 1 else rows[0], max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, greedy=args.greedy, seed=args.seed,
                         stop=None if eot is None else [eot])
    if args.compile:
        print("compile: the first decode step compiles it once (tens of seconds on a CPU)", file=sys.stderr, flush=True)
    streams = [TextStream(tok, args.stop) for _ in rows]
    out, t0 = sys.stdout, time.perf_counter()
    scores = None if args.logprobs is None and not args.json else Scores(tok, args.logprobs or 0, args.json, out)
    if len(rows) == 1 and not args.json:
        out.write(prompts[0])
        out.flush()
    with scores.listening() if scores else contextlib.nullcontext():
        made, marks = _stream(session, steps, streams, eot, out, lambda: time.perf_counter() - t0, scores)
    if args.json:
        pass  # the JSON lines were the output
    elif len(rows) == 1:
        out.write(streams[0].flush() + "\n")
    else:
        _write_batch(out, prompts, streams, args.num_samples)
    if scores is not None and not args.json:
        scores.write_table()
    out.flush()
    print(_summary(made, time.perf_counter() - t0, marks, args.compile), file=sys.stderr)
    return 0
