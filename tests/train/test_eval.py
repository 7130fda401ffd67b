"""`glassformer eval`: the contract line, scored in non-overlapping windows, against Hugging Face."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer.cli import main  # noqa: E402

from ..support import hf_llama_with_data, hf_loss  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    return hf_llama_with_data(tmp_path_factory.mktemp("hf"))


def test_eval_matches_hugging_face_on_windows(setup, tmp_path, capsys):
    """`glassformer eval` of the HF folder on a text file == HF's own loss over the same non-overlapping windows."""
    import json

    from glassformer.text.tokenizer import Tokenizer

    root, data, hf = setup
    text = "The king walks to the castle.\nWhere a knight waits with his sword, the old man sings.\n" * 12
    (tmp_path / "t.txt").write_text(text)
    argv = ["eval", "--checkpoint", str(root / "hf"), "--data", str(tmp_path / "t.txt"),
            "--tokenizer", str(data / "tokenizer.json"), "--batch-size", "3"]
    assert main(argv) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == first  # identical lines on a rerun
    got = json.loads(first)
    assert list(got) == ["loss", "ppl", "bpb", "tokens", "bytes"]
    ids = torch.tensor(Tokenizer.from_file(data / "tokenizer.json").encode(text))
    ctx, nats, n = 64, 0.0, 0
    for s in range(0, len(ids) - 1, ctx):  # the reference: one window at a time, by hand
        w = ids[s:s + ctx + 1]
        nats += hf_loss(hf, w[None, :-1], w[None, 1:]) * (len(w) - 1)
        n += len(w) - 1
    assert got["tokens"] == n == len(ids) - 1
    assert got["bytes"] == len(text.encode())
    assert got["loss"] == pytest.approx(nats / n, abs=2e-5)
    assert got["bpb"] == pytest.approx(nats / np.log(2) / len(text.encode()), rel=2e-5)
    assert got["ppl"] == pytest.approx(np.exp(nats / n), rel=1e-4)


def test_eval_of_a_prepared_folder_and_bad_input(setup, tmp_path, capsys):
    import json

    root, data, hf = setup
    assert main(["eval", "--checkpoint", str(root / "hf"), "--data", str(data)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    meta = json.loads((data / "meta.json").read_text())
    assert got["tokens"] == meta["val_tokens"] - 1 and got["bytes"] == meta["val_bytes"]
    val = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    nats = sum(hf_loss(hf, val[s:s + 65][None, :-1], val[s:s + 65][None, 1:]) * (len(val[s:s + 65]) - 1)
               for s in range(0, len(val) - 1, 64))
    assert got["loss"] == pytest.approx(nats / (len(val) - 1), abs=2e-5)
    assert main(["eval", "--checkpoint", str(root / "hf"), "--data", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_windows():
    from glassformer.train.evaluate import windows

    assert windows(10, 4) == [(0, 4), (4, 4), (8, 1)]
    assert windows(9, 4) == [(0, 4), (4, 4)]
    assert windows(1, 4) == []
    assert sum(n for _, n in windows(1000, 64)) == 999
