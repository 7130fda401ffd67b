"""What Muon's Newton–Schulz costs a training step (train --optimizer muon, train/optim.py).

Side by side in one process on one model, alternating: the forward and backward of a training
batch; the optimizer step with --optimizer adamw (fused AdamW on every weight) and with
--optimizer muon (torch.optim.Muon on the block matrices, AdamW on the rest); and the five bf16
Newton–Schulz iterations alone on every block matrix's gradient (torch's own function,
torch.optim._muon._zeropower_via_newtonschulz). Medians of the rounds, seconds.

    python bench/muon.py [--preset small] [--reference-shape] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from _common import timed, write_json  # noqa: E402  (bench/ is the script's folder)

from glassformer import ModelConfig, Transformer  # noqa: E402
from glassformer.config import REFERENCE_SHAPE, TrainConfig  # noqa: E402
from glassformer.train.optim import is_block_matrix, make_muon, make_optimizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=TrainConfig.preset)
    ap.add_argument("--reference-shape", action="store_true", help="config.REFERENCE_SHAPE (15.7M weights) instead")
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--seq-len", type=int, default=0, help="0: the model's context, at most 256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 rounds (a smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(**REFERENCE_SHAPE) if args.reference_shape else ModelConfig.from_preset(args.preset)
    T = args.seq_len or min(256, cfg.max_seq_len)
    model, cpu = Transformer(cfg).train(), torch.device("cpu")
    adamw = make_optimizer(model, 1e-3, 0.1, (0.9, 0.99), cpu)
    muon = make_muon(model, 1e-3, 0.02, 0.95, 0.1, (0.9, 0.99), cpu)
    x, y = (torch.randint(0, cfg.vocab_size, (args.batch_size, T)) for _ in range(2))
    matrices = [p for n, p in model.named_parameters() if is_block_matrix(n)]

    def backward():
        model.zero_grad(set_to_none=True)
        model(x, y)[1].backward()

    def newton_schulz():
        for p in matrices:
            _zeropower_via_newtonschulz(p.grad, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7)

    backward(), adamw.step(), muon.step(), newton_schulz()  # warm-up; the weights' values do not change the cost
    t = {"forward_backward": [], "adamw_step": [], "muon_step": [], "newton_schulz": []}
    for _ in range(rounds):
        t["forward_backward"].append(timed(backward))
        t["adamw_step"].append(timed(adamw.step))
        t["muon_step"].append(timed(muon.step))
        t["newton_schulz"].append(timed(newton_schulz))
    med = {k: statistics.median(v) for k, v in t.items()}
    shape = "reference" if args.reference_shape else args.preset
    res = {"model": shape, "weights": model.num_params(), "block_matrices": len(matrices),
           "batch": [args.batch_size, T], "threads": args.threads, "rounds": rounds,
           "sec": {k: round(v, 5) for k, v in med.items()},
           "muon_step_over_adamw_step": round(med["muon_step"] / med["adamw_step"], 2),
           "newton_schulz_over_training_step": round(med["newton_schulz"] / (med["forward_backward"] + med["adamw_step"]), 3),
           "muon_training_step_over_adamw": round((med["forward_backward"] + med["muon_step"])
                                                  / (med["forward_backward"] + med["adamw_step"]), 3),
           "torch": torch.__version__}
    print(res)
    write_json(args.out or REPO / "bench" / "results" / f"muon_{shape}.json", res)


if __name__ == "__main__":
    main()
