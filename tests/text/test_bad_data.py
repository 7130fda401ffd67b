"""A damaged data folder is refused up front, in one line naming the file, before a model is built
or a run folder made: ids past the vocabulary, a nonsense meta.json, a tokenizer that does not load
or does not match (docs/data.md#what-train-checks-in-a-data-folder)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from glassformer.cli import main
from glassformer.errors import UserError

from ..support import data, word_ids  # noqa: F401  (a fixture)

TRAIN = ["--preset", "tiny", "--max-steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
         "--no-progress", "--threads", "1"]


@pytest.fixture
def folder(data, tmp_path):
    """A copy of the shared prepared folder, to damage."""
    return shutil.copytree(data, tmp_path / "prep")


@pytest.fixture
def no_model(monkeypatch):
    """Building a model fails the test: every check here comes before any weights are allocated."""
    import glassformer.model

    def refuse(self, *a, **kw):
        raise AssertionError("a model was built before the data folder was checked")

    monkeypatch.setattr(glassformer.model.Transformer, "__init__", refuse)


def _meta(folder, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


def train_refuses(folder, tmp_path, capsys, *names: str) -> str:
    """Run train on folder: exit 2, one `error:` line holding every one of names, no run folder made."""
    out = tmp_path / "run"
    assert main(["train", "--data", str(folder), "--out", str(out), *TRAIN]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, err
    assert not out.exists()  # nothing made, nothing to clean up
    return err


# ----------------------------------------------------------------------------- ids past the vocabulary


def test_ids_past_the_vocabulary_are_refused_before_training(folder, tmp_path, capsys, no_model):
    ids = np.fromfile(folder / "train.bin", dtype="<u2")
    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    ids[1000::50] = vocab + 7  # (today: an IndexError deep in the first step that draws one)
    ids.tofile(folder / "train.bin")
    train_refuses(folder, tmp_path, capsys, str(folder / "train.bin"), f"token id {vocab + 7}", "position 1000",
                        "prepare")


def test_ids_in_val_are_checked_too(folder, tmp_path, capsys, no_model):
    ids = np.fromfile(folder / "val.bin", dtype="<u2")
    ids[-1] = 65535
    ids.tofile(folder / "val.bin")
    train_refuses(folder, tmp_path, capsys, str(folder / "val.bin"), "token id 65535")


def test_check_ids_finds_the_first_bad_one_past_a_chunk(tmp_path):
    from glassformer.text.data import TokenFile, check_ids

    path = tmp_path / "ids.bin"
    ids = np.zeros((1 << 24) + 10, dtype="<u2")
    ids[(1 << 24) + 3] = 400  # in the second chunk the search reads
    ids[-1] = 500
    ids.tofile(path)
    with pytest.raises(UserError, match=r"token id 500 \(first bad one at position 16777219\)"):
        check_ids(TokenFile(path, "uint16"), 300)
    check_ids(TokenFile(path, "uint16"), 501)  # all below: nothing said
    check_ids(TokenFile(path, "uint16"), 1 << 16)  # any uint16 id fits: no scan needed


def test_a_split_shorter_than_meta_says_is_refused(folder, tmp_path, capsys, no_model):
    ids = np.fromfile(folder / "train.bin", dtype="<u2")
    ids[:-100].tofile(folder / "train.bin")  # a copy cut short, still whole ids
    train_refuses(folder, tmp_path, capsys, str(folder / "train.bin"), f"holds {len(ids) - 100} ids", "train_tokens")


# ----------------------------------------------------------------------------- meta.json


@pytest.mark.parametrize("changes, names", [
    ({"vocab_size": 10 ** 12}, ["vocab_size 1000000000000"]),  # today: tries to allocate 256 TB
    ({"vocab_size": 1e12}, ["vocab_size 1000000000000.0"]),
    ({"vocab_size": -5}, ["vocab_size -5"]),
    ({"vocab_size": 300.5}, ["vocab_size 300.5"]),
    ({"vocab_size": "300"}, ["vocab_size '300'"]),
    ({"vocab_size": True}, ["vocab_size True"]),
    ({"vocab_size": None}, ["vocab_size None"]),
    ({"dtype": "float32"}, ["dtype 'float32'"]),
    ({"dtype": "bogus"}, ["dtype 'bogus'"]),
    ({"eot_id": 300}, ["eot_id 300"]),
    ({"val_bytes": -1}, ["val_bytes -1"]),
    ({"train_tokens": "many"}, ["train_tokens 'many'"]),
])
def test_nonsense_in_meta_json_is_refused_before_a_model_is_built(folder, tmp_path, capsys, no_model, changes, names):
    _meta(folder, **changes)
    train_refuses(folder, tmp_path, capsys, str(folder / "meta.json"), *names, "prepare it again")


@pytest.mark.parametrize("text", ["[1, 2, 3]", "300", "\"meta\"", "null"])
def test_meta_json_that_is_not_an_object_is_refused(folder, tmp_path, capsys, no_model, text):
    (folder / "meta.json").write_text(text)
    train_refuses(folder, tmp_path, capsys, str(folder / "meta.json"), "JSON object")


def test_eval_of_a_folder_checks_its_ids_before_scoring(folder, tmp_path, capsys):
    import torch

    from glassformer import ModelConfig, Transformer
    from glassformer.checkpoint.folders import save_model

    vocab = json.loads((folder / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    save_model(tmp_path / "ckpt", Transformer(ModelConfig.from_preset("tiny", vocab_size=vocab)), folder / "tokenizer.json")
    ids = np.fromfile(folder / "val.bin", dtype="<u2")
    ids[5] = vocab  # today: an IndexError in the first window's embedding
    ids.tofile(folder / "val.bin")
    assert main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(folder), "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(folder / "val.bin") in err, err
    assert f"token id {vocab}" in err and "position 5" in err


# ----------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize("text", ["garbage", "{}", "[]", "{\"model\": {\"type\": \"BPE\"}}", ""])
def test_a_tokenizer_that_does_not_load_is_refused_before_training(folder, tmp_path, capsys, no_model, text):
    # today: trains for minutes into a checkpoint that cannot be loaded
    (folder / "tokenizer.json").write_text(text)
    train_refuses(folder, tmp_path, capsys, str(folder / "tokenizer.json"), "not a valid tokenizer.json",
                  "prepare the folder again")


def test_a_tokenizer_of_another_vocabulary_is_refused(folder, tmp_path, capsys, no_model):
    word_ids(100).save(folder / "tokenizer.json")  # loads, but is not the one that made the ids
    train_refuses(folder, tmp_path, capsys, str(folder / "tokenizer.json"), "has 100 ids", "vocab_size 300")


def test_a_garbage_tokenizer_config_is_refused(folder, tmp_path, capsys, no_model):
    (folder / "tokenizer_config.json").write_bytes(b"\x84\x00 not json")  # a checkpoint copies it, and loads it
    train_refuses(folder, tmp_path, capsys, str(folder / "tokenizer_config.json"))


def test_a_missing_tokenizer_is_refused(folder, tmp_path, capsys, no_model):
    (folder / "tokenizer.json").unlink()
    train_refuses(folder, tmp_path, capsys, "no tokenizer.json")


def test_the_python_api_raises_user_error(folder, tmp_path):
    from glassformer.config import TrainConfig
    from glassformer.train.loop import train

    (folder / "tokenizer.json").write_text("garbage")
    with pytest.raises(UserError, match="not a valid tokenizer.json"):
        train(TrainConfig(data=str(folder), out=str(tmp_path / "run"), preset="tiny", max_steps=1))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- what prepare writes passes


def test_prepared_folders_pass_the_checks_train_makes(tmp_path, capsys):
    from glassformer.text.data import check_prepared

    from ..support import synthetic_text

    (tmp_path / "c.txt").write_text(synthetic_text(400, 3))
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), "--vocab-size", "280",
                 "--context", "8"]) == 0
    meta = check_prepared(tmp_path / "o")
    assert meta["vocab_size"] == 280
    capsys.readouterr()
    # prepare refuses a damaged folder given as the tokenizer to reuse, naming its file
    (tmp_path / "o" / "tokenizer.json").write_text("garbage")
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "p"),
                 "--tokenizer", str(tmp_path / "o"), "--context", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(tmp_path / "o" / "tokenizer.json") in err, err
    assert not (tmp_path / "p").exists()
