"""Sparse autoencoders (research/sae.py, `glassformer sae`, generate --sae): the TopK encoder against a
numpy recomputation, the export against SAELens's format (and SAELens itself where it is installed),
resumed training against an unbroken run, feature edits against the same edit made through the probes,
the browser's numbers against the activations they come from, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glassformer.errors import UserError
from glassformer.research import sae as S
from glassformer.tracing.interventions import run_with
from tests.support import greedy_by_full_forward, greedy_cached, one_error, run_cli, synthetic_text, tiny_checkpoint, tiny_model

# Wide, k 2 and a short dead window: features go dead within the run, so the AuxK path runs and is resumed too.
SETTINGS = dict(features=128, k=2, tokens=2048, batch_tokens=256, chunk_batches=4, context=32, eval_tokens=512, lr=2e-3,
                dead_tokens=256)


def _random_sae(d_in=16, d_sae=40, k=5, seed=0) -> S.TopKSAE:
    g = torch.Generator().manual_seed(seed)
    sae = S.TopKSAE(d_in, d_sae, k)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    sae.normalize_decoder()
    return sae


def _numpy_topk(sae: S.TopKSAE, x: np.ndarray) -> np.ndarray:
    """SAELens's TopK encode written out in numpy: pre = (x − b_dec)·W_enc + b_enc; keep the k largest, ReLU."""
    W_enc, b_enc, b_dec = (p.detach().double().numpy() for p in (sae.W_enc, sae.b_enc, sae.b_dec))
    pre = (x - b_dec) @ W_enc + b_enc
    out = np.zeros_like(pre)
    top = np.argsort(-pre, axis=-1)[..., :sae.k]
    np.put_along_axis(out, top, np.maximum(np.take_along_axis(pre, top, -1), 0), -1)
    return out


def test_topk_encoder_and_decoder_match_numpy():
    sae = _random_sae()
    x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1)) * 2
    acts = sae.encode(x)
    ref = _numpy_topk(sae, x.double().numpy())
    assert np.abs(acts.detach().double().numpy() - ref).max() < 1e-5
    assert ((acts > 0).sum(-1) <= sae.k).all() and (acts > 0).any()
    W_dec, b_dec = sae.W_dec.detach().double().numpy(), sae.b_dec.detach().double().numpy()
    x_hat, v, i = sae(x)
    assert np.abs(x_hat.detach().double().numpy() - (ref @ W_dec + b_dec)).max() < 1e-4
    assert torch.allclose(sae.decode(acts), x_hat, atol=1e-5)


def test_explained_variance():
    x = torch.randn(100, 8)
    assert S.explained_variance(x, x) == pytest.approx(1.0)
    assert S.explained_variance(x, x.mean(0).expand_as(x)) == pytest.approx(0.0, abs=1e-12)
    assert S.explained_variance(x, 0.5 * x + 0.5 * x.mean(0)) == pytest.approx(0.75, abs=1e-9)


def test_export_is_saelens_topk_format(tmp_path):
    """The files SAELens 6.54's SAE.load_from_disk reads: cfg.json with the fields TopKSAEConfig.to_dict writes
    (architecture 'topk'), and W_enc (d_in, d_sae), b_enc, W_dec (d_sae, d_in), b_dec in float32."""
    from safetensors.torch import load_file

    sae = _random_sae()
    meta = {"site": "blocks.1.hook_resid_pre", "probe": "blocks.0.resid_out", "hook_name": "blocks.1.hook_resid_pre",
            "model_name": "m"}
    S.save_sae(sae, tmp_path / "sae", meta, context_size=32)
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert {k: cfg[k] for k in ("d_in", "d_sae", "k", "architecture", "apply_b_dec_to_input", "normalize_activations",
                                "reshape_activations", "rescale_acts_by_decoder_norm", "dtype")} == {
        "d_in": 16, "d_sae": 40, "k": 5, "architecture": "topk", "apply_b_dec_to_input": True,
        "normalize_activations": "none", "reshape_activations": "none", "rescale_acts_by_decoder_norm": False,
        "dtype": "float32"}
    assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_pre" and cfg["metadata"]["context_size"] == 32
    w = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))
    assert {k: tuple(v.shape) for k, v in w.items()} == {"W_enc": (16, 40), "b_enc": (40,), "W_dec": (40, 16), "b_dec": (16,)}
    assert all(v.dtype == torch.float32 for v in w.values())
    assert torch.equal(w["W_dec"], sae.W_dec.detach())


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """A tiny checkpoint, its text, and an SAE trained on blocks.1.hook_resid_pre by the CLI (and what it printed)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("sae")
    text = synthetic_text(250, 1)
    (root / "data.txt").write_text(text)
    model, tok = tiny_checkpoint(root / "ckpt", text)
    argv = ["sae", "train", "--checkpoint", str(root / "ckpt"), "--site", "blocks.1.hook_resid_pre", "--data",
            str(root / "data.txt"), "--features", "32", "--k", "4", "--tokens", "2048", "--batch-tokens", "256",
            "--context", "32", "--eval-tokens", "512", "--lr", "2e-3", "--out", str(root / "sae"), "--no-progress",
            "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_cli(argv) == 0
    return root, model, tok, out.getvalue()


def test_train_cli_reports_and_writes_both_formats(trained, capsys):
    root, model, tok, printed = trained
    r = json.loads(printed.strip().splitlines()[-1])
    assert r["probe"] == "blocks.0.resid_out" and r["d_in"] == model.config.dim and r["tokens"] == 2048
    assert 0 < r["explained_variance"] <= 1 and 0 < r["l0"] <= 4 and 0 <= r["dead_features"] <= 32
    assert {"sae.json", "cfg.json", "sae_weights.safetensors", "train_state.pt"} <= {p.name for p in (root / "sae").iterdir()}
    sae, meta, site = S.load_sae(root / "sae", model)
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(32), atol=1e-5)  # unit-norm decoder rows
    # the figures printed are the SAE's own on the held-out activations
    ids = np.asarray(tok.encode((root / "data.txt").read_text()))
    x = S.site_activations(model, site.probe, torch.from_numpy(ids[:32 * 8].reshape(8, 32))).reshape(-1, sae.d_in)
    untrained = S.TopKSAE(sae.d_in, 32, 4)
    untrained.initialize(torch.Generator().manual_seed(0), x.mean(0))
    assert S.evaluate(sae, x)["explained_variance"] > S.evaluate(untrained, x)["explained_variance"] + 0.05
    # export: SAELens's two files, byte for byte those of the folder
    assert run_cli(["sae", "export", "--sae", str(root / "sae"), "--out", str(root / "exp")]) == 0
    for name in ("cfg.json", "sae_weights.safetensors"):
        assert (root / "exp" / name).read_bytes() == (root / "sae" / name).read_bytes()
    assert sorted(p.name for p in (root / "exp").iterdir()) == ["cfg.json", "sae_weights.safetensors"]


def test_resumed_training_equals_an_unbroken_run(tmp_path, one_thread):
    model = tiny_model()
    ids = np.asarray(torch.randint(0, model.config.vocab_size, (3000,), generator=torch.Generator().manual_seed(0)))
    site = S.resolve_site(model, "blocks.0.hook_mlp_out")
    whole = S.Trainer(model, site, ids, ids, S.TrainSettings(**SETTINGS), tmp_path / "a")
    whole.train(progress=False)
    S.Trainer(model, site, ids, ids, S.TrainSettings(**{**SETTINGS, "tokens": 1024}), tmp_path / "b").train(progress=False)
    with pytest.raises(UserError, match="--resume"):
        S.Trainer(model, site, ids, ids, S.TrainSettings(**SETTINGS), tmp_path / "b")
    resumed = S.Trainer(model, site, ids, ids, S.TrainSettings(**SETTINGS), tmp_path / "b", resume=True)
    assert resumed.step == 4
    assert int((resumed.since_fired > 256).sum()) > 0  # dead features carried over, the AuxK loss on
    resumed.train(progress=False)
    for (n, a), b in zip(whole.sae.named_parameters(), resumed.sae.parameters()):
        assert torch.equal(a, b), n
    assert resumed.tokens == whole.tokens == 2048


def test_sites_resolve_to_probes():
    pre, post = tiny_model(), tiny_model(norm_placement="post")
    assert S.resolve_site(pre, "blocks.0.hook_resid_pre").probe == "embed"
    assert S.resolve_site(pre, "blocks.1.hook_resid_mid").probe == "blocks.1.resid_mid"
    assert S.resolve_site(post, "blocks.1.hook_resid_mid").probe == "blocks.1.attn_norm"  # post-norm's stream
    assert S.resolve_site(post, "blocks.1.hook_resid_post").probe == "blocks.1.ffn_norm"
    assert S.resolve_site(pre, "blocks.1.hook_mlp_out").probe == "blocks.1.ffn.down"
    s = S.resolve_site(pre, "blocks.0.resid_out")  # a probe name finds its hook name
    assert (s.hook, s.kind, s.layer) == ("blocks.0.hook_resid_post", "resid_post", 0)
    s = S.resolve_site(pre, "blocks.1.ffn.act")
    assert s.hook is None and s.probe == "blocks.1.ffn.act"
    with pytest.raises(UserError, match=r"unknown site 'blocks.1.attn.weights'.*hook_X, X one of resid_pre.*blocks.0.attn.out"):
        S.resolve_site(pre, "blocks.1.attn.weights")
    with pytest.raises(UserError, match="blocks run 0..1"):
        S.resolve_site(pre, "blocks.5.hook_resid_pre")
    with pytest.raises(UserError, match="no feed-forward"):
        S.resolve_site(tiny_model(ffn="none"), "blocks.0.hook_mlp_out")


def _edit_by_probe(sae, ablate=(), steer=()):
    """The same edit made independently, through the probes: x − Σ act_f·W_dec[f] + Σ scale·W_dec[f]."""
    def fn(name, x):
        acts = sae.encode(x.float())
        out = x.float().clone()
        for f in ablate:
            out -= acts[..., f:f + 1] * sae.W_dec[f]
        for f, s in steer:
            out += s * sae.W_dec[f]
        return out.to(x.dtype)
    return fn


@pytest.mark.parametrize("hook,probe", [("blocks.1.hook_resid_pre", "blocks.0.resid_out"),
                                        ("blocks.0.hook_resid_post", "blocks.0.resid_out"),
                                        ("blocks.1.hook_attn_out", "blocks.1.attn.out"),
                                        ("blocks.0.hook_mlp_out", "blocks.0.ffn.down")])
def test_feature_edit_hooks_equal_the_edit_through_probes(hook, probe):
    model = tiny_model()
    site = S.resolve_site(model, hook)
    assert site.probe == probe
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    sae = _random_sae(d_in=model.config.dim, d_sae=48, k=6, seed=1)
    with torch.no_grad():
        sae.b_dec.zero_()
    x = run_with(model, ids, {}, record=[probe])[1][probe]
    active = sorted(set(sae.encode_topk(x)[1][0, :, 0].tolist()))[:3]  # features that do fire on this text
    base = run_with(model, ids, {})[0]
    for ablate, steer in ((active, []), ([], [(active[0], 3.0)]), (active[:1], [(5, -2.0)])):
        want = run_with(model, ids, {probe: _edit_by_probe(sae, ablate, steer)})[0]
        with S.FeatureEdit(model, sae, site, ablate=ablate, steer=steer):
            got = run_with(model, ids, {})[0]
        assert torch.allclose(got, want, atol=1e-4), (ablate, steer)
        assert (got - base).abs().max() > 1e-3  # the edit did something
    with S.FeatureEdit(model, sae, site, ablate=[]):  # nothing ablated: nothing changes
        assert torch.allclose(run_with(model, ids, {})[0], base, atol=1e-6)


def test_feature_edit_holds_with_the_kv_cache():
    model = tiny_model()
    sae = _random_sae(d_in=model.config.dim, d_sae=48, k=6, seed=2)
    site = S.resolve_site(model, "blocks.1.hook_resid_pre")
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = greedy_cached(model, prompt, 8)
    with S.FeatureEdit(model, sae, site, steer=[(0, 6.0), (7, -6.0)]):
        cached = greedy_cached(model, prompt, 8)
        full = greedy_by_full_forward(model, prompt[0].tolist(), 8)
    assert cached == full and cached != plain


def test_an_sae_for_another_model_or_site_is_refused(trained, tmp_path):
    root, model, tok, _ = trained
    wider = tiny_model(dim=96, n_heads=4, n_kv_heads=4, vocab_size=model.config.vocab_size)
    with pytest.raises(UserError) as e:
        S.load_sae(root / "sae", wider)
    assert "width 64" in str(e.value) and "width 96" in str(e.value)
    meta = json.loads((root / "sae" / "sae.json").read_text())
    with pytest.raises(UserError, match=r"reads blocks.1.hook_attn_out \(blocks.1.attn.out, width 64\); this site is "
                                        r"blocks.0.resid_out of width 64"):
        S.check_fits({**meta, "site": "blocks.1.hook_attn_out", "probe": "blocks.1.attn.out"}, model.config,
                     "blocks.0.resid_out", 64, "x")
    S.save_sae(S.TopKSAE(48, 32, 4), tmp_path / "narrow", {**meta, "d_in": 48})
    with pytest.raises(UserError, match=r"width 48\); this site is blocks.0.resid_out of width 64"):
        S.load_sae(tmp_path / "narrow", model)


def test_feature_report_matches_the_activations(trained):
    root, model, tok, _ = trained
    sae, _, site = S.load_sae(root / "sae", model)
    ids = np.asarray(tok.encode((root / "data.txt").read_text()))
    rep = S.feature_report(model, sae, site, ids, tok, n_tokens=1024, context=32, top=3, window=4)
    assert rep["tokens"] == 1024 and rep["features"]
    x = S.site_activations(model, site.probe, torch.from_numpy(ids[:1024].reshape(-1, 32))).reshape(-1, sae.d_in)
    with torch.no_grad():
        acts = sae.encode(x)  # (1024, d_sae), recomputed here
    for f in rep["features"][:5]:
        col = acts[:, f["id"]]
        assert f["frequency"] == pytest.approx(float((col > 0).float().mean()))
        assert f["max"] == pytest.approx(float(col.max()), abs=1e-4)
        c = f["contexts"][0]
        assert c["act"] == pytest.approx(float(col.max()), abs=1e-4) and c["acts"][c["at"]] == pytest.approx(c["act"], abs=1e-4)
        p = c["position"]
        lo = p - c["at"]
        assert c["acts"] == pytest.approx([float(col[q]) for q in range(lo, lo + len(c["acts"]))], abs=1e-4)
        # the logit effect: W_dec[f] · diag(final norm weight) · W_Uᵀ orders the tokens
        direct = (sae.W_dec[f["id"]] * model.final_norm.weight) @ model.lm_head.weight.T
        top = [tok.id_to_piece(int(t)) for t in direct.topk(3).indices]
        assert [t for t, _ in f["logits"]["top"][:3]] == top


def test_cli_features_page_generate_and_errors(trained, capsys, tmp_path):
    root, model, tok, _ = trained
    page = tmp_path / "f.html"
    assert run_cli(["sae", "features", "--checkpoint", str(root / "ckpt"), "--sae", str(root / "sae"), "--data",
                    str(root / "data.txt"), "--tokens", "512", "--context", "32", "--top", "2", "--html", str(page)]) == 0
    html = page.read_text()
    assert "feature-data" in html and "features.js" not in html and "function show(f)" in html
    data = json.loads(html.split('type="application/json">')[1].split("</script>")[0])
    assert data["site"] == "blocks.1.hook_resid_pre" and data["features"][0]["contexts"]
    gen = ["generate", "--checkpoint", str(root / "ckpt"), "--prompt", "The king", "--greedy", "--max-new-tokens", "8"]
    capsys.readouterr()
    outs = []
    for extra in ([], ["--sae", str(root / "sae"), "--sae-steer", f"{data['features'][0]['id']}:40"]):
        assert run_cli(gen + extra) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] != outs[1]
    one_error(capsys, gen + ["--sae-ablate", "3"], "--sae")
    one_error(capsys, gen + ["--sae", str(root / "sae")], "--sae-ablate")
    one_error(capsys, gen + ["--sae", str(root / "sae"), "--sae-steer", "3"], "FEATURE:SCALE")
    one_error(capsys, gen + ["--sae", str(root / "sae"), "--sae-ablate", "999"], "999", "0..31")
    one_error(capsys, gen + ["--sae", str(root), "--sae-ablate", "1"], "not an SAE folder")
    one_error(capsys, ["sae", "train", "--checkpoint", str(root / "ckpt"), "--site", "blocks.9.nope", "--data",
                       str(root / "data.txt"), "--features", "8", "--k", "2", "--out", str(tmp_path / "s")],
              "unknown site", "blocks.L.hook_X")
    one_error(capsys, ["sae", "train", "--checkpoint", str(root / "ckpt"), "--site", "blocks.0.hook_resid_pre", "--data",
                       str(root / "data.txt"), "--features", "8", "--k", "9", "--out", str(tmp_path / "s")], "--k 9")
    one_error(capsys, ["sae", "export", "--sae", str(root / "sae"), "--out", str(root / "sae")], "own folder")


def test_sae_lens_loads_the_folder_with_the_same_activations(trained):
    """The parity test proper: SAELens 6.54 reads our folder and encodes as we do (within 1e-5). sae-lens
    pins transformer-lens < 4, so it cannot share this project's environment with the patching tests'
    transformer-lens 4.3: it runs where sae-lens is installed; elsewhere the numpy test above stands in."""
    sae_lens = pytest.importorskip("sae_lens")
    root, model, tok, _ = trained
    ours, _, site = S.load_sae(root / "sae", model)
    ref = sae_lens.SAE.load_from_disk(str(root / "sae"))
    ids = np.asarray(tok.encode((root / "data.txt").read_text()))[:256]
    x = S.site_activations(model, site.probe, torch.from_numpy(ids.reshape(-1, 32)))
    assert (ref.encode(x) - ours.encode(x)).abs().max() < 1e-5
    assert (ref.decode(ref.encode(x)) - ours.decode(ours.encode(x))).abs().max() < 1e-5


@pytest.mark.browser
def test_feature_page_draws_in_chromium(tmp_path):
    """The browser page (viewer/features.py + static/features.js) in a real Chromium: no page errors, the
    list and a picked feature's contexts and logit tables drawn, a hostile token shown as text."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install '.[dev]')")
    from tests.viewer.test_viewer_browser import CHROMIUM_ARGS, HOSTILE, _chromium

    from glassformer.viewer.features import write_page

    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium found: run scripts/ensure_browser.sh (apt-get install chromium) to enable browser tests")
    ctx = {"act": 2.0, "at": 1, "position": 9, "tokens": ["a", HOSTILE, "</script>"], "acts": [0.0, 2.0, 1.0]}
    rep = {"sae": "s", "site": "blocks.1.hook_resid_pre", "probe": "blocks.0.resid_out", "d_in": 4, "d_sae": 3, "k": 1,
           "tokens": 64, "context": 32, "dead_features": 1, "evaluation": None,
           "features": [{"id": 0, "frequency": 0.5, "max": 2.0, "contexts": [ctx]},
                        {"id": 2, "frequency": 0.25, "max": 1.5, "contexts": [ctx, ctx],
                         "logits": {"top": [["x", 1.0]], "bottom": [["y", -1.0]]}}]}
    page = write_page(tmp_path / "f.html", rep)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        pg, errors, dialogs = b.new_page(), [], []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        pg.goto(page.as_uri())
        assert pg.locator("#feature-list button").count() == 2
        pg.locator("#feature-list button").nth(1).click()
        assert pg.inner_text("#feature-detail h2") == "feature 2"
        assert pg.locator("#feature-detail .ctx").count() == 2 and pg.locator("table.logits").count() == 2
        shown = pg.inner_text("#feature-detail")  # spaces drawn as middle dots
        assert HOSTILE.replace(" ", "\u00b7") in shown and "</script>" in shown
        assert pg.locator(".tok-at").first.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(255, 140, 0)"
        pg.fill("#feature-filter", "2")
        assert pg.locator("#feature-list button").count() == 1
        b.close()
    assert not errors and not dialogs


def test_data_from_a_prepared_folder_or_a_text_file(tmp_path):
    from tests.support import make_prepared

    folder = make_prepared(tmp_path / "prep", n_train=120, n_val=30)
    meta = json.loads((folder / "meta.json").read_text())
    model = tiny_model(vocab_size=meta["vocab_size"])
    train, held = S.data_ids(folder, model, None)
    assert (len(train), len(held)) == (meta["train_tokens"], meta["val_tokens"])
    with pytest.raises(UserError, match=f"{meta['vocab_size']} token ids but the model has 512"):
        S.data_ids(folder, tiny_model(), None)
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_file(folder / "tokenizer.json")
    (tmp_path / "t.txt").write_text(synthetic_text(50, 3))
    train, held = S.data_ids(tmp_path / "t.txt", model, tok)
    assert len(held) == (len(train) + len(held)) // 10
    with pytest.raises(UserError, match="does not exist"):
        S.data_ids(tmp_path / "missing.txt", model, tok)


def test_aux_k_loss_reaches_the_dead_features_only():
    """AuxK: the dead features' k_aux largest pre-activations reconstruct the residual x − x̂; only their
    decoder rows get a gradient, and the value is the normalised error written out here."""
    sae = _random_sae(d_in=8, d_sae=20, k=2, seed=5)
    x = torch.randn(30, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        x_hat, _, _ = sae(x)
        pre = sae.pre(x)
    dead = torch.zeros(20, dtype=torch.bool)
    dead[[3, 7, 11, 12, 19]] = True
    loss = S._aux_loss(sae, x, x_hat, pre, dead)
    loss.backward()
    live_rows = sae.W_dec.grad[~dead]
    assert live_rows.abs().max() == 0 and sae.W_dec.grad[dead].abs().sum() > 0
    k_aux = 4  # d_in / 2, fewer than the 5 dead
    p = pre.masked_fill(~dead, float("-inf"))
    v, i = p.topk(k_aux, dim=-1)
    e = x - x_hat
    e_hat = torch.stack([(v[n].relu()[:, None] * sae.W_dec.detach()[i[n]]).sum(0) for n in range(30)])
    assert float(loss.detach()) == pytest.approx(float(((e - e_hat) ** 2).sum() / (e ** 2).sum()), rel=1e-5)


def test_the_explorer_serves_the_feature_browser(trained, capsys):
    """`view --sae SAE --sae-data D` builds the browser at start-up and serves it at /features (behind the
    same key as every route); without --sae-data, or with --worked, one line."""
    from glassformer.cli import build_parser
    from glassformer.commands.view import build_explorer
    from glassformer.viewer.server import make_server

    from tests.viewer.test_viewer_server import request

    root, model, tok, _ = trained
    args = build_parser().parse_args(["view", "--checkpoint", str(root / "ckpt"), "--sae", str(root / "sae"),
                                      "--sae-data", str(root / "data.txt")])
    ex = build_explorer(args)
    server = make_server(ex, port=0, api_key="k-123")
    server.start_in_thread()
    try:
        status, _, _ = request(server, "GET", "/features")
        assert status == 401
        status, headers, body = request(server, "GET", "/features", headers={"Authorization": "Bearer k-123"})
        assert status == 200 and headers["content-type"].startswith("text/html")
        data = json.loads(body.decode().split('<script id="feature-data" type="application/json">')[1].split("</script>")[0])
        assert data["site"] == "blocks.1.hook_resid_pre" and data["features"]
    finally:
        server.stop()
    one_error(capsys, ["view", "--checkpoint", str(root / "ckpt"), "--sae", str(root / "sae")], "--sae-data")
    one_error(capsys, ["view", "--worked", "--sae", str(root / "sae")], "--sae goes with --checkpoint")
