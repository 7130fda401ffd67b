"""--init-from a Hugging Face Llama folder (and its converted checkpoint): training starts from its weights."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from glassformer import load  # noqa: E402
from glassformer.cli import main  # noqa: E402
from glassformer.text.data import TokenFile, get_batch  # noqa: E402
from glassformer.train.metrics import read_metrics  # noqa: E402

from ..support import hf_llama_with_data, hf_loss  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    return hf_llama_with_data(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("source", ["hf-folder", "converted"])
def test_first_loss_is_the_checkpoints_loss(setup, source, tmp_path):
    root, data, hf = setup
    ckpt = root / "hf"
    if source == "converted":
        ckpt = tmp_path / "ckpt"
        assert main(["convert", "--from-hf", str(root / "hf"), "--out", str(ckpt)]) == 0
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), "--init-from", str(ckpt), "--max-steps", "3",
                 "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--eval-every", "0",
                 "--eval-tokens", "128", "--seed", "5", "--threads", "1", "--no-progress"]) == 0
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    # The same batch (seed 5, step 0) through the Hugging Face model itself.
    train = TokenFile(data / "train.bin", "uint16")
    x, y = get_batch(train, 4, 32, 5, 0)
    assert losses[0] == pytest.approx(hf_loss(hf, x, y), abs=2e-5)
    trained, _ = load(out)  # and it trains from there: that batch's loss fell (other batches' losses differ anyway)
    with torch.no_grad():
        assert float(trained(x, y)[1]) < losses[0]
