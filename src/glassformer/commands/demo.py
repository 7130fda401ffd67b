"""`glassformer demo`: the main job (what `make demo` runs).

Prepare the default corpus (cached after the first time), train the `small` preset on the
CPU for a couple of minutes, print samples, and write a trace page when tracing is installed.
"""

from __future__ import annotations

HELP = "the main job: prepare Shakespeare, train the small model for ~2 CPU minutes, print samples"

PROMPTS = ["ROMEO:", "To be, or not to be", "The king"]


def add_arguments(p) -> None:
    p.add_argument("--out", default="demo-out", help="folder for everything the demo writes (data/, run/, trace.html)")
    p.add_argument("--corpus", default=None, help="a text file or folder to use instead of the embedded Shakespeare")
    p.add_argument("--budget", type=float, default=120.0, help="seconds of training (the step count is fixed from the first steps)")
    p.add_argument("--preset", default="small", help="model preset to train")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto")
    p.add_argument("--tokens", type=int, default=100, help="tokens to sample after each prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the training run and of the sampling")


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

    out = Path(args.out)
    data, run_dir = out / "data", out / "run"
    out.mkdir(parents=True, exist_ok=True)

    print("== 1/3 data", flush=True)
    if (data / "meta.json").is_file() and (data / "train.bin").is_file():
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
