"""`glassformer demo`: the main job (what `make demo` runs).

Prepare the default corpus (cached after the first time), train the `small` preset on the
CPU for a couple of minutes, print samples, and write a trace page when tracing is installed.
`--induction`: the induction-heads demo instead (docs/training.md#the-induction-heads-demo).
"""

from __future__ import annotations

from .options import add_device_argument, seed_type

HELP = "the main job: prepare Shakespeare, train the small model for ~2 CPU minutes, print samples"

PROMPTS = ["ROMEO:", "To be, or not to be", "The king"]


def add_arguments(p) -> None:
    p.add_argument("--out", default="demo-out", help="folder for everything the demo writes (data/, run/, trace.html)")
    p.add_argument("--corpus", default=None, help="a text file or folder to use instead of the embedded Shakespeare")
    p.add_argument("--budget", type=float, default=120.0, help="seconds of training (the step count is fixed from the first steps)")
    p.add_argument("--preset", default=None, help="model preset to train (default: small; induction with --induction)")
    add_device_argument(p, "cpu", auto=True)
    p.add_argument("--tokens", type=int, default=100, help="tokens to sample after each prompt")
    p.add_argument("--seed", type=seed_type(), default=0, help="seed of the training run and of the sampling")
    p.add_argument("--induction", action="store_true",
                   help="the induction-heads demo instead: a two-layer attention-only model on repeated random "
                        "tokens, its induction score at each evaluation, into OUT/induction/")
    p.add_argument("--steps", type=int, default=None, help="with --induction: training steps (default: the demo's recipe)")
    p.add_argument("--every", type=int, default=None,
                   help="with --induction: steps between evaluations, snapshots and scores (default: the recipe's)")


def sample_ids(model, ids: list[int], n: int, seed: int, temperature: float = 0.8, top_k: int = 40) -> list[int]:
    """n sampled token ids after ids; the window slides when prompt + sample outgrow the context."""
    from ..generation.session import generate

    return list(generate(model, ids, max_new_tokens=n, temperature=temperature, top_k=top_k, seed=seed,
                         context_policy="slide"))


def run(args) -> int:
    import shutil
    from pathlib import Path

    from ..checkpoint.loading import load
    from ..cli import main

    if args.induction:
        return run_induction(args)
    args.preset = args.preset or "small"
    out = Path(args.out)
    data, run_dir = out / "data", out / "run"
    out.mkdir(parents=True, exist_ok=True)

    print("== 1/3 data", flush=True)
    if (data / "meta.json").is_file() and ((data / "train.bin").is_file() or (data / "train_000000.bin").is_file()):
        print(f"using the prepared corpus in {data} (delete it to prepare again)")
    else:
        argv = ["prepare", "--out", str(data)] + (["--corpus", args.corpus] if args.corpus else [])
        if main(argv) != 0:
            return 2

    print(f"\n== 2/3 training the {args.preset} preset for {args.budget:g} s on {args.device}", flush=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run each time: the demo shows training from scratch
    status = main(["train", "--data", str(data), "--out", str(run_dir), "--preset", args.preset,
                   "--time-budget", str(args.budget), "--device", args.device, "--seed", str(args.seed)])
    if status != 0:
        return status

    print("\n== 3/3 samples (temperature 0.8, top-k 40)", flush=True)
    model, tok = load(run_dir)
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt)
        text = tok.decode(sample_ids(model, ids, args.tokens, args.seed + i))
        print(f"--- {prompt}{text}\n")

    print("== what this model costs (batch 8 at its full context, on this CPU)", flush=True)
    from ..cost import estimate, format_table

    print(format_table(estimate(model.config, batch=8, seq=model.config.max_seq_len, hardware="cpu")))

    page = out / "trace.html"
    if main(["trace", "--checkpoint", str(run_dir), "--text", "To be, or not to be", "--html", str(page)]) == 0:
        print(f"\ntrace page: {page.resolve()} (open it in a browser, or `glassformer view --checkpoint {run_dir}`)")
    print(f"\nrun folder: {run_dir} (loss.png, metrics.jsonl, checkpoints)")
    print(f"next: glassformer generate --checkpoint {run_dir} --prompt 'ROMEO:'   |   "
          f"glassformer eval --checkpoint {run_dir} --data {data}")
    return 0


# ----------------------------------------------------------------------------- --induction


def run_induction(args) -> int:
    """The induction-heads demo: repeat data, a training run that keeps snapshots, then each
    snapshot's induction score into metrics.jsonl, induction.json and induction.png."""
    import shutil
    from pathlib import Path

    from ..errors import UserError
    from ..train.induction import RECIPE

    steps = RECIPE["steps"] if args.steps is None else args.steps
    every = RECIPE["every"] if args.every is None else args.every
    if steps < 1 or every < 1:
        raise UserError(f"--steps ({steps}) and --every ({every}) must be at least 1")
    if args.corpus:
        raise UserError("--corpus does not go with --induction: that demo's data are random tokens made in the run")
    every = min(every, steps)
    out = Path(args.out) / "induction"
    data, run_dir = out / "data", out / "run"
    print(f"== 1/3 data: blocks of {RECIPE['T']} tokens, random segments of {RECIPE['lo']}-{RECIPE['hi']} "
          f"written again and again", flush=True)
    _induction_data(data)
    print(f"\n== 2/3 training a two-layer attention-only model for {steps} steps on {args.device}", flush=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run each time: the demo shows the phase change from scratch
    status = _induction_train(args, data, run_dir, steps, every)
    if status != 0:
        return status
    print("\n== 3/3 the induction score at each snapshot", flush=True)
    _induction_report(run_dir)
    return 0


def _induction_data(data) -> None:
    from ..train.induction import RECIPE, write_repeat_data

    r = RECIPE
    meta = write_repeat_data(data, r["T"], r["lo"], r["hi"], r["train_blocks"], r["val_blocks"], r["data_seed"])
    print(f"{data}: {meta['train_tokens']:,} training and {meta['val_tokens']:,} held-out tokens, {meta['vocab_size']} ids")


def _induction_train(args, data, run_dir, steps: int, every: int) -> int:
    from ..cli import main
    from ..train.induction import RECIPE

    r = RECIPE
    return main(["train", "--data", str(data), "--out", str(run_dir), "--preset", args.preset or "induction",
                 "--max-steps", str(steps), "--eval-every", str(every), "--snapshot-every", str(every),
                 "--batch-size", str(r["batch_size"]), "--lr", str(r["lr"]), "--min-lr", str(r["min_lr"]),
                 "--warmup-steps", str(min(r["warmup_steps"], steps)), "--eval-tokens", str(r["eval_tokens"]),
                 "--seq-len", str(r["T"]), "--device", args.device, "--seed", str(args.seed)])


def _induction_report(run_dir) -> None:
    import json

    from ..train.induction import RECIPE, eval_batch_for, plot_induction, score_records, score_run, summary
    from ..train.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    rows = score_run(run_dir, eval_batch_for(RECIPE))
    records = read_metrics(metrics)
    with open(metrics, "a") as f:
        for rec in score_records(rows, records):
            f.write(json.dumps(rec) + "\n")
    found = summary(rows, records)
    (run_dir / "induction.json").write_text(json.dumps({**found, "recipe": RECIPE, "scores": rows}, indent=2) + "\n")
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    print(f"{'step':>6}  {'held-out loss':>13}  {'induction score':>15}  previous-token score (layer 0, best head)")
    for row in rows:
        prev = max(row["previous_token_heads"]["blocks.0.attn"])
        print(f"{row['step']:>6}  {val.get(row['step'], float('nan')):>13.4f}  {row['induction_score']:>15.3f}  {prev:.3f}")
    drawn = plot_induction(read_metrics(metrics), rows, run_dir / "induction.png", found)
    print(f"\nthe induction score jumps at step {found['jump_step']} ({_pair(found['score_around_jump'])}); "
          f"the held-out loss drops at step {found['drop_step']} ({_pair(found['val_loss_around_drop'])})"
          + _apart(found, rows))
    print(f"run folder: {run_dir} (metrics.jsonl, induction.json" + (", induction.png" if drawn else "") + ", snapshots)")
    print(f"next: glassformer view --run {run_dir} --text '{RECIPE['view_text']}'")


def _apart(found: dict, rows: list[dict]) -> str:
    """', within one evaluation interval' when the two steps are that close."""
    a, b = found["jump_step"], found["drop_step"]
    if a is None or b is None or len(rows) < 2:
        return ""
    every = rows[1]["step"] - rows[0]["step"]
    return ": the same step" if a == b else (f": within one evaluation interval ({every} steps)" if abs(a - b) <= every else "")


def _pair(v) -> str:
    return "n/a" if v is None else f"{v[0]:.3f} -> {v[1]:.3f}"
