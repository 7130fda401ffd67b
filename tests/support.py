"""What the tests share: tiny random models, tiny prepared data folders, Hugging Face twins, and a
minimal recorder that writes the trace-file format independently of glassformer.tracing.

Everything is made here: the tests read nothing outside the repository.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from glassformer import ModelConfig, Transformer, probes

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKED_FIGURES = TESTS / "data" / "worked_example.json"  # the walkthrough's figures, copied from the shared picture


# ----------------------------------------------------------------------------- models


@torch.no_grad()
def reinit(model: torch.nn.Module, std: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Re-draw every weight with a large std: the default init makes logits so small that
    real bugs hide under an absolute tolerance."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return model


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", **overrides)
    return reinit(Transformer(cfg), seed=seed).eval()


def greedy_cached(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens with a KV cache: prefill, then one token at a time."""
    from glassformer import KVCache

    cache = KVCache.for_model(model, ids.shape[0], ids.shape[1] + steps)
    logits, _ = model(ids, cache=cache, pos=0)
    out, pos = [], ids.shape[1]
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(int(nxt[0, 0]))
        logits, _ = model(nxt, cache=cache, pos=pos)
        pos += 1
    return out


@torch.no_grad()
def greedy_by_full_forward(model, prompt: list[int], steps: int, keep: int | None = None) -> list[int]:
    """The reference: run the whole text (no cache) and take the argmax, one token at a time.

    With keep, the text the model sees is cut to its latest `keep` tokens whenever it would
    outgrow the context (the slide policy's rule, written out independently).
    """
    text, start, out = list(prompt), 0, []
    S = model.config.max_seq_len
    for _ in range(steps):
        if keep is not None and len(text) - start > S:
            start = len(text) - keep
        logits, _ = model(torch.tensor([text[start:]]))
        out.append(int(logits[0, -1].argmax()))
        text.append(out[-1])
    return out

class NumberTokenizer:
    """Text '5 9 2' <-> ids: the word is the id (pieces 't5', ...), for pages and explorers that need ids,
    not a trained vocabulary."""

    def __init__(self, vocab_size: int = 512):
        self.vocab_size = vocab_size

    def encode(self, text):
        return [int(w) for w in text.split()]

    def id_to_piece(self, i):
        return f"t{i}"

    def decode(self, ids):
        return " ".join(map(str, ids))


def tiny_checkpoint(folder: Path, text: str, vocab_size: int = 300):
    """A checkpoint folder of the tiny preset (large random weights) with a tokenizer trained on
    `text`: (model, tokenizer). Shared by the command-line tests of generate and quantize."""
    from glassformer.checkpoint.folders import save_model
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.train([text], vocab_size=vocab_size)
    torch.manual_seed(0)
    model = reinit(Transformer(ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size)), std=0.1).eval()
    save_model(folder, model, tok)
    return model, tok


# ----------------------------------------------------------------------------- the command line


def run_cli(argv: list[str]) -> int:
    """main's exit status, whether it returns it or argparse exits with it."""
    from glassformer.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def one_error(capsys, argv: list[str], *names) -> str:
    """Run argv: exit 2 and one `error:` line on stderr naming each of names (str() of each, so a
    Path will do), no traceback. What was printed before argv runs is dropped first, so the line
    counted is argv's own."""
    capsys.readouterr()
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, err
    return err


def serve_in_a_process(folder: Path) -> tuple[subprocess.Popen, str]:
    """`glassformer serve` in a process of its own over a new tiny checkpoint written to folder, on a
    free port, as a service manager runs it: (the process, its base URL http://127.0.0.1:PORT without
    /v1), once it has said it is serving. The caller stops it; if it never says so, it is killed here
    and the test fails with what it printed."""
    tiny_checkpoint(folder, synthetic_text(200, 1))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "GLASSFORMER_API_KEY": ""}
    proc = subprocess.Popen([sys.executable, "-m", "glassformer", "serve", "--checkpoint", str(folder),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    found = re.fullmatch(rf"serving {re.escape(folder.name)} at (http://127\.0\.0\.1:\d+)/v1\n", line)
    if not found:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(line + err)
    return proc, found[1]


# ----------------------------------------------------------------------------- prepared data


WORDS = ("the king and queen walk to the castle where a knight waits with his sword while "
         "the old man sings of the sea and the stars above the hill").split()


def synthetic_text(n_sentences: int, seed: int) -> str:
    """Sentences from a tiny vocabulary with some structure (a model can learn to predict it)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        k = rng.randint(4, 10)
        start = rng.randrange(len(WORDS))
        words = [WORDS[(start + i * rng.choice((1, 1, 1, 2))) % len(WORDS)] for i in range(k)]
        lines.append(" ".join(words).capitalize() + ".")
    return "\n".join(lines) + "\n"


def make_prepared(folder: Path, vocab_size: int = 300, n_train: int = 1500, n_val: int = 200) -> Path:
    """A prepared folder in the data contract's layout: tokenizer.json, train.bin, val.bin, meta.json."""
    from glassformer.text.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_text, val_text = synthetic_text(n_train, 1), synthetic_text(n_val, 2)
    tok = Tokenizer.train([train_text], vocab_size)
    tok.save(folder / "tokenizer.json")
    train_ids = np.asarray(tok.encode(train_text), dtype=np.uint16)
    val_ids = np.asarray(tok.encode(val_text), dtype=np.uint16)
    train_ids.tofile(folder / "train.bin")
    val_ids.tofile(folder / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
            "train_tokens": len(train_ids), "val_tokens": len(val_ids),
            "train_bytes": len(train_text.encode()), "val_bytes": len(val_text.encode()),
            "corpus": "synthetic", "val_fraction": n_val / (n_train + n_val)}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A prepared folder shared by a test module's training runs (import it by this name)."""
    return make_prepared(tmp_path_factory.mktemp("data") / "prep")


def make_token_stream(folder: Path, vocab_size: int = 512, n_train: int = 20000, n_val: int = 2000) -> Path:
    """A prepared folder whose ids come from a fixed arithmetic rule, independent of any tokenizer
    (for the golden trajectory, which must not move when the tokenizer trainer changes)."""
    folder.mkdir(parents=True, exist_ok=True)
    # A noisy counting pattern: each next id is (a·id + b) mod V, with a deterministic jump every 7 tokens.
    def stream(n: int, start: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint16)
        x = start
        for i in range(n):
            x = (5 * x + 3 + (i % 7 == 0) * (i % 11)) % vocab_size
            out[i] = x
        return out

    stream(n_train, 1).tofile(folder / "train.bin")
    stream(n_val, 2).tofile(folder / "val.bin")
    meta = {"dtype": "uint16", "vocab_size": vocab_size, "eot_id": 0, "train_tokens": n_train,
            "val_tokens": n_val, "train_bytes": 3 * n_train, "val_bytes": 3 * n_val, "corpus": "arithmetic"}
    (folder / "meta.json").write_text(json.dumps(meta))
    word_ids(vocab_size).save(folder / "tokenizer.json")  # train checks the folder's tokenizer; the ids owe it nothing
    return folder


def word_ids(vocab_size: int):
    """A tokenizer of vocab_size ids named t0, t1, ... (a word-level vocabulary): what a folder of
    made-up ids holds as its tokenizer, since train refuses a folder whose tokenizer does not load."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from glassformer.text.tokenizer import Tokenizer

    return Tokenizer(HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")))


def hf_llama_with_data(root: Path):
    """A prepared data folder and a tiny random Hugging Face Llama over its vocabulary, saved
    to root/hf: (root, data, hf). Weights larger than the default init, so the loss is far
    from uniform."""
    import torch
    import transformers

    data = make_prepared(root / "data")
    meta = json.loads((data / "meta.json").read_text())
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=meta["vocab_size"], hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(root / "hf", safe_serialization=True)
    return root, data, hf


def hf_loss(hf, x, y) -> float:
    """Hugging Face's mean cross-entropy of y given x."""
    import torch

    with torch.no_grad():
        logits = hf(input_ids=x).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)))

# ----------------------------------------------------------------------------- a recorder independent of glassformer.tracing


_AXES = {
    "q": ["token", "head", "feature"], "k": ["token", "head", "feature"], "v": ["token", "head", "feature"],
    "q_rot": ["token", "head", "feature"], "k_rot": ["token", "head", "feature"], "z": ["token", "head", "feature"],
    "scores": ["token", "head", "key"], "weights": ["token", "head", "key"],
    "logits": ["token", "vocab"], "probs": ["token", "vocab"],
}


class _Record:
    def __init__(self):
        self.seen: dict[str, torch.Tensor] = {}

    def __call__(self, name, x):
        self.seen[name] = x.detach().float()[0].clone()  # drop the batch axis
        return x

    def wants(self, name):
        return True


@torch.no_grad()
def fixture_trace(model, ids: list[int], tokens: list[str]) -> dict:
    rec = _Record()
    old = probes.set_recorder(rec)
    try:
        model(torch.tensor([ids]))
    finally:
        probes.set_recorder(old)
    out = {}
    T = len(ids)
    causal = torch.ones(T, T).tril().bool()  # (T, Tk)
    for name, x in rec.seen.items():
        leaf = name.rsplit(".", 1)[-1]
        axes = _AXES.get(leaf, ["token", "feature"])
        if leaf == "weights":
            data = [[[float(x[i, h, j]) if causal[i, j] else None for j in range(T)]
                     for h in range(x.shape[1])] for i in range(T)]
        else:
            data = x.tolist()
        out[name] = {"shape": list(x.shape), "axes": axes, "data": data}
    return {"tokens": tokens, "ids": list(ids), "positions": list(range(T)),
            "config": model.config.to_dict(), "probes": out}


# ----------------------------------------------------------------------------- token shards


def llmc_read(path):
    """llm.c's loader, from its published format: 256 int32 (magic, version, count, …), then the ids."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(256 * 4), dtype="<i4")
        kind = {(20240520, 1): "<u2", (20240801, 7): "<u4"}[(int(head[0]), int(head[1]))]
        ids = np.frombuffer(f.read(), dtype=kind)
    assert len(ids) == head[2]
    return ids
