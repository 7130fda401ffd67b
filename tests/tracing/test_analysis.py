"""Analyses: FlashAttention walk-through, decode step, head summary, stream RMS pre vs post norm."""

import json
import math

import pytest
import torch

from glassformer.tracing.analysis import analysis_for, decode_step, flash_walkthrough, head_summary, norm_placement, norm_rms
from glassformer.errors import UserError
from glassformer.tracing.trace import trace

from ..support import reinit, tiny_model

IDS = [5, 17, 3, 99, 17, 250, 8, 41, 7, 300]


@pytest.mark.parametrize("query", [9, 4, 0])
def test_flash_walkthrough_ends_at_the_kernels_output(query):
    m = reinit(tiny_model(), std=0.3)
    naive = trace(m, IDS, attention="naive")
    tiled = trace(m, IDS, attention="tiled", tile=3, query=query)
    for layer in (0, 1):
        for head in range(m.config.n_heads):
            w = flash_walkthrough(tiled, layer, head)
            out = torch.tensor(w["output"])
            assert torch.allclose(out, tiled["blocks.%d.attn.z" % layer][query, head], atol=1e-6)
            assert torch.allclose(out, naive["blocks.%d.attn.z" % layer][query, head], atol=1e-5)
            # Tiles wholly in the query's future are skipped; the rest follow the online softmax.
            assert [s["skipped"] for s in w["steps"]] == [k0 > query for k0 in range(0, len(IDS), 3)]
            scores = naive[f"blocks.{layer}.attn.scores"][query, head].double()  # (T,)
            m_run, l_run = -math.inf, 0.0
            for s in w["steps"]:
                if s["skipped"]:
                    continue
                k0, k1 = s["k"]
                seen = scores[k0:min(k1, query + 1)]
                m_new = max(m_run, float(seen.max()))
                assert s["m"] == pytest.approx(m_new, abs=1e-6)
                assert s["alpha"] == pytest.approx(math.exp(m_run - m_new) if m_run > -math.inf else 0.0, abs=1e-6)
                l_run = l_run * math.exp(m_run - m_new) + float((seen - m_new).exp().sum()) if m_run > -math.inf \
                    else float((seen - m_new).exp().sum())
                m_run = m_new
                assert s["l"] == pytest.approx(l_run, rel=1e-5)
    json.dumps(flash_walkthrough(tiled, 1, 3), allow_nan=False)
    with pytest.raises(UserError):
        flash_walkthrough(naive, 0, 0)


def test_decode_step_shows_the_cache_and_the_new_row_of_scores():
    m = reinit(tiny_model(), std=0.3)
    d = decode_step(m, IDS)
    json.dumps(d, allow_nan=False)
    full = trace(m, IDS + [d["new_id"]], attention="naive")
    assert d["new_id"] == int(trace(m, IDS)["logits"][-1].argmax())
    T = len(IDS)
    for entry in d["layers"]:
        i = entry["layer"]
        k = torch.tensor(entry["k"])  # (K, T+1, H)
        assert k.shape == (m.config.n_kv_heads, T + 1, m.config.head_dim)
        assert torch.allclose(k, full[f"blocks.{i}.attn.k_rot"].transpose(0, 1), atol=1e-5)
        assert torch.allclose(torch.tensor(entry["v"]), full[f"blocks.{i}.attn.v"].transpose(0, 1), atol=1e-5)
        assert torch.allclose(torch.tensor(entry["scores"]), full[f"blocks.{i}.attn.scores"][T], atol=1e-5)
        assert torch.allclose(torch.tensor(entry["weights"]), full[f"blocks.{i}.attn.weights"][T], atol=1e-5)
    assert d["cache_numbers"] == 2 * 2 * m.config.n_kv_heads * m.config.head_dim * (T + 1)


def test_head_summary_shares_of_previous_first_and_self():
    m = reinit(tiny_model(), std=0.5)
    t = trace(m, IDS)
    s = head_summary(t)
    w = t["blocks.1.attn.weights"].nan_to_num()  # (T, N, T)
    h = 2
    prev = sum(float(w[i, h, i - 1]) for i in range(1, len(IDS))) / (len(IDS) - 1)
    first = sum(float(w[i, h, 0]) for i in range(1, len(IDS))) / (len(IDS) - 1)
    self_ = sum(float(w[i, h, i]) for i in range(1, len(IDS))) / (len(IDS) - 1)
    assert s["previous"][1][h] == pytest.approx(prev)
    assert s["first"][1][h] == pytest.approx(first)
    assert s["self"][1][h] == pytest.approx(self_)


def test_head_summary_finds_a_previous_token_head():
    # Known patterns written into a trace: head 0 reads the previous token, head 1 the first,
    # head 2 itself, head 3 spreads evenly.
    m = tiny_model(attention="naive")
    t = trace(m, IDS)
    T = len(IDS)
    w = torch.full((T, m.config.n_heads, T), float("nan"))
    for i in range(T):
        w[i, :, : i + 1] = 0.0
        w[i, 0, max(i - 1, 0)] = 1.0
        w[i, 1, 0] = 1.0
        w[i, 2, i] = 1.0
        w[i, 3, : i + 1] = 1.0 / (i + 1)
    t.probes["blocks.0.attn.weights"].data = w
    s = head_summary(t)
    assert s["previous"][0][:3] == [1.0, pytest.approx(1 / (T - 1)), 0.0]
    assert s["first"][0][1] == 1.0 and s["self"][0][2] == 1.0


def test_norm_rms_and_placement_side_by_side():
    m = tiny_model()
    with torch.no_grad():  # γ = 1, as initialised
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    t = trace(m, IDS)
    r = norm_rms(t)
    assert r["points"][:3] == ["embed", "blocks.0.resid_mid", "blocks.0.resid_out"]
    x = t["blocks.1.resid_out"].double()
    assert r["rms"][-1] == pytest.approx(x.pow(2).mean(-1).sqrt().tolist())
    both = norm_placement(m, IDS)
    assert torch.allclose(torch.tensor(both["pre"]["rms"]), torch.tensor(r["rms"]))
    # Post-norm with γ = 1: the stream is renormalised after every addition, so its RMS is 1.
    assert torch.allclose(torch.tensor(both["post"]["rms"][1:]), torch.ones(4, len(IDS)), atol=1e-3)
    # Pre-norm: the stream itself is never normalised; its RMS moves away from 1.
    assert not torch.allclose(torch.tensor(both["pre"]["rms"][1:]), torch.ones(4, len(IDS)), atol=1e-2)
    assert both["post"]["before_norm"]["points"][0] == "blocks.0.resid_mid"


def test_analysis_for_a_trace_file_is_strict_json():
    m = tiny_model()
    t = trace(m, IDS[:5], attention="tiled", tile=2, heads=[1])
    t.analysis = analysis_for(m, t)
    d = json.loads(t.to_json(), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert set(d["analysis"]) == {"norm_rms", "head_summary", "logit_lens", "flash_walkthrough", "decode_step"}
    assert len(d["analysis"]["logit_lens"]["ids"]) == m.config.n_layers
    assert d["analysis"]["flash_walkthrough"][0]["head"] == 1
