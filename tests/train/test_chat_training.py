"""Training on conversations: the masked (SFT) loss and its gradient, accumulation, vocabulary
growth on --init-from, and a short fine-tune that lowers held-out assistant-only loss."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glassformer import ModelConfig, Transformer
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.text.data import TokenFile, read_meta
from glassformer.train import step as S
from glassformer.train.evaluate import score
from glassformer.train.step import masked_nll_sum, train_step
from glassformer.train.vocab import grow_vocab

from ..support import WORDS, make_prepared


def tiny(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.from_preset("tiny", dropout=0.0, **kw))


def masked_batch(model, rows: int = 8, T: int = 16, seed: int = 1):
    """(x, y) with about half the targets -1, unevenly over the rows (row r keeps fewer as r grows;
    the last row keeps none), so a mean of micro-batch means would weight them wrongly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, T + 1), generator=g)  # (B, T+1)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    keep = torch.rand(rows, T, generator=g) < torch.linspace(0.95, 0.0, rows)[:, None]  # (B, T)
    return x, y.masked_fill(~keep, -1)


def test_masked_positions_get_exactly_zero_gradient(monkeypatch):
    model = tiny()
    x, y = masked_batch(model)
    seen = {}

    def keep_logits(net, xm, ym):  # the step's own loss, with the logits' gradient kept
        logits, _ = net(xm)
        logits.retain_grad()
        seen.setdefault("logits", []).append((logits, ym))
        return masked_nll_sum(logits, ym)

    monkeypatch.setattr(S, "forward_loss_sum", keep_logits)
    res = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, accum=2, masked=True)
    assert res.stepped and len(seen["logits"]) == 2
    for logits, ym in seen["logits"]:
        g = logits.grad  # (micro, T, V)
        off = ym == -1
        assert bool(off.any()) and bool((~off).any())
        assert torch.count_nonzero(g[off]) == 0  # exactly zero, every vocabulary entry
        assert bool((g[~off].abs().sum(-1) > 0).all())  # every trained position has a gradient


def reference(model, x, y):
    """Autograd on the whole batch: sum of the unmasked targets' cross-entropy over their count."""
    model = copy.deepcopy(model)
    logits, _ = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1, reduction="sum")
    loss = loss / (y >= 0).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accumulation_4_equals_one_batch_4_times_larger():
    """accum 4 (micro-batches of 2 rows, unequal counts of trained targets) moves the weights
    exactly as one batch of 8 does: -lr times the gradient of the global masked mean."""
    x, y = masked_batch(tiny())
    loss_ref, grads = reference(tiny(), x, y)
    counts = (y >= 0).view(4, -1).sum(1)
    assert len(set(counts.tolist())) > 1  # the micro-batches really are unequal
    results = {}
    for accum in (1, 4):
        model = tiny()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        res = train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), x, y, accum=accum, masked=True)
        assert res.loss == pytest.approx(loss_ref, rel=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n], rtol=1e-5, atol=1e-6, msg=n)
        results[accum] = {n: p.detach() for n, p in model.named_parameters()}
    # The mean of the micro-batches' own means is a different (wrong) number here.
    with torch.no_grad():
        logits, _ = tiny()(x)
        per = [F.cross_entropy(logits[2 * m:2 * m + 2].reshape(-1, logits.size(-1)), y[2 * m:2 * m + 2].reshape(-1),
                               ignore_index=-1) for m in range(3)]  # the 4th micro-batch keeps nothing
    assert abs(float(sum(per)) / 4 - loss_ref) > 1e-3


def test_plain_batches_still_take_the_mean_path(monkeypatch):
    """Without masked=True the step is the one plain data always had (forward_loss, the model's mean)."""
    calls = []
    real = S.forward_loss
    monkeypatch.setattr(S, "forward_loss", lambda net, a, b: calls.append(1) or real(net, a, b))
    monkeypatch.setattr(S, "forward_loss_sum", lambda *a: pytest.fail("masked path taken"))
    model = tiny()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (4, 17), generator=g)
    assert train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), ids[:, :-1], ids[:, 1:], accum=2).stepped
    assert len(calls) == 2


@pytest.mark.parametrize("tie", [True, False])
def test_growth_adds_mean_rows_and_keeps_the_old_logits(tie):
    model = tiny(tie_embeddings=tie).eval()
    grown, record = grow_vocab(model, 515)
    assert grown.config.vocab_size == 515 and record["from"] == 512 and record["to"] == 515
    E, H = grown.embed.weight, grown.lm_head.weight
    assert E.shape == H.shape == (515, 64)
    torch.testing.assert_close(E[512:], model.embed.weight.mean(0).expand(3, -1))
    torch.testing.assert_close(H[512:], model.lm_head.weight.mean(0).expand(3, -1))
    assert (H.data_ptr() == E.data_ptr()) == tie  # a tied head stays tied; an untied one grew on its own
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        old, _ = model(ids)
        new, _ = grown.eval()(ids)
    torch.testing.assert_close(new[..., :512], old, rtol=1e-5, atol=1e-5)  # old tokens: the same logits


# ----------------------------------------------------------------------------- a short fine-tune


def conversations(n: int, seed: int) -> list[dict]:
    """The user says a few words; the assistant answers "yes," and repeats them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
        out.append({"messages": [{"role": "user", "content": line}, {"role": "assistant", "content": "yes, " + line}]})
    return out


def held_out_loss(model, folder) -> float:
    meta = read_meta(folder)
    ids = np.asarray(TokenFile(folder / "val.bin", meta["dtype"]).array)
    mask = np.asarray(TokenFile(folder / "val.mask.bin", "uint8").array)
    nats, n = score(model.float().eval(), ids, model.config.max_seq_len, "cpu", mask=mask, block=meta["context"] + 1)
    assert n == int(mask.sum()) > 0  # every assistant token scored, nothing else
    return nats / n


def test_fine_tune_lowers_held_out_assistant_loss(tmp_path, capsys):
    plain = make_prepared(tmp_path / "plain")
    base = tmp_path / "base"
    common = ["--preset", "tiny", "--batch-size", "8", "--no-progress", "--threads", "1", "--eval-tokens", "256"]
    assert main(["train", "--data", str(plain), "--out", str(base), "--max-steps", "30", "--lr", "3e-3", *common]) == 0
    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(300, 1)))
    data = tmp_path / "chat"
    assert main(["prepare", "--chat", str(chat), "--out", str(data), "--tokenizer", str(base), "--context", "128"]) == 0
    meta = read_meta(data)
    base_model, _ = load(base)
    assert meta["vocab_size"] == base_model.config.vocab_size + 2  # the chat tokens were added
    before = held_out_loss(grow_vocab(base_model, meta["vocab_size"])[0], data)
    capsys.readouterr()
    run = tmp_path / "sft"
    assert main(["train", "--data", str(data), "--out", str(run), "--init-from", str(base), "--max-steps", "40",
                 "--lr", "3e-3", "--warmup-steps", "5", "--eval-every", "20", *common]) == 0
    assert "vocabulary grown from" in capsys.readouterr().err
    tuned, tok = load(run)
    after = held_out_loss(tuned, data)
    assert after < 0.7 * before, (before, after)
    state = json.loads((run / (run / "latest").read_text().strip() / "train_state.json").read_text())
    assert state["vocab_growth"]["from"] == base_model.config.vocab_size
    assert state["vocab_growth"]["to"] == meta["vocab_size"]
    assert tok.chat_template is not None  # the checkpoint keeps the data's template
    # eval over the assistant tokens says so, and agrees with the score above
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(data), "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scored"] == "assistant" and result["tokens"] == meta["chat"]["scored_tokens"]["val"]
    assert result["loss"] == pytest.approx(after, rel=1e-4)
    assert set(result) == {"loss", "ppl", "bpb", "tokens", "bytes", "scored"} and result["bytes"] == meta["val_bytes"]
    # a run resumed from step 20 keeps the record (its model already has the grown vocabulary)
    import shutil

    from glassformer.checkpoint.folders import write_pointer

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "step-000040")
    write_pointer(resumed, "latest", "step-000020")
    assert main(["train", "--data", str(data), "--out", str(resumed), "--resume", "--no-progress"]) == 0
    state = json.loads((resumed / "step-000040" / "train_state.json").read_text())
    assert state["step"] == 40 and state["vocab_growth"]["to"] == meta["vocab_size"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_two_processes_train_conversations_as_one(tmp_path):
    """Under torchrun (2 CPU processes, DDP) the masked loss divides by the global batch's count of
    assistant targets, so both ranks together take the one process's steps."""
    import os
    import subprocess
    import sys

    from glassformer.train.metrics import read_metrics

    from ..support import REPO

    chat = tmp_path / "c.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(120, 2)))
    data = tmp_path / "chat"
    assert main(["prepare", "--chat", str(chat), "--out", str(data), "--vocab-size", "300", "--context", "96"]) == 0
    args = ["train", "--data", str(data), "--preset", "tiny", "--max-steps", "6", "--batch-size", "4", "--seq-len", "96",
            "--eval-every", "3", "--log-every", "1", "--no-progress", "--threads", "1", "--micro-batch", "1"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glassformer", *args, "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def losses(run, key):
        return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]

    assert len(losses(tmp_path / "one", "loss")) == 6
    assert losses(tmp_path / "two", "loss") == pytest.approx(losses(tmp_path / "one", "loss"), abs=1e-5, rel=0)
    assert losses(tmp_path / "two", "val_loss") == pytest.approx(losses(tmp_path / "one", "val_loss"), abs=1e-5, rel=0)
