"""LoRA fine-tuning through `glassformer train --init-from CKPT --lora-r R`: a small trained base
fine-tuned on a new text lowers that text's held-out bits per byte; the run's checkpoints hold the
adapter alone and load onto the base; step 0 is the base; resume is bitwise; the bad flags."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from glassformer.checkpoint.folders import read_pointer, resolve
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.convert.lora import LORA_TARGETS, base_sha256, lora_modules
from glassformer.train.metrics import read_metrics

from ..support import WORDS, data  # noqa: F401  (a fixture)

COMMON = ["--batch-size", "8", "--seq-len", "32", "--eval-tokens", "1024", "--log-every", "1", "--no-progress",
          "--threads", "1", "--seed", "3"]
LORA = ["--lora-r", "4", "--lr", "1e-2", "--min-lr", "1e-3", "--warmup-steps", "2", "--max-steps", "16",
        "--eval-every", "8", "--keep-last", "10"]


def new_text(n: int, seed: int) -> str:
    """Sentences of the same words in another order (each word followed by the one 3 before it),
    so the base's tokenizer covers them and its predictions are wrong."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        start, k = rng.randrange(len(WORDS)), rng.randint(4, 10)
        lines.append(" ".join(WORDS[(start - 3 * i) % len(WORDS)] for i in range(k)).capitalize() + ".")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def setup(data, tmp_path_factory):  # noqa: F811
    """(root, base run, new-text data, LoRA run): the base trained on `data`, then adapted on a new text."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    assert main(["train", "--data", str(data), "--out", str(base), "--preset", "tiny", "--max-steps", "60",
                 "--eval-every", "0", "--lr", "1e-2", "--warmup-steps", "5", *COMMON]) == 0
    (root / "new.txt").write_text(new_text(600, 5))
    new = root / "new"
    assert main(["prepare", "--corpus", str(root / "new.txt"), "--tokenizer", str(data / "tokenizer.json"),
                 "--out", str(new), "--context", "32", "--val-fraction", "0.2"]) == 0
    run = root / "lora"
    assert main(["train", "--data", str(new), "--out", str(run), "--init-from", str(base), *LORA, *COMMON]) == 0
    return root, base, new, run


def bpb(capsys, ckpt, data_dir) -> float:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(data_dir)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bpb"]


def test_lora_fine_tuning_lowers_the_new_texts_held_out_bpb(setup, capsys):
    root, base, new, run = setup
    before, after = bpb(capsys, base, new), bpb(capsys, run, new)
    assert after < before - 0.1, (before, after)


def test_checkpoints_hold_the_adapter_alone_and_load_onto_the_base(setup):
    root, base, new, run = setup
    ckpt = run / read_pointer(run, "latest")
    assert (ckpt / "adapter.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    meta = json.loads((ckpt / "config.json").read_text())
    base_model, _ = load(base)
    assert meta["lora"]["r"] == 4 and meta["lora"]["targets"] == list(LORA_TARGETS)
    assert meta["lora"]["base"] == {"path": str(base), "sha256": base_sha256(base_model)}  # given absolute: kept so
    model, _ = load(run)
    assert len(lora_modules(model)) == len(LORA_TARGETS) * model.config.n_layers
    assert base_sha256(model) == base_sha256(base_model)  # the base was never trained
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert not torch.equal(model(ids)[0], base_model(ids)[0])  # the adapter was


def test_step_zero_is_the_base(setup):
    from glassformer.config import TrainConfig
    from glassformer.train.setup import build_model

    root, base, new, run = setup
    meta = json.loads((new / "meta.json").read_text())
    model, _ = build_model(TrainConfig(data=str(new), out=str(root / "x"), init_from=str(base), lora_r=4), meta)
    base_model, _ = load(base)
    ids = torch.tensor([[5, 4, 3, 2, 1, 9]])
    assert torch.equal(model.eval()(ids)[0], base_model(ids)[0])
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in dict(model.named_parameters()) if n.endswith(("lora_A", "lora_B"))}


def test_resume_is_bitwise(setup, tmp_path, monkeypatch, capsys):
    import glassformer.train.step as T
    from safetensors.torch import load_file

    root, base, new, run = setup
    args = ["--data", str(new), "--init-from", str(base), *LORA, *COMMON, "--lora-dropout", "0.1",
            "--max-steps", "8", "--eval-every", "4"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert main(["train", "--out", str(ref), *args]) == 0
    real, calls = T.forward_loss, {"n": 0}

    def hooked(model, x, y):  # SIGINT during step 6: the loop saves step-000006 and exits 130
        calls["n"] += 1
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGINT)
        return real(model, x, y)

    monkeypatch.setattr(T, "forward_loss", hooked)
    assert main(["train", "--out", str(out), *args]) == 130
    monkeypatch.undo()
    assert main(["train", "--data", str(new), "--out", str(out), "--resume", "--no-progress"]) == 0

    def losses(r):
        return [m["loss"] for m in read_metrics(r / "metrics.jsonl") if "loss" in m and "val_loss" not in m]

    assert losses(out) == losses(ref) and len(losses(ref)) == 8
    a, b = (load_file(str(r / "step-000008" / "adapter.safetensors")) for r in (ref, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("flags, message", [
    (["--lora-r", "0"], "at least 1"),
    (["--lora-r", "4", "--lora-alpha", "0"], "alpha"),
    (["--lora-r", "4", "--lora-targets", "wq,w_mid"], "w_mid is not"),
    (["--lora-alpha", "32"], "--lora-alpha goes with --lora-r"),
])
def test_bad_lora_flags_are_refused_and_nothing_is_written(setup, tmp_path, capsys, flags, message):
    import re

    root, base, new, run = setup
    out = tmp_path / "bad"
    assert main(["train", "--data", str(new), "--out", str(out), "--init-from", str(base), *COMMON, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and re.search(message, err), err
    assert not out.exists() or not any(out.iterdir())


def test_lora_needs_init_from(setup, tmp_path, capsys):
    root, base, new, run = setup
    assert main(["train", "--data", str(new), "--out", str(tmp_path / "r"), "--preset", "tiny", "--lora-r", "4",
                 *COMMON]) == 2
    assert "--init-from" in capsys.readouterr().err


def test_init_from_an_adapter_run_trains_it_further_or_merged(setup, tmp_path):
    root, base, new, run = setup
    short = ["--data", str(new), "--init-from", str(run), *COMMON, "--max-steps", "2", "--eval-every", "0",
             "--warmup-steps", "1"]
    assert main(["train", "--out", str(tmp_path / "more"), *short, "--lora-r", "4"]) == 0
    ckpt = tmp_path / "more" / "step-000002"
    meta = json.loads((ckpt / "config.json").read_text())
    first = json.loads((run / read_pointer(run, "latest") / "config.json").read_text())
    assert meta["lora"]["base"]["sha256"] == first["lora"]["base"]["sha256"]  # the same base, found again
    assert Path(meta["lora"]["base"]["path"]).resolve() == resolve(base).resolve()  # the base run's checkpoint
    assert main(["train", "--out", str(tmp_path / "more2"), *short, "--lora-r", "8"]) == 2  # not its rank
    assert main(["train", "--out", str(tmp_path / "full"), *short]) == 0  # no --lora-r: its merged weights train
    full = tmp_path / "full" / "step-000002"
    assert (full / "model.safetensors").is_file() and "lora" not in json.loads((full / "config.json").read_text())
