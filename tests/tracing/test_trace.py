"""Traces: every probe with its shape, free when off, strict JSON, tiled == naive, limits, size."""

import json
import math

import pytest
import torch

import glassformer
from glassformer import probes
from glassformer.tracing.trace import Trace, trace
from glassformer.tracing.format import numbers_text

from ..support import tiny_model, WORKED_FIGURES

IDS = [5, 17, 3, 99, 17, 250, 8, 41, 7, 300]


def _strict(text: str):
    def bad(c):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(text, parse_constant=bad)


def expected_probes(cfg, T):
    D, N, K, H, F, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    out = {"embed": (T, D), "final_norm": (T, D), "logits": (T, V), "probs": (T, V)}
    for i in range(cfg.n_layers):
        b = f"blocks.{i}"
        out.update({
            f"{b}.attn_norm": (T, D), f"{b}.attn.q": (T, N, H), f"{b}.attn.k": (T, K, H), f"{b}.attn.v": (T, K, H),
            f"{b}.attn.scores": (T, N, T), f"{b}.attn.weights": (T, N, T), f"{b}.attn.z": (T, N, H),
            f"{b}.attn.out": (T, D), f"{b}.resid_mid": (T, D), f"{b}.ffn_norm": (T, D), f"{b}.ffn.up": (T, F),
            f"{b}.ffn.act": (T, F), f"{b}.ffn.down": (T, D), f"{b}.resid_out": (T, D),
        })
        if cfg.pos == "rope":
            out.update({f"{b}.attn.q_rot": (T, N, H), f"{b}.attn.k_rot": (T, K, H)})
        if cfg.ffn == "swiglu":
            out[f"{b}.ffn.gate"] = (T, F)
    return out


@pytest.mark.parametrize("over", [
    {}, dict(norm_placement="post", ffn="relu", pos="learned"), dict(ffn="gelu", pos="none", norm="layer", bias=True),
])
def test_trace_records_every_probe_with_its_shape_and_axes(over):
    m = tiny_model(**over)
    t = trace(m, IDS)
    want = expected_probes(m.config, len(IDS))
    assert {n: tuple(p.data.shape) for n, p in t.probes.items()} == want
    assert t["blocks.0.attn.k"].shape[1] == m.config.n_kv_heads
    assert t.probe("blocks.1.attn.k").axes == ["token", "kv_head", "feature"]
    assert t.probe("blocks.1.attn.scores").axes == ["token", "head", "key"]
    assert t.probe("logits").axes == ["token", "vocab"]
    # The recorded logits are the model's own.
    with torch.no_grad():
        logits, _ = m(torch.tensor([IDS]))
    assert torch.equal(t["logits"], logits[0])
    assert torch.allclose(t["probs"], torch.softmax(logits[0], -1), atol=1e-7)
    assert t.config["rope_pairs"] == m.config.rope_pairs and t.positions == list(range(len(IDS)))


def test_scores_are_scaled_before_the_mask_and_weights_after_it():
    m = tiny_model(attention="naive")
    t = trace(m, IDS)
    T, H = len(IDS), m.config.head_dim
    q, k = t["blocks.1.attn.q_rot"], t["blocks.1.attn.k_rot"]  # (T, N, H), (T, K, H)
    k = k.repeat_interleave(m.config.n_rep, dim=1)  # (T, N, H)
    ref = torch.einsum("tnh,snh->tns", q, k) / math.sqrt(H)  # (T, N, T), no mask
    assert torch.allclose(t["blocks.1.attn.scores"], ref, atol=1e-6)
    w = t["blocks.1.attn.weights"]
    future = torch.ones(T, T).triu(1).bool()  # (T, Tk)
    assert torch.isnan(w[future[:, None, :].expand_as(w)]).all()
    assert not torch.isnan(w[~future[:, None, :].expand_as(w)]).any()
    masked = ref.masked_fill(future[:, None, :], float("-inf"))
    assert torch.allclose(torch.nan_to_num(w), torch.softmax(masked, -1), atol=1e-6)


def test_a_trace_costs_nothing_when_off(monkeypatch):
    m = tiny_model()
    x = torch.tensor([IDS])
    with torch.no_grad():
        before, _ = m(x)
    assert not probes.active()
    trace(m, IDS, attention="tiled")
    assert not probes.active()  # the recorder is gone again, and the kernel is the model's own
    assert m.config.attention == "sdpa" and all(b.attn.kernel.__name__ == "sdpa_attention" for b in m.blocks)
    # With no recorder the score grid is never formed and nothing sees the tensors.
    import glassformer.model

    def boom(*a, **k):
        raise AssertionError("score grid formed with tracing off")

    monkeypatch.setattr(glassformer.model, "show_scores", boom)
    with torch.no_grad():
        after, _ = m(x)
    assert torch.equal(before, after)
    # A failing forward inside a trace still removes the recorder.
    with pytest.raises(glassformer.errors.UserError):
        trace(m, [1, 2, 10**6])
    assert not probes.active()


def test_trace_json_is_strict_and_masked_cells_are_null():
    m = tiny_model(sliding_window=3)
    t = trace(m, IDS, with_weights=True, attention="tiled", tile=3)
    d = _strict(t.to_json())
    assert d["format"] == "glassformer-trace" and d["tokens"] == [f"#{i}" for i in IDS] and d["ids"] == IDS
    assert d["config"]["rope_pairs"] == "half" and len(d["rope_inv_freq"]) == m.config.head_dim // 2
    w = d["probes"]["blocks.0.attn.weights"]
    T = len(IDS)
    assert w["shape"] == [T, 4, T] and w["axes"] == ["token", "head", "key"]
    for i in range(T):
        for j in range(T):
            readable = j <= i and i - j < 3
            assert (w["data"][i][0][j] is None) == (not readable)
    s = d["probes"]["blocks.0.attn.scores"]["data"]
    assert all(isinstance(v, float) for row in s for h in row for v in h)  # scores: every cell a number
    wq = d["weights"]["blocks.0.attn.wq.weight"]
    assert wq["axes"] == ["in", "out"] and wq["shape"] == [m.config.dim, m.config.q_dim]
    assert torch.allclose(torch.tensor(wq["data"]), m.blocks[0].attn.wq.weight.t(), rtol=1e-6, atol=0)
    # Read back: the same numbers to 7 significant digits.
    back = Trace.from_dict(d)
    for name, p in t.probes.items():
        a, b = p.data, back[name]
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), rtol=1e-6, atol=1e-12), name
    assert back.tiles[0]["steps"][-1]["k"] == [9, 10]


def test_numbers_text_writes_nested_lists_with_null():
    import numpy as np

    a = np.array([[[1.0, float("nan")], [0.5, -2.0]], [[1e-8, float("inf")], [3.25, 0.0]]])
    assert _strict(numbers_text(a)) == [[[1, None], [0.5, -2]], [[1e-8, None], [3.25, 0]]]
    assert numbers_text(np.array([1 / 3]), digits=3) == "[0.333]"


def test_tiled_trace_equals_naive_trace():
    m = tiny_model()
    naive = trace(m, IDS, attention="naive")
    tiled = trace(m, IDS, attention="tiled", tile=3)
    assert naive.probes.keys() == tiled.probes.keys()
    for name, p in naive.probes.items():
        a, b = p.data, tiled[name]
        assert torch.equal(torch.isnan(a), torch.isnan(b)), name
        assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=1e-5), name
    assert tiled.config["attention"] == "tiled" and naive.config["attention"] == "naive"


def test_layers_heads_and_top_k_limit_the_trace():
    m = tiny_model()
    full = trace(m, IDS)
    t = trace(m, IDS, layers=[1], heads=[3], top_k=4, with_weights=True)
    assert t.layers == [1] and t.heads == [3]
    assert not any(n.startswith("blocks.0.") and not n.endswith(("resid_out", "ffn_norm")) for n in t.probes)
    assert t["blocks.1.attn.q"].shape == (len(IDS), 1, m.config.head_dim)
    assert t.probe("blocks.1.attn.k").index == {"kv_head": [1]}  # head 3 reads KV head 3 // 2
    assert t.value("blocks.1.attn.z", [4, 3, 5]) == full.value("blocks.1.attn.z", [4, 3, 5])
    assert t.value("blocks.1.attn.v", [4, 1, 5]) == full.value("blocks.1.attn.v", [4, 1, 5])
    with pytest.raises(glassformer.errors.UserError):
        t.value("blocks.1.attn.z", [4, 2, 5])
    top = full["logits"].topk(4, dim=-1)
    assert t.probe("logits").index["vocab"] == top.indices.tolist()
    assert torch.equal(t["logits"], top.values)
    assert t.value("probs", [2, top.indices[2, 1]]) == pytest.approx(float(full["probs"][2, top.indices[2, 1]]))
    lse = torch.logsumexp(full["logits"].double(), -1)
    assert t.probe("logits").extra["logsumexp"] == pytest.approx(lse.tolist(), rel=1e-12)
    assert set(t.weights["lm_head.weight"].index["out"]) == {v for row in top.indices.tolist() for v in row}
    assert "blocks.0.attn.wq.weight" not in t.weights and "blocks.1.attn.wq.weight" in t.weights
    with pytest.raises(glassformer.errors.UserError):
        trace(m, IDS, layers=[2])


@pytest.mark.slow
def test_size_of_a_100m_weight_model_trace_stays_under_50_mb():
    # 12 layers of width 768 (GPT-2 small's body) over a 16k vocabulary: 110M weights.
    cfg = glassformer.ModelConfig(vocab_size=16384, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, max_seq_len=64,
                                  ffn="gelu", attention="naive", tie_embeddings=False)
    with torch.device("meta"):
        m = glassformer.Transformer(cfg)
    m = m.to_empty(device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.02)
        m.rope_inv_freq.copy_(glassformer.model.rope_inv_freq(cfg))
    assert 100e6 < m.num_params() < 115e6
    ids = torch.randint(0, cfg.vocab_size, (64,)).tolist()
    t = trace(m.eval(), ids, layers=[0, 6, 11], heads=[0, 1, 2, 3], top_k=20)
    text = t.to_json(digits=6)
    _strict(text)
    assert len(text.encode()) < 50e6


def test_cli_trace_writes_a_strict_trace_file(tmp_path, capsys):
    from glassformer.checkpoint.folders import save_model
    from glassformer.cli import main
    from glassformer.text.tokenizer import Tokenizer

    tok = Tokenizer.train(["the cat saw the hat and the cat sat on the mat"] * 20, 300)
    m = tiny_model(vocab_size=tok.vocab_size)
    save_model(tmp_path / "ckpt", m, tok)
    out = tmp_path / "t.json"
    text = "the cat saw the hat"
    assert main(["trace", "--checkpoint", str(tmp_path / "ckpt"), "--text", text, "--out", str(out),
                 "--with-weights", "--attention", "tiled", "--tile", "2", "--top-k", "5", "--layers", "1"]) == 0
    d = _strict(out.read_text())
    ids = tok.encode(text)
    assert d["ids"] == ids and "".join(d["tokens"]) == text
    assert d["layers"] == [1] and d["top_k"] == 5 and d["config"]["attention"] == "tiled"
    assert "blocks.1.attn.tiles" in d["probes"] and "blocks.1.attn.wq.weight" in d["weights"]
    assert set(d["analysis"]) >= {"norm_rms", "head_summary", "logit_lens", "decode_step", "flash_walkthrough"}
    t = trace(m, ids, layers=[1])
    # The file's numbers came through the tiled kernel, these through the default one: another summation
    # order, a few units in the last place (5.6e-9 on this layer's values of up to 0.016 on an AVX-512 chip).
    torch.testing.assert_close(Trace.from_dict(d)["blocks.1.ffn.act"], t["blocks.1.ffn.act"], rtol=1e-6, atol=1e-7)
    assert glassformer.explain(d, "blocks.1.attn.q", [2, 1, 3]).result == pytest.approx(
        t.value("blocks.1.attn.q", [2, 1, 3]), abs=1e-5)
    assert "wrote" in capsys.readouterr().out


def test_cli_trace_bad_input_is_one_error_line(tmp_path, capsys):
    from glassformer.cli import main

    assert main(["trace", "--checkpoint", str(tmp_path / "missing"), "--text", "x", "--out", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["trace", "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_weights_of_kept_heads_only():
    m = tiny_model()
    t = trace(m, IDS, heads=[3], with_weights=True)
    H = m.config.head_dim
    wq, wk, wo = (t.weights[f"blocks.0.attn.{n}.weight"] for n in ("wq", "wk", "wo"))
    assert wq.index == {"out": list(range(3 * H, 4 * H))} and wk.index == {"out": list(range(H, 2 * H))}
    assert wo.index == {"in": list(range(3 * H, 4 * H))} and wo.data.shape == (H, m.config.dim)
    full = m.blocks[0].attn.wq.weight.detach().t()
    assert t.weight_value("blocks.0.attn.wq.weight", [5, 3 * H + 2]) == float(full[5, 3 * H + 2])
    e = glassformer.explain(t, "blocks.0.attn.q", [4, 3, 2])
    assert e.result == pytest.approx(t.value("blocks.0.attn.q", [4, 3, 2]), abs=1e-6)


def test_cli_trace_of_the_walkthroughs_toy_model_shows_its_figures(tmp_path):
    from pathlib import Path

    from glassformer.cli import main

    fig = json.loads(WORKED_FIGURES.read_text())["head0"]
    out = tmp_path / "w.json"
    assert main(["trace", "--worked", "--out", str(out), "--attention", "tiled", "--tile", "2"]) == 0
    d = _strict(out.read_text())
    assert d["tokens"] == ["I", "like", "cats", "too"] and "blocks.0.attn.wq.weight" in d["weights"]
    p = d["probes"]
    assert p["blocks.0.attn.q"]["data"][2][0] == pytest.approx(fig["query"]["cats"], abs=5e-6)
    assert p["blocks.0.attn.q_rot"]["data"][2][0] == pytest.approx(fig["rotated_query"]["cats"], abs=5e-4)
    assert p["blocks.0.attn.scores"]["data"][2][0] == pytest.approx(fig["scores_row_cats_scaled"], abs=5e-4)
    w = p["blocks.0.attn.weights"]["data"][2][0]
    assert w[:3] == pytest.approx(fig["attention_weights_row_cats"][:3], abs=5e-4) and w[3] is None
    e = glassformer.explain(d, "blocks.0.attn.q", [2, 0, 0])
    assert e.text == "q[cats][0] = Σ_i x[i]·W_Q[i,0] = 1·0 + 1·0 + (−1)·0 + (−1)·(−1) = 1"
    assert main(["trace", "--worked", "--text", "I like birds", "--out", str(out)]) == 2


def test_a_trace_runs_without_dropout_and_leaves_the_mode_alone():
    m = tiny_model(dropout=0.5).train()
    a, b = trace(m, IDS), trace(m, IDS)
    assert torch.equal(a["logits"], b["logits"]) and m.training
    e = glassformer.explain(a, "blocks.0.resid_mid", [3, 7], model=m)
    assert e.result == pytest.approx(a.value("blocks.0.resid_mid", [3, 7]), abs=1e-6)
