"""The induction-heads demo: the score against hand-made attention patterns, the repeat data as the
trainer reads it, the phase-change finder on synthetic curves, and a short run of the demo."""

import json
import math

import numpy as np
import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.text.data import TokenFile, chat_block, get_batch, load_mask, read_meta
from glassformer.tracing.trace import trace
from glassformer.train.induction import (
    RECIPE,
    eval_batch_for,
    induction_scores,
    model_scores,
    phase_change,
    previous_token_scores,
    write_repeat_data,
)

from ..support import reinit

L, B = 4, 2
T = 2 * L + 1  # rows [eot, r, r]


def patterns() -> torch.Tensor:
    """(B, T, 3, T) causal attention weights: head 0 a perfect induction head (on the second copy;
    on eot before it), head 1 a previous-token head, head 2 uniform over the keys it may read."""
    w = torch.zeros(B, T, 3, T)
    for i in range(T):
        w[:, i, 0, i - L + 1 if i > L else 0] = 1.0
        w[:, i, 1, max(i - 1, 0)] = 1.0
        w[:, i, 2, : i + 1] = 1.0 / (i + 1)
    return w


def direct(w: torch.Tensor, pairs) -> list[float]:
    """Each head's mean of w[b, i, h, j] over the (i, j) pairs and the rows, as a plain loop."""
    out = []
    for h in range(w.shape[2]):
        vals = [float(w[b, i, h, j]) for b in range(w.shape[0]) for i, j in pairs]
        out.append(sum(vals) / len(vals))
    return out


def test_the_score_of_hand_made_patterns_equals_a_direct_computation():
    w = patterns()
    second_copy = [(i, i - L + 1) for i in range(L + 1, T)]
    got = induction_scores(w, L, L + 1)
    assert got == pytest.approx(direct(w, second_copy), abs=1e-12)
    assert got[0] == 1.0 and got[1] == 0.0  # a perfect induction head, a previous-token head
    assert got[2] == pytest.approx(sum(1 / (i + 1) for i in range(L + 1, T)) / L)
    prev = previous_token_scores(w)
    assert prev == pytest.approx(direct(w, [(i, i - 1) for i in range(1, T)]), abs=1e-12) and prev[1] == 1.0


def test_model_scores_read_the_attention_the_trace_shows():
    torch.manual_seed(0)
    m = reinit(Transformer(ModelConfig.from_preset("tiny", ffn="none", vocab_size=257)), std=0.3).eval()
    batch = eval_batch_for({**RECIPE, "eval_rows": 1, "eval_L": 6})  # (1, 13)
    got = model_scores(m, batch)
    tr = trace(m, batch[0].tolist())
    for i in range(2):
        w = tr[f"blocks.{i}.attn.weights"][None]  # (1, T, N, T)
        assert got["induction_heads"][f"blocks.{i}.attn"] == pytest.approx(induction_scores(w, 6, 7), abs=1e-6)
    assert got["induction_score"] == max(got["induction_heads"]["blocks.1.attn"])


def test_repeat_data_is_read_by_the_trainer_in_aligned_blocks(tmp_path):
    Tb, lo, hi = 16, 3, 6
    meta = write_repeat_data(tmp_path / "d", Tb, lo, hi, n_train=40, n_val=4, seed=0)
    toks = TokenFile(tmp_path / "d" / "train.bin", meta["dtype"]).array.reshape(40, Tb + 1)
    mask = load_mask(tmp_path / "d", "train", 40 * (Tb + 1)).array.reshape(40, Tb + 1)
    for row, m in zip(toks, mask):
        n = next(n for n in range(lo, hi + 1) if all(row[p] == row[p - n] for p in range(n + 1, Tb + 1)))
        assert row[0] == meta["eot_id"] and len(set(row[1:n + 1].tolist())) == n
        assert m.tolist() == [0] * (n + 2) + [1] * (Tb - n - 1)
    assert chat_block(read_meta(tmp_path / "d")) == Tb + 1 and meta["val_bytes"] == int(
        load_mask(tmp_path / "d", "val", 4 * (Tb + 1)).array.sum())
    x, y = get_batch(toks.reshape(-1), 8, Tb, 0, 3, mask=mask.reshape(-1), block=Tb + 1)
    assert (x[:, 0] == meta["eot_id"]).all() and ((y == -1).sum(1) >= lo + 1).all()


def test_phase_change_finds_the_largest_rise_and_drop_on_synthetic_curves():
    steps = list(range(0, 1001, 25))
    rng = np.random.default_rng(0)
    sig = [1 / (1 + math.exp(-(s - 412) / 5)) for s in steps]  # the jump lands between steps 400 and 425
    score = [0.05 + 0.85 * v + 0.01 * rng.standard_normal() for v in sig]
    loss = [4.0 - 3.0 * v + 0.02 * rng.standard_normal() for v in sig]
    assert phase_change(steps, score) == 425 and phase_change(steps, loss, rise=False) == 425
    assert phase_change([10], [0.5]) is None


def test_a_short_run_of_the_demo_logs_each_snapshots_score(tmp_path, capsys):
    from glassformer.checkpoint.loading import load
    from glassformer.train.metrics import read_metrics
    from glassformer.viewer.training import stats_curves

    assert main(["demo", "--induction", "--out", str(tmp_path), "--steps", "6", "--every", "3"]) == 0
    out = capsys.readouterr().out
    assert "the induction score jumps at step" in out
    run = tmp_path / "induction" / "run"
    records = read_metrics(run / "metrics.jsonl")
    scored = [r for r in records if "induction_score" in r]
    assert [r["step"] for r in scored] == [3, 6]
    batch = eval_batch_for(RECIPE)
    for r in scored:  # what was logged is the snapshot's own score, recomputed
        model, _ = load(run / f"step-{r['step']:06d}")
        again = model_scores(model, batch)
        for k, v in again["induction_heads"].items():
            assert r["induction_heads"][k] == pytest.approx(v, abs=1e-6)
        assert r["stats"]["induction_score"]["blocks.1.attn"] == r["induction_heads"]["blocks.1.attn"]
    assert model.config.ffn == "none" and model.config.n_layers == 2
    assert stats_curves(records)["induction_score"]["step"] == [3, 6]
    found = json.loads((run / "induction.json").read_text())
    assert found["jump_step"] == 6 and len(found["scores"]) == 2
    _the_training_view_serves_it(run, RECIPE["view_text"])
    pytest.importorskip("matplotlib")
    assert (run / "induction.png").stat().st_size > 0


@pytest.mark.parametrize("extra, says", [(["--steps", "-1"], "--steps"), (["--every", "0"], "--every"),
                                         (["--corpus", "x.txt"], "--corpus")])
def test_bad_demo_flags_are_one_error_line(tmp_path, capsys, extra, says):
    assert main(["demo", "--induction", "--out", str(tmp_path)] + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "induction").exists()


def _the_training_view_serves_it(run, text):
    """`view --run RUN`: the run's curves carry the score, and a snapshot's attention maps are its own."""
    import argparse

    from starlette.testclient import TestClient

    from glassformer.checkpoint.loading import load
    from glassformer.commands import view
    from glassformer.viewer.server import make_explorer_app

    p = argparse.ArgumentParser()
    view.add_arguments(p)
    client = TestClient(make_explorer_app(view.build_explorer(p.parse_args(["--run", str(run)]))),
                        base_url="http://127.0.0.1")
    assert client.get("/api/run").json()["stats"]["induction_score"]["step"] == [3, 6]
    got = client.post("/api/trace", json={"text": text, "checkpoint": "step-000003"}).json()
    model, tok = load(run / "step-000003")
    ref = trace(model.eval(), tok.encode(text))
    w = got["trace"]["probes"]["blocks.1.attn.weights"]["data"]
    assert torch.allclose(torch.tensor([[[math.nan if x is None else x for x in r] for r in row] for row in w]),
                          ref["blocks.1.attn.weights"].float(), atol=2e-6, equal_nan=True)
