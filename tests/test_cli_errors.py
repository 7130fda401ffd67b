"""Bad flags and bad files on the command line: one `error:` line naming the flag or file and what to
do, exit status 2, no traceback, before any model is loaded (the contract in docs/training.md#bad-input)."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from glassformer.cli import main

from .support import data, one_error, synthetic_text, tiny_checkpoint  # noqa: F401  (a fixture)

BIG_SEED = str(2 ** 70)
BINARY = bytes(range(128, 256)) * 8  # no UTF-8 text starts with 0x80


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    tiny_checkpoint(path, synthetic_text(100, 0))
    return str(path)


@pytest.fixture
def no_load(monkeypatch):
    """Loading a checkpoint fails the test: the flags are checked first."""
    import glassformer.checkpoint.loading as loading

    def refuse(*a, **kw):
        raise AssertionError("a checkpoint was loaded before the flags were checked")

    monkeypatch.setattr(loading, "load", refuse)


def verbs_with_device(ckpt: str, tmp: str) -> dict[str, list[str]]:
    """Each verb that takes --device, with the other arguments it needs."""
    return {
        "generate": ["generate", "--checkpoint", ckpt, "--prompt", "the"],
        "chat": ["chat", "--checkpoint", ckpt],
        "serve": ["serve", "--checkpoint", ckpt, "--port", "0"],
        "trace": ["trace", "--checkpoint", ckpt, "--text", "the", "--out", f"{tmp}/t.json"],
        "view": ["view", "--checkpoint", ckpt, "--port", "0"],
        "eval": ["eval", "--checkpoint", ckpt, "--data", f"{tmp}/x.txt"],
        "train": ["train", "--data", f"{tmp}/data", "--out", f"{tmp}/run"],
        "demo": ["demo", "--out", f"{tmp}/demo"],
    }


VERBS = ["generate", "chat", "serve", "trace", "view", "eval", "train", "demo"]


# ----------------------------------------------------------------------------- --device


@pytest.mark.parametrize("verb", VERBS)
def test_a_bogus_device_lists_the_devices(ckpt, tmp_path, capsys, no_load, verb):
    argv = verbs_with_device(ckpt, str(tmp_path))[verb] + ["--device", "bogus"]
    one_error(capsys, argv, "--device", "'bogus' is not a device", "cpu, cuda, cuda:N or mps")
    for bad in ("cuda:x", "cuda:", "CPU", "cuda:-1"):
        one_error(capsys, argv[:-1] + [bad], "--device", "cuda:N")


@pytest.mark.parametrize("verb", ["generate", "chat", "serve", "trace", "view", "eval"])
def test_a_gpu_that_is_not_here_is_said_before_loading(ckpt, tmp_path, capsys, no_load, verb):
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the GPUs PyTorch sees: absent on every machine
    argv = verbs_with_device(ckpt, str(tmp_path))[verb] + ["--device", absent]
    one_error(capsys, argv, f"--device {absent}", "CUDA GPU")
    if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        one_error(capsys, argv[:-1] + ["mps"], "--device mps", "no MPS backend")


def test_train_says_a_missing_gpu_before_reading_the_data(data, tmp_path, capsys):
    absent = f"cuda:{torch.cuda.device_count()}"
    one_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--device", absent],
              f"--device {absent}")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- --seed


@pytest.mark.parametrize("verb", ["generate", "chat", "train", "demo"])
def test_a_seed_out_of_range_is_refused_by_the_parser(ckpt, tmp_path, capsys, no_load, verb):
    argv = verbs_with_device(ckpt, str(tmp_path))[verb]
    one_error(capsys, argv + ["--seed", BIG_SEED], "--seed", BIG_SEED, "0 to 9223372036854775807")
    one_error(capsys, argv + ["--seed", "-1"], "--seed", "0 to 9223372036854775807")
    one_error(capsys, argv + ["--seed", "1.5"], "--seed", "not a whole number")


def test_eval_harness_seeds_stop_at_numpy_range(ckpt, tmp_path, capsys, no_load):
    # lm-evaluation-harness seeds numpy with it too, which takes 0 … 2**32-1
    one_error(capsys, ["eval", "--checkpoint", ckpt, "--tasks", "x", "--seed", str(2 ** 32)], "--seed", "0 to 4294967295")


def test_the_largest_seed_works(ckpt, capsys):
    assert main(["generate", "--checkpoint", ckpt, "--prompt", "the", "--max-new-tokens", "3",
                 "--seed", str(2 ** 63 - 1)]) == 0
    capsys.readouterr()


def test_a_seed_in_a_config_file_is_checked_too(data, tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"seed": 2 ** 70}))
    one_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--config", str(config)],
              str(config), "seed")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- train --out


def test_train_out_an_existing_file(data, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    one_error(capsys, ["train", "--data", str(data), "--out", str(out), "--preset", "tiny"], f"--out {out}",
              "is a file", "choose")
    assert out.read_text() == "keep me"
    one_error(capsys, ["train", "--data", str(data), "--out", str(out / "run"), "--preset", "tiny"],
              f"lies under {out}")


# ----------------------------------------------------------------------------- files given by flags


def test_a_binary_prompts_file_is_named(ckpt, tmp_path, capsys, no_load):
    prompts = tmp_path / "prompts.bin"
    prompts.write_bytes(BINARY)
    one_error(capsys, ["generate", "--checkpoint", ckpt, "--prompts-file", str(prompts)],
              f"--prompts-file {prompts}", "UTF-8 text")


def test_a_binary_or_missing_template_is_named_before_loading(ckpt, tmp_path, capsys, no_load):
    template = tmp_path / "t.jinja"
    template.write_bytes(BINARY)
    one_error(capsys, ["chat", "--checkpoint", ckpt, "--template", str(template)], f"--template {template}", "UTF-8")
    one_error(capsys, ["chat", "--checkpoint", ckpt, "--template", str(tmp_path)], f"--template {tmp_path}")


@pytest.mark.parametrize("content, names", [
    (BINARY, ["UTF-8"]),
    (b"[1, 2]", ["object of training settings"]),
    (b'{"max_steps": "ten"}', ["max_steps 'ten'", "whole number"]),
    (b'{"lr": "fast"}', ["lr 'fast'", "a number"]),
    (b'{"compile": 1}', ["compile 1", "true or false"]),
    (b'{"device": "bogus"}', ["device 'bogus'", "cuda:N"]),
])
def test_a_bad_train_config_file_is_named(data, tmp_path, capsys, content, names):
    config = tmp_path / "c.json"
    config.write_bytes(content)
    one_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--config", str(config)],
              f"--config {config}", *names)
    assert not (tmp_path / "run").exists()


def test_a_train_config_folder_is_said_to_be_one(data, tmp_path, capsys):
    one_error(capsys, ["train", "--data", str(data), "--config", str(tmp_path)], "is a folder")


@pytest.mark.parametrize("content, names", [
    (BINARY, ["UTF-8", "ModelConfig"]),
    (b'{"dim": "wide"}', ["dim"]),
    (b'{"format": "glassformer", "model": [1]}', ['"model"']),
])
def test_a_bad_cost_config_is_named(tmp_path, capsys, content, names):
    config = tmp_path / "model.json"
    config.write_bytes(content)
    one_error(capsys, ["cost", "--config", str(config)], str(config), *names)


@pytest.mark.parametrize("where", ["checkpoint", "run"])
@pytest.mark.parametrize("field, value", [("n_kv_heads", "2"), ("vocab_size", 1e12), ("bias", "yes")])
def test_cost_names_the_checkpoint_s_config_file(ckpt, tmp_path, capsys, where, field, value):
    """cost --checkpoint with a bad field names the config.json that holds it (it named the folder),
    a run folder's too (its latest checkpoint's)."""
    import shutil

    folder = tmp_path / "step-000001" if where == "run" else tmp_path / "ckpt"
    shutil.copytree(ckpt, folder)
    meta = json.loads((folder / "config.json").read_text())
    meta["model"][field] = value
    (folder / "config.json").write_text(json.dumps(meta))
    if where == "run":
        (tmp_path / "latest").write_text("step-000001\n")
    one_error(capsys, ["cost", "--checkpoint", str(tmp_path if where == "run" else folder)],
              f"{folder / 'config.json'}: ", field)


def test_binary_standard_input_to_tokenize(data, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(BINARY), errors="surrogateescape"))
    one_error(capsys, ["tokenize", "--tokenizer", str(data), "-"], "standard input", "UTF-8")


def test_output_files_under_a_file_or_at_a_folder_are_refused_before_loading(ckpt, tmp_path, capsys, no_load):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    one_error(capsys, ["generate", "--checkpoint", ckpt, "--prompt", "the", "--html", str(blocker / "p.html")],
              f"--html {blocker / 'p.html'}", "which is a file")
    one_error(capsys, ["trace", "--checkpoint", ckpt, "--text", "the", "--out", str(tmp_path)], f"--out {tmp_path}",
              "is a folder")
    one_error(capsys, ["trace", "--checkpoint", ckpt, "--text", "the", "--html", str(blocker / "t.html")],
              "which is a file")


# ----------------------------------------------------------------------------- argparse's own errors


def test_argparse_errors_are_one_line_too(capsys):
    one_error(capsys, ["generate", "--checkpoint", "x", "--prompt", "y", "--max-new-tokens", "many"],
              "--max-new-tokens", "glassformer generate --help")
    one_error(capsys, ["no-such-verb"], "invalid choice")
