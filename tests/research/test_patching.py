"""Activation and attribution patching sweeps (glassformer.research.patching, `glassformer patch`).

The exact grid is checked cell by cell against tracing.interventions.patch, which patches one probe
through its own recorder (another code path); the attribution estimate against a central difference
of the metric along (clean − corrupt) in float64; the reference experiment on a trained induction
model (tests/data/induction_demo)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glassformer.research.patching import SITES, patch_sweep, pearson, site_probe
from glassformer.tracing.interventions import patch, run_with
from ..support import one_error, run_cli, tiny_checkpoint, tiny_model

INDUCTION = Path(__file__).resolve().parents[1] / "data" / "induction_demo"


def texts(T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (T,), generator=g).tolist(), torch.randint(0, 512, (T,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def metric(logits, answer, wrong):
    return float(logits[-1, answer] - logits[-1, wrong])


@pytest.mark.parametrize("site", SITES)
def test_each_cell_is_the_metric_of_one_patched_run(model, site):
    clean, corrupt = texts()
    r = patch_sweep(model, clean, corrupt, 3, 5, site)
    cols = model.config.n_heads if site == "z" else len(clean)
    assert r.exact.shape == (model.config.n_layers, cols)
    for layer in range(model.config.n_layers):
        for j in range(cols):
            where = {"head": j} if site == "z" else {"tokens": [j]}
            one = patch(model, corrupt, site_probe(model.config, site, layer), clean, **where)
            assert float(r.exact[layer, j]) == pytest.approx(metric(one.logits_after, 3, 5), abs=1e-5)
    assert r.corrupt == pytest.approx(metric(one.logits_before, 3, 5), abs=1e-5)
    # Patching the whole clean stream into the first block gives the clean run back.
    if site == "resid_pre":
        full = patch(model, corrupt, "embed", clean)
        assert metric(full.logits_after, 3, 5) == pytest.approx(r.clean, abs=1e-5)


def test_batches_of_any_size_give_the_one_forward_per_patch_grid(model):
    clean, corrupt = texts(T=7)
    one = patch_sweep(model, clean, corrupt, 3, 5, "resid_pre", batch=1).exact
    for batch in (5, None):  # 5 splits layers across forwards
        assert torch.allclose(patch_sweep(model, clean, corrupt, 3, 5, "resid_pre", batch=batch).exact, one, atol=1e-5)


@pytest.mark.parametrize("site", ["resid_pre", "z"])
def test_attribution_is_the_metrics_slope_towards_the_clean_activation(site):
    m = tiny_model().double()
    clean, corrupt = texts()
    r = patch_sweep(m, clean, corrupt, 3, 5, site, method="both")
    layer, j = 1, 2
    name = site_probe(m.config, site, layer)
    _, seen = run_with(m, clean, {}, record=[name])
    src = seen[name].double()

    def moved(eps):
        def fn(_, x):
            y = x.clone()
            if site == "z":
                y[:, :, j] += eps * (src[:, :, j] - x[:, :, j])
            else:
                y[:, j] += eps * (src[:, j] - x[:, j])
            return y
        logits, _ = run_with(m, corrupt, {name: fn})
        return metric(logits[0].double(), 3, 5)

    eps = 1e-2  # run_with hands back float32 logits: a smaller step would measure their rounding
    slope = (moved(eps) - moved(-eps)) / (2 * eps)
    assert float(r.attribution[layer, j]) == pytest.approx(slope, rel=1e-3, abs=1e-6)
    assert float(r.estimate[layer, j]) == pytest.approx(r.corrupt + float(r.attribution[layer, j]), abs=1e-6)
    assert r.correlation == pytest.approx(float(np.corrcoef(r.exact.flatten(), r.estimate.flatten())[0, 1]), abs=1e-9)
    assert pearson(torch.ones(2, 2), r.exact) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("patch") / "ckpt"
    tiny_checkpoint(folder, "the cat sat on the mat. the dog sat on the log. " * 20)
    return folder


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("site, method", [("resid_pre", "exact"), ("z", "both"), ("mlp_out", "attribution")])
def test_the_command_prints_the_grid_as_its_last_json_line(checkpoint, capsys, tmp_path, site, method):
    html = tmp_path / "grid.html"
    argv = ["patch", "--checkpoint", str(checkpoint), "--clean", "the cat sat on the", "--corrupt", "the dog sat on the",
            "--answer", " mat", "--wrong", " log", "--site", site, "--method", method, "--json", "--html", str(html)]
    assert run_cli(argv) == 0
    out = last_json(capsys)
    assert out["site"] == site and len(out["grid"]) == 2
    assert len(out["grid"][0]) == (4 if site == "z" else len(out["clean_tokens"]))
    assert isinstance(out["clean"], float) and isinstance(out["corrupt"], float)
    assert ("correlation" in out) == (method == "both")
    assert "glass-research" in html.read_text()


def test_bad_input_is_one_line(checkpoint, capsys):
    base = ["patch", "--checkpoint", str(checkpoint), "--answer", " mat", "--wrong", " log"]
    err = one_error(capsys, base + ["--clean", "the cat sat", "--corrupt", "the dog sat on the"], "clean is", "corrupt is")
    assert "'" in err  # both tokenizations shown
    one_error(capsys, base + ["--clean", "a", "--corrupt", "b", "--site", "resid"], "resid_pre, attn_out, mlp_out, z")
    one_error(capsys, base + ["--clean", "a", "--corrupt", "b", "--method", "guess"], "exact, attribution, both")
    argv = ["patch", "--checkpoint", str(checkpoint), "--clean", "a", "--corrupt", "b", "--wrong", " log"]
    one_error(capsys, argv + ["--answer", "the cat"], "--answer", "tokens")


@pytest.mark.skipif(not INDUCTION.exists(), reason="no induction demo model in tests/data")
def test_the_z_sweep_of_a_repeated_sequence_peaks_at_the_induction_head():
    """The reference experiment: on the induction-heads demo model, patching z over [eot, r, r[:k]]
    (clean) into [eot, r', r[:k]] (corrupt, r' other tokens) restores the answer r[k] most through the
    head the induction score names: the share of the clean − corrupt gap each head restores, averaged
    over 8 random sequences (all four heads of layer 1 are induction heads here, so one sequence alone
    may favour another)."""
    from glassformer.checkpoint.loading import load
    from glassformer.train.induction import RECIPE, alphabet_ids, eval_batch_for, model_scores

    model, tok = load(INDUCTION)
    scores = model_scores(model, eval_batch_for(RECIPE))["induction_heads"]
    named = max(((layer, h) for layer in range(2) for h in range(4)),
                key=lambda lh: scores[f"blocks.{lh[0]}.attn"][lh[1]])
    ids = alphabet_ids(tok)
    share = torch.zeros(2, 4)
    for seed in range(8):
        both = np.random.default_rng(seed).choice(ids, 32, replace=False).tolist()
        r, other, k = both[:16], both[16:], 10
        res = patch_sweep(model, [tok.eot_id] + r + r[:k], [tok.eot_id] + other + r[:k], r[k], other[k], "z")
        assert res.clean > res.corrupt + 1
        share += (res.exact - res.corrupt) / (res.clean - res.corrupt) / 8
    peak = np.unravel_index(int(share.argmax()), tuple(share.shape))
    assert tuple(int(v) for v in peak) == named


def test_a_mixture_of_experts_is_patched_at_its_mixture():
    """On a MoE layer mlp_out is the mixture's output (ffn.down): each cell still equals one patched run."""
    m = tiny_model(n_experts=4, n_active_experts=2, n_shared_experts=1)
    clean, corrupt = texts(T=5)
    r = patch_sweep(m, clean, corrupt, 3, 5, "mlp_out")
    for layer, j in ((0, 1), (1, 4)):
        one = patch(m, corrupt, site_probe(m.config, "mlp_out", layer), clean, tokens=[j])
        assert float(r.exact[layer, j]) == pytest.approx(metric(one.logits_after, 3, 5), abs=1e-5)
