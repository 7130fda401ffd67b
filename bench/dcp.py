"""Save and load time of a sharded (dcp) training checkpoint against the one-file (safetensors) one.

The reference shape (config.REFERENCE_SHAPE) with AdamW's moments filled by one step, in one
process, on the CPU: the state `glassformer train` checkpoints. Per round, alternating between
the formats, each written into a fresh run folder the way training writes it:
  safetensors  full_states (the gather) + save_training, then load_training + load_state_dict + load_optimizer
  dcp          save_sharded waited for (dcp.save), and with dcp.async_save the time until training
               may go on (the CPU copy) and until the folder is complete; then load_sharded
Reads follow the writes, so both formats read from the page cache. Medians over the rounds.

    flock /tmp/glassformer-bench.lock python bench/dcp.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.checkpoint import dcp  # noqa: E402
from glassformer.checkpoint.training import load_training, save_training  # noqa: E402
from glassformer.config import REFERENCE_SHAPE  # noqa: E402
from glassformer.train.distributed import full_states, load_optimizer  # noqa: E402
from glassformer.train.optim import make_optimizer  # noqa: E402

STATE = {"step": 1}  # train_state.json's fields matter nothing here


def trained(seed: int = 0):
    """(model, AdamW) at the reference shape after one step, so every moment exists."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**REFERENCE_SHAPE)).train()
    opt = make_optimizer(model, 1e-4, 0.1, (0.9, 0.95), torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def one_file(model, opt, run: Path) -> dict:
    t0 = time.perf_counter()
    model_sd, optim_sd = full_states(model, opt)
    folder = save_training(run, 1, model.config, model_sd, None, optim_sd, STATE, {})
    save = time.perf_counter() - t0
    fresh, fresh_opt = trained(seed=1)
    t0 = time.perf_counter()
    model_sd, optim_sd, _, _ = load_training(folder)
    fresh.load_state_dict(model_sd, strict=False)  # a tied head is stored once
    load_optimizer(fresh, fresh_opt, optim_sd)
    load = time.perf_counter() - t0
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    return {"save_s": save, "load_s": load, "bytes": folder_bytes(folder)}


def sharded(model, opt, run: Path, background: bool) -> dict:
    t0 = time.perf_counter()
    dcp.save_sharded(run, 1, model.config, model, opt, None, STATE, {}, main=True, background=background)
    returned = time.perf_counter() - t0
    dcp.finish_pending(run)
    save = time.perf_counter() - t0
    fresh, fresh_opt = trained(seed=1)
    t0 = time.perf_counter()
    dcp.load_sharded(run / "step-000001", fresh, fresh_opt)
    load = time.perf_counter() - t0
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    out = {"save_s": save, "load_s": load, "bytes": folder_bytes(run / "step-000001")}
    if background:
        out["blocking_s"] = returned  # what a training step waits for: the CPU copy
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "dcp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, opt = trained()
    kinds = {"safetensors": lambda r: one_file(model, opt, r), "dcp": lambda r: sharded(model, opt, r, False),
             "dcp async": lambda r: sharded(model, opt, r, True)}
    runs = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, fn in kinds.items():
            run = Path(tempfile.mkdtemp(prefix="glassformer-dcp-bench-"))
            try:
                runs[kind].append(fn(run))
            finally:
                shutil.rmtree(run, ignore_errors=True)
    result = {"shape": REFERENCE_SHAPE, "weights": model.num_params(), "threads": args.threads,
              "rounds": args.rounds, "torch": torch.__version__}
    for kind, rs in runs.items():
        result[kind] = {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
        print(f"{kind:12s} " + "  ".join(f"{k} {v}" for k, v in result[kind].items()))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
