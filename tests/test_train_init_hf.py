"""--init-from a Hugging Face Llama folder (and its converted checkpoint): training starts from its weights."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from glassformer.cli import main  # noqa: E402
from glassformer.data import TokenFile, get_batch  # noqa: E402
from glassformer.metrics import read_metrics  # noqa: E402

from .train_fixtures import make_prepared  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One CPU thread: much faster for these tiny models on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("hf")
    data = make_prepared(root / "data")
    meta = __import__("json").loads((data / "meta.json").read_text())
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=meta["vocab_size"], hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so the loss is far from uniform
        for p in hf.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(root / "hf", safe_serialization=True)
    return root, data, hf


def hf_loss(hf, x, y) -> float:
    with torch.no_grad():
        logits = hf(input_ids=x).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)))


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
    assert losses[-1] < losses[0]  # and it trains from there
