"""ffn='none': attention-only blocks, against a direct computation, and every path that reads a block
(trace, explain, the stream wiring, the KV cache, cost, export) with such a model."""

import math
import random

import pytest
import torch

from glassformer import ModelConfig, Transformer, explain
from glassformer.cost import activations, forward_flops, weights
from glassformer.cost.flops import crossover_seq
from glassformer.errors import UserError
from glassformer.probes import final_norm_reads, stream_points, stream_wiring
from glassformer.tracing.analysis import norm_rms
from glassformer.tracing.interventions import logit_lens
from glassformer.tracing.trace import trace

from ..cost.test_cost import counted_flops, real_parts, saved_for_backward
from ..explaining.test_explain import check
from ..support import greedy_by_full_forward, greedy_cached, reinit
from ..viewer.test_viewer_browser import browser  # noqa: F401  (the Chromium fixture)

IDS = [7, 300, 42, 7, 511, 12, 99, 3]
PLACEMENTS = ["pre", "post"]


def none_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("tiny", ffn="none", **overrides)
    return reinit(Transformer(cfg), std=0.2, seed=1).eval()


# ----------------------------------------------------------------------------- a direct computation


def _rms(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def _rope_half(x, theta):
    """x (T, heads, H) turned pair (i, i + H/2) by position·theta^(-2i/H), written out from the RoPE paper."""
    T, _, H = x.shape
    freq = theta ** (-torch.arange(0, H, 2, dtype=torch.float64) / H)  # (H/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * freq  # (T, H/2)
    c, s = ang.cos()[:, None], ang.sin()[:, None]  # (T, 1, H/2)
    a, b = x[..., : H // 2], x[..., H // 2:]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def _attention(x, attn, cfg):
    """Causal softmax attention of one sequence x (T, D), in float64, GQA by repeating K and V."""
    T = x.shape[0]
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = (x @ attn.wq.weight.double().T).view(T, N, H)
    k = (x @ attn.wk.weight.double().T).view(T, K, H).repeat_interleave(N // K, dim=1)  # (T, N, H)
    v = (x @ attn.wv.weight.double().T).view(T, K, H).repeat_interleave(N // K, dim=1)
    if cfg.pos == "rope":
        q, k = _rope_half(q, cfg.rope_theta), _rope_half(k, cfg.rope_theta)
    scores = torch.einsum("tnh,snh->nts", q, k) / math.sqrt(H)  # (N, T, T)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    z = torch.einsum("nts,snh->tnh", scores.softmax(-1), v).reshape(T, N * H)
    return z @ attn.wo.weight.double().T


def direct_logits(model, ids):
    """Embedding, then per block only x + attention (pre-norm) or norm(x + attention) (post-norm)."""
    cfg, eps = model.config, model.config.norm_eps
    x = model.embed.weight.double()[ids]  # (T, D)
    for b in model.blocks:
        if cfg.norm_placement == "pre":
            x = x + _attention(_rms(x, b.attn_norm.weight.double(), eps), b.attn, cfg)
        else:
            x = _rms(x + _attention(x, b.attn, cfg), b.attn_norm.weight.double(), eps)
    x = _rms(x, model.final_norm.weight.double(), eps)
    return x @ model.lm_head.weight.double().T  # (T, V)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_forward_equals_a_direct_computation(placement):
    m = none_model(norm_placement=placement)
    assert m.blocks[0].ffn is None and m.blocks[0].ffn_norm is None
    assert not [k for k in m.state_dict() if "ffn" in k]
    logits, _ = m(torch.tensor([IDS]))
    assert torch.allclose(logits[0].double(), direct_logits(m, IDS), atol=1e-4, rtol=1e-4)


def test_config_round_trip_and_ffn_dim_is_irrelevant():
    cfg = ModelConfig.from_preset("tiny", ffn="none")
    assert cfg.ffn_dim == 0 and not cfg.has_ffn and ModelConfig(ffn_dim=999, ffn="none").ffn_dim == 0
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_preset("tiny").has_ffn


def test_kv_cache_decode_equals_full_forward():
    m = none_model(n_layers=2)
    prompt = torch.tensor([IDS[:5]])
    assert greedy_cached(m, prompt, 6) == greedy_by_full_forward(m, IDS[:5], 6)


def test_kv_heads_pool_an_attention_only_model():
    """convert --kv-heads on ffn='none': K and V pooled as for any model (a pooled head's mean),
    the blocks still attention only."""
    from glassformer.convert.heads import convert_kv_heads, pool_heads

    m = none_model(n_layers=2)
    cfg = m.config
    new = convert_kv_heads(m, 1)
    assert new.config.n_kv_heads == 1 and all(b.ffn is None and b.cfg is new.config for b in new.blocks)
    want = pool_heads(m.blocks[0].attn.wk.weight, cfg.n_kv_heads, 1, cfg.head_dim)
    assert torch.equal(new.blocks[0].attn.wk.weight, want)
    with torch.no_grad():
        assert torch.isfinite(new(torch.tensor([IDS[:5]]))[0]).all()


# ----------------------------------------------------------------------------- probes, trace, explain


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_trace_holds_the_probes_that_exist_and_the_wiring_names_them(placement):
    m = none_model(norm_placement=placement)
    tr = trace(m, IDS)
    assert not [p for p in tr.probes if "ffn" in p or "resid_out" in p]
    L = m.config.n_layers
    points = stream_points(L, placement, "none")
    assert len(points) == 1 + L and all(p in tr.probes for p in points)
    for w in stream_wiring(L, placement, "none"):
        assert w["out"] == w["mid"] and "ffn_reads" not in w and all(v in tr.probes for v in w.values())
    assert torch.allclose(tr[final_norm_reads(L, placement, "none")], _final_norm_input(m, IDS), atol=1e-6)
    lens = logit_lens(m, torch.tensor([IDS]))  # the stream leaving each block: the last is the model's logits
    assert torch.allclose(lens[-1], m(torch.tensor([IDS]))[0][0], atol=1e-5)
    r = norm_rms(tr)
    assert len(r["labels"]) == len(r["points"]) == 1 + L


def _final_norm_input(model, ids):
    seen = {}
    h = model.final_norm.register_forward_hook(lambda mod, args, out: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(torch.tensor([ids]))
    h.remove()
    return seen["x"][0]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_explain_recomputes_every_probe_kind(placement):
    m = none_model(norm_placement=placement)
    tr = trace(m, IDS, with_weights=True)
    rng = random.Random(placement)
    for probe, p in tr.probes.items():
        idx = [rng.randrange(n) for n in p.data.shape]
        check(explain(tr, probe, idx), tr, m)


# ----------------------------------------------------------------------------- cost and export


@pytest.mark.parametrize("cfg", [
    ModelConfig.from_preset("tiny", ffn="none"),
    ModelConfig(vocab_size=40, dim=12, n_layers=3, n_heads=3, head_dim=4, ffn="none", bias=True,
                norm="layer", norm_placement="post", pos="learned", max_seq_len=16, dropout=0.1),
])
def test_cost_counts_no_feed_forward(cfg):
    w = weights(cfg)
    model = Transformer(cfg)
    assert w["ffn"] == w["ffn_bias"] == 0 and w["total"] == model.num_params()
    assert {k: v for k, v in w.items() if v and k not in ("total", "non_embedding")} == real_parts(model)
    naive = Transformer(cfg.replace(attention="naive"))
    f = forward_flops(cfg, 2, 9)
    assert f["ffn"] == 0 and f["total"] == counted_flops(naive, 2, 9)
    elements, _ = saved_for_backward(naive.train(), 2, 9)
    assert activations(cfg, 2, 9, "naive")["total"] == pytest.approx(elements, rel=0.05)
    assert crossover_seq(cfg) is None


def test_export_refuses_it_by_name():
    from glassformer.convert.families import family_for
    from glassformer.convert.gguf import gguf_arch

    cfg = ModelConfig.from_preset("tiny", ffn="none")
    for refuse in (family_for, gguf_arch):
        with pytest.raises(UserError, match="ffn='none'"):
            refuse(cfg)


@pytest.mark.browser
def test_the_explorer_draws_one_addition_a_block(browser, tmp_path):
    from glassformer.viewer import render

    from ..support import fixture_trace
    from ..viewer.test_viewer_browser import open_page

    m = none_model()
    out = render.write_html(tmp_path / "page.html", fixture_trace(m, IDS[:4], list("abcd")), sentence="a b c d")
    page = open_page(browser, out.as_uri())
    cols = page.locator("#lanes .col-label").all_text_contents()
    assert cols == ["embed", "L0 attention", "+", "L1 attention", "+", "final norm"]
    shown = page.locator('#lanes .rms[data-probe="blocks.1.resid_mid"]').first
    shown.click()
    assert "RMS of blocks.1.resid_mid" in page.locator("#explain-body").text_content()
    assert page.events["errors"] == []
    page.close()
