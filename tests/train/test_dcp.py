"""--checkpoint-format dcp: sharded checkpoints written with torch.distributed.checkpoint resume at
the same and at another world size (2 processes -> 1 here; 1 -> 2, across two "nodes", in
test_multinode.py) on the losses of the uninterrupted one-file run, and read as one model file
(load, generate, convert)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glassformer.checkpoint.folders import write_pointer
from glassformer.checkpoint.loading import load
from glassformer.cli import main

from ..support import data  # noqa: F401  (a fixture)
from .test_train_distributed import ARGS, torchrun, train_losses, val_losses

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]  # DCP's one-process note

DCP = ["--checkpoint-format", "dcp"]


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    """The reference: one process, the one-file format, 20 steps uninterrupted."""
    out = tmp_path_factory.mktemp("one") / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS]) == 0
    return out


@pytest.fixture(scope="module")
def sharded(data, tmp_path_factory):
    """The same run in one process with --checkpoint-format dcp."""
    out = tmp_path_factory.mktemp("dcp") / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, *DCP]) == 0
    return out


def cut_back_to_step_10(run: Path, where: Path) -> Path:
    """A copy of the run as if it had stopped after its step-10 checkpoint."""
    shutil.copytree(run, where)
    shutil.rmtree(where / "step-000020")
    write_pointer(where, "latest", "step-000010")
    return where


def test_dcp_run_writes_shards_and_matches_the_one_file_run(single, sharded):
    ckpt = sharded / "step-000010"
    assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "dcp" / "__0_0.distcp").is_file()
    assert not (ckpt / "model.safetensors").exists()  # nothing gathered while training
    assert train_losses(sharded) == train_losses(single)  # the format changes no step


def test_dcp_resumes_exactly_in_one_process(data, single, sharded, tmp_path):
    resumed = cut_back_to_step_10(sharded, tmp_path / "resumed")
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 0
    assert train_losses(resumed) == train_losses(single)
    assert val_losses(resumed) == val_losses(single)


def test_muon_run_resumes_exactly_from_dcp(data, tmp_path):
    """Muon and AdamW side by side (optim.Optimizers): both optimizers' state goes into the shards."""
    muon = ["--optimizer", "muon", "--max-steps", "6", "--eval-every", "3"]
    one, two = tmp_path / "one", tmp_path / "dcp"
    assert main(["train", "--data", str(data), "--out", str(one), *ARGS, *muon]) == 0
    assert main(["train", "--data", str(data), "--out", str(two), *ARGS, *muon, *DCP]) == 0
    shutil.rmtree(two / "step-000006")
    write_pointer(two, "latest", "step-000003")
    assert main(["train", "--data", str(data), "--out", str(two), "--resume", "--no-progress"]) == 0
    assert train_losses(two) == train_losses(one)


def test_load_consolidates_one_file_equal_to_the_one_file_runs(single, sharded, tmp_path):
    """load() of a sharded checkpoint: model.safetensors made once beside dcp/, holding the same
    tensors the one-file run saved (its own file the independent reference)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded / "step-000020", ckpt)
    model, tok = load(ckpt)
    assert tok is not None
    want = load_file(str(single / "step-000020" / "model.safetensors"))
    got = load_file(str(ckpt / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def test_generate_and_convert_read_a_sharded_checkpoint(sharded, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sharded / "step-000020", ckpt)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "the", "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert main(["convert", "--to-hf", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow  # a torchrun of 2 processes and a resume: about 20 s on 2 busy cores
def test_two_processes_to_one(data, single, tmp_path):
    """FSDP2 on 2 processes writes each rank's shards; one process resumes from them."""
    out = tmp_path / "two"
    torchrun(out, data, "--fsdp", *DCP)
    assert sorted(p.name for p in (out / "step-000010" / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert train_losses(out) == pytest.approx(train_losses(single), abs=1e-5, rel=0)
    resumed = cut_back_to_step_10(out, tmp_path / "resumed")
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 0
    assert train_losses(resumed) == pytest.approx(train_losses(single), abs=1e-5, rel=0)


def test_a_background_save_holds_the_state_of_its_step(tmp_path):
    """dcp.async_save returns before the writes end; the checkpoint must hold the weights and moments
    as they were when it was asked for, not as the steps after it changed them, and `latest` and
    a pointer waiting on it move only once the folder is complete."""
    from glassformer.checkpoint import dcp
    from glassformer.checkpoint.folders import read_pointer
    from glassformer.config import ModelConfig
    from glassformer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moment = opt.state[model.embed.weight]["exp_avg"].clone()
    dcp.save_sharded(tmp_path, 1, model.config, model, opt, None, {"step": 1}, {}, main=True)
    assert str(tmp_path) in dcp._pending and read_pointer(tmp_path, "latest") is None  # still writing
    dcp.when_complete(tmp_path, lambda: (tmp_path / "marker").write_text("x"))
    with torch.no_grad():  # the next steps change every tensor in place
        for p in model.parameters():
            p.add_(1.0)
        opt.state[model.embed.weight]["exp_avg"].add_(1.0)
    dcp.finish_pending(tmp_path)
    assert read_pointer(tmp_path, "latest") == "step-000001" and (tmp_path / "marker").is_file()
    model2 = Transformer(ModelConfig.from_preset("tiny", vocab_size=64))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    dcp.load_sharded(tmp_path / "step-000001", model2, opt2)
    assert all(torch.equal(model2.state_dict()[k], want[k]) for k in want)
    assert torch.equal(opt2.state[model2.embed.weight]["exp_avg"], moment)


def test_a_stop_completes_the_save_still_being_written(data, tmp_path, monkeypatch, capsys):
    """A non-finite loss at step 13 stops the run while step 10's background save may still be
    writing: that checkpoint is completed first, and named as the last good one."""
    from glassformer.checkpoint.folders import complete_checkpoints, read_pointer

    from .test_train import inject

    out = tmp_path / "run"
    inject(monkeypatch, 13, lambda loss: loss * float("nan"))
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, *DCP]) == 2
    assert "step-000010" in capsys.readouterr().err
    assert read_pointer(out, "latest") == read_pointer(out, "best") == "step-000010"
    assert [p.name for p in complete_checkpoints(out)] == ["step-000010"]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


def test_a_failed_background_write_is_one_line_and_leaves_nothing(data, tmp_path, monkeypatch, capsys):
    """A write that fails in the background (here: a value DCP cannot serialise) stops the run at the
    next save with one line, its temporary shards removed and no pointer moved."""
    from glassformer.checkpoint import dcp
    from glassformer.checkpoint.folders import read_pointer

    real = dcp._states
    monkeypatch.setattr(dcp, "_states", lambda net, opt: {**real(net, opt), "bad": lambda: 0})
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, *DCP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: could not write checkpoint") and "background write of step-000010 failed: rank 0: " in err[-1]
    assert read_pointer(out, "latest") is None and read_pointer(out, "best") is None
    assert not [p for p in out.iterdir() if p.name.startswith((".", "step-"))]


# ----------------------------------------------------------------------------- bad input


def test_unknown_format_is_one_line(data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", str(data), "--out", str(tmp_path / "x"), "--checkpoint-format", "zip"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'zip' is not a checkpoint format: choose safetensors" in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()


def test_a_sharded_checkpoint_missing_a_file_is_one_line(data, sharded, tmp_path, capsys):
    resumed = cut_back_to_step_10(sharded, tmp_path / "resumed")
    (resumed / "step-000010" / "dcp" / "__0_0.distcp").unlink()
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "dcp is missing __0_0.distcp of its 1 data files" in err[-1]
    assert main(["generate", "--checkpoint", str(resumed), "--prompt", "a", "--max-new-tokens", "1"]) == 2
    assert "missing __0_0.distcp" in capsys.readouterr().err
    (resumed / "step-000010" / "dcp" / ".metadata").unlink()
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 2
    assert "has no .metadata: the sharded checkpoint is incomplete" in capsys.readouterr().err


def test_dcp_with_lora_is_refused(data, single, tmp_path, capsys):
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "x"), "--init-from", str(single),
                 "--lora-r", "2", *DCP, "--max-steps", "1", "--no-progress"])
    assert code == 2
    assert "a LoRA run's checkpoints hold the adapter alone" in capsys.readouterr().err
