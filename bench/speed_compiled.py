"""What glassformer.speed buys a compiled decode step: a compiled Session on the reference shape with
speed installed (RowsLinear: a one-row product is a multiply-and-sum inductor streams) against the
same Session with speed=False (F.linear, the plain model), each in a fresh process, alternating.

    python bench/speed_compiled.py [--rounds 2] [--threads 2]   # bench/results/speed_compiled.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def measure(use_speed: bool, threads: int, tokens: int = 128, repeats: int = 5) -> dict:
    """Tokens/s of a compiled Session's greedy decode (median of `repeats`, after its compile)."""
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.config import REFERENCE_SHAPE
    from glassformer.generation.session import Session

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).eval()
    s = Session(model, max_len=256, speed=use_speed, compile=True)
    prompt = list(range(16))
    t = time.perf_counter()
    list(s.send(prompt, max_new_tokens=8, greedy=True))  # compiles the step
    compile_s = time.perf_counter() - t
    rates, out = [], None
    for _ in range(repeats):
        s.reset()
        t = time.perf_counter()
        out = list(s.send(prompt, max_new_tokens=tokens, greedy=True))
        rates.append(tokens / (time.perf_counter() - t))
    return {"tokens_per_s": statistics.median(rates), "compile_s": compile_s, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["speed", "plain"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "speed_compiled.json"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "speed", args.threads)))
        return
    runs = {"speed": [], "plain": []}
    for r in range(args.rounds):
        for kind in (("speed", "plain") if r % 2 == 0 else ("plain", "speed")):
            cmd = [sys.executable, __file__, "--child", kind, "--threads", str(args.threads)]
            runs[kind].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    med = {k: statistics.median(x["tokens_per_s"] for x in v) for k, v in runs.items()}
    same = all(x["tokens"] == runs["plain"][0]["tokens"] for v in runs.values() for x in v)
    result = {"threads": args.threads, "rounds": args.rounds, "tokens_per_s": med, "speed_vs_plain": med["speed"] / med["plain"],
              "identical_tokens": same, "runs": {k: [{a: b for a, b in x.items() if a != "tokens"} for x in v] for k, v in runs.items()}}
    write_json(args.out, result)
    print(f"compiled decode: speed {med['speed']:.0f} tok/s, plain {med['plain']:.0f} tok/s, "
          f"{result['speed_vs_plain']:.2f}x; identical tokens: {same}")


if __name__ == "__main__":
    main()
