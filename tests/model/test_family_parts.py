"""The families' parts (docs/model.md#families): each switch against a direct computation of what it
says, every kernel and the KV cache agreeing with one another. Parity with each family's
transformers model lives in tests/convert/."""

import math

import pytest
import torch
import torch.nn.functional as F

from glassformer.attention import get_kernel
from glassformer.attention.show import show_scores
from glassformer.config import ModelConfig
from glassformer.kv_cache import KVCache
from glassformer.model import FeedForward, RMSNorm, Transformer, rope_inv_freq
from glassformer.moe import MoE, aux_loss, expert_load
from glassformer.norms import OffsetRMSNorm
from glassformer.probes import set_recorder

SWITCHES = {
    "sandwich+geglu+caps": dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True,
                                query_pre_attn_scalar=8.0, attn_softcap=5.0, logit_softcap=10.0, tie_embeddings=True,
                                layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "local-rope+qk-head": dict(norm_offset=True, qk_norm="head", layer_types=["sliding_attention", "full_attention"],
                               sliding_window=4, rope_local_theta=100.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "post-branch+qk-proj": dict(norm_placement="post_branch", qk_norm="proj"),
    "nope": dict(nope_layers=[1]),
    "sinks+moe+yarn": dict(attn_bias=True, attn_sinks=True, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=4, ffn="swiglu_clamp", swiglu_limit=0.5, ffn_bias=True, n_experts=4,
                           n_active_experts=2, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16}),
    "moe-shared-sigmoid": dict(qk_norm="head", n_experts=4, n_active_experts=2, router="sigmoid", router_renorm=False,
                               moe_layers=[1], expert_dim=24, n_shared_experts=1),
}


def _model(switches, attention="sdpa", seed=0):
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                      attention=attention, attention_tile=4, **switches)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norm weights, sinks and biases off their starting values, so each one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernels_and_the_cache_agree(name):
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = None
    for attention in ("sdpa", "naive", "tiled"):
        model = _model(SWITCHES[name], attention)
        with torch.no_grad():
            full, _ = model(ids)
            cache = KVCache.for_model(model, 2)
            steps = [model(ids[:, :5], cache=cache, pos=0)[0]]
            steps += [model(ids[:, t:t + 1], cache=cache, pos=t)[0] for t in range(5, 12)]
        assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
        ref = full if ref is None else ref
        assert (full - ref).abs().max() < 1e-5, attention
    loss = model(ids, targets=ids)[1]
    loss.backward()  # every switch trains
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" not in n)


def _attend(q, k, v, window, scale, softcap, sinks):
    """One query at a time, by the formulas: scores, cap, mask, softmax with the sink in the denominator."""
    B, N, T, H = q.shape
    G = N // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for n in range(N):
            for t in range(T):
                keys = [j for j in range(T) if j <= t and (window is None or t - j < window)]
                s = torch.stack([q[b, n, t] @ k[b, n // G, j] * scale for j in keys])
                s = softcap * torch.tanh(s / softcap)
                e = torch.exp(s)
                denom = e.sum() + torch.exp(sinks[n])
                out[b, n, t] = sum(e[i] / denom * v[b, n // G, j] for i, j in enumerate(keys))
    return out


def test_soft_cap_and_sinks_follow_their_formulas_in_every_kernel():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    want = _attend(q, k, v, 3, 0.3, 2.0, sinks)
    pos = torch.arange(7)[None]
    for name in ("naive", "tiled", "sdpa"):
        got = get_kernel(name, 2)(q, k, v, q_pos=pos, window=3, scale=0.3, softcap=2.0, sinks=sinks)
        assert (got - want).abs().max() < 1e-5, name


def test_the_sink_weight_and_the_keys_weights_sum_to_one():
    seen = {}

    class Rec:
        def __call__(self, name, x):
            seen[name] = x
            return x

        def wants(self, name):
            return True

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
    old = set_recorder(Rec())
    try:
        show_scores("a", q, k, torch.arange(5)[None], sinks=torch.tensor([0.0, 1.0, -1.0, 3.0]))
    finally:
        set_recorder(old)
    total = seen["a.weights"].sum(-1) + seen["a.sink_weight"]  # (B, T, N)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-6)
    assert (seen["a.sink_weight"][0, :, 3] > seen["a.sink_weight"][0, :, 2]).all()  # a larger sink logit takes more


def test_offset_norm_is_rmsnorm_with_one_plus_w():
    x = torch.randn(3, 16)
    a, b = OffsetRMSNorm(16, 1e-6), RMSNorm(16, 1e-6)
    with torch.no_grad():
        a.weight.normal_()
        b.weight.copy_(1 + a.weight)
    assert torch.allclose(a(x), b(x), atol=1e-6)


def test_the_block_wirings_are_their_formulas():
    for placement in ("sandwich", "post_branch"):
        model = _model(dict(norm_placement=placement))
        blk, x = model.blocks[0], torch.randn(1, 6, 32)
        rope = model.rope(torch.arange(6)[None])
        attn = lambda h: blk.attn(h, rope, torch.arange(6)[None], start=0)  # noqa: E731
        if placement == "sandwich":
            h = x + blk.attn_post_norm(attn(blk.attn_norm(x)))
            want = h + blk.ffn_post_norm(blk.ffn(blk.ffn_norm(h)))
        else:
            h = x + blk.attn_norm(attn(x))
            want = h + blk.ffn_norm(blk.ffn(h))
        got = blk(x, rope, torch.arange(6)[None], start=0)
        assert torch.allclose(got, want, atol=1e-6), placement


def test_qk_norm_proj_normalises_the_whole_projection():
    model = _model(dict(qk_norm="proj"))
    attn, x = model.blocks[0].attn, torch.randn(1, 3, 32)
    q = attn.wq(x)  # (1, 3, N·H)
    want = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.q_norm.weight
    got = attn.qk_normed(attn.q_norm, q.view(1, 3, 4, 8))
    assert torch.allclose(got.flatten(-2), want, atol=1e-6)
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)


def test_layer_kinds_pick_windows_and_rope_tables():
    cfg = ModelConfig(n_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      sliding_window=8, rope_local_theta=10.0, nope_layers=[2])
    assert [cfg.window_at(i) for i in range(3)] == [8, None, 8]
    assert [cfg.rope_kind(i) for i in range(3)] == ["local", "global", None]
    model = Transformer(cfg)
    assert [b.attn.window for b in model.blocks] == [8, None, 8]
    assert torch.allclose(model.rope_local_inv_freq, 1.0 / 10.0 ** (torch.arange(0, 16, 2).float() / 16))


def test_nope_layers_turn_nothing():
    ids = torch.randint(0, 50, (1, 6))
    a, b = _model(dict(nope_layers=[1])), _model(dict(nope_layers=[1], rope_theta=77.0))
    with torch.no_grad():
        assert not torch.allclose(a(ids)[0], b(ids)[0], atol=1e-4)  # layer 0 turns by theta
        a2, b2 = _model(dict(nope_layers=[0, 1])), _model(dict(nope_layers=[0, 1], rope_theta=77.0))
        assert torch.equal(a2(ids)[0], b2(ids)[0])  # no layer turns: theta changes nothing


def test_yarn_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    sc = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
          "original_max_position_embeddings": 4096, "truncate": False}
    hf = transformers.GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=64, rope_theta=150000.0,
                                   rope_parameters={**sc, "rope_theta": 150000.0}, max_position_embeddings=131072)
    inv, factor = rope_utils._compute_yarn_parameters(hf, "cpu")
    cfg = ModelConfig(dim=256, n_heads=4, head_dim=64, rope_theta=150000.0, rope_scaling=sc, max_seq_len=131072)
    assert torch.equal(rope_inv_freq(cfg), inv.float())
    from glassformer.rope_scaling import attention_factor
    assert attention_factor(sc) == pytest.approx(factor, rel=1e-12) and factor == pytest.approx(0.1 * math.log(32) + 1)


def _moe(**kw):
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_experts=4, n_active_experts=2, expert_dim=8, **kw)
    torch.manual_seed(0)
    moe = MoE(cfg, FeedForward)
    for i, e in enumerate(moe.experts):
        e.name = f"ffn.experts.{i}"
    return moe


@pytest.mark.parametrize("kw", [dict(), dict(router_renorm=False), dict(router="sigmoid"), dict(n_shared_experts=2)])
def test_mixture_is_the_weighted_sum_of_its_chosen_experts(kw):
    moe = _moe(**kw)
    x = torch.randn(2, 5, 16)
    got = moe(x)
    logits = x @ moe.router.weight.T
    probs = logits.softmax(-1) if moe.cfg.router == "softmax" else logits.sigmoid()
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(5):
            w, ids = probs[b, t].topk(2)
            if moe.cfg.router_renorm:
                w = w / w.sum()
            want[b, t] = sum(w[j] * moe.experts[int(ids[j])](x[b, t][None, None])[0, 0] for j in range(2))
            if moe.shared is not None:
                want[b, t] += moe.shared(x[b, t][None, None])[0, 0]
    assert torch.allclose(got, want, atol=1e-6)
    if moe.shared is not None:
        assert moe.shared.w_up.weight.shape == (16, 16)  # two experts' widths


def test_one_expert_of_one_is_a_dense_feed_forward():
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, n_experts=1, n_active_experts=1)
    moe, x = MoE(cfg, FeedForward), torch.randn(1, 4, 16)
    assert torch.allclose(moe(x), moe.experts[0](x), atol=1e-6)


def test_load_balancing_loss_is_k_when_even_and_grows_when_not():
    moe = _moe()
    with torch.no_grad():
        moe.router.weight.zero_()  # every expert equally likely: P_e = 1/E; topk picks ties in order
    moe(torch.randn(1, 8, 16))
    # f: the same two experts (of the tie) take every token (E·Σ f·P = 4·(1·¼ + 1·¼) = 2 = k)
    assert float(moe.aux_loss) == pytest.approx(2.0)
    assert sorted(moe.load.tolist()) == [0.0, 0.0, 0.5, 0.5]
    model = _model(dict(n_experts=4, n_active_experts=2))
    model(torch.randint(0, 50, (1, 9)))
    assert aux_loss(model) is not None and len(expert_load(model)) == 2
    assert all(abs(sum(layer) - 1) < 1e-6 for layer in expert_load(model))
    with torch.no_grad():
        skewed = _moe()
        skewed.router.weight.zero_()
        skewed.router.weight[0] += 1.0  # expert 0 wins for every token with positive sum
        x = torch.ones(1, 8, 16)
        skewed(x)
    assert float(skewed.aux_loss) > 2.0


def test_swiglu_clamp_is_gpt_oss_formula():
    cfg = ModelConfig(dim=8, n_layers=1, n_heads=2, ffn="swiglu_clamp", swiglu_limit=1.0, ffn_dim=16)
    ff, x = FeedForward(cfg), torch.randn(1, 3, 8) * 4
    g, u = ff.w_gate(x).clamp(max=1.0), ff.w_up(x).clamp(-1.0, 1.0)
    want = ff.w_down((u + 1) * g * torch.sigmoid(1.702 * g))
    assert torch.allclose(ff(x), want, atol=1e-6)
    geglu = FeedForward(ModelConfig(dim=8, n_layers=1, n_heads=2, ffn="geglu", ffn_dim=16))
    assert torch.allclose(geglu(x), geglu.w_down(F.gelu(geglu.w_gate(x), approximate="tanh") * geglu.w_up(x)), atol=1e-6)


@pytest.mark.parametrize("bad, words", [
    (dict(qk_norm="heads"), "qk_norm must be"),
    (dict(layer_types=["full_attention"]), "layer_types must list 2"),
    (dict(n_experts=4, n_active_experts=0), "n_active_experts must be in 1..n_experts"),
    (dict(n_experts=100000, n_active_experts=1), "more than 4096"),
    (dict(n_shared_experts=1), "need n_experts > 0"),
    (dict(nope_layers=[2]), "nope_layers must list layer indices in 0..1"),
    (dict(router="top1"), "router must be one of"),
    (dict(norm="layer", norm_offset=True), "norm='rms' only"),
    (dict(attn_softcap=0.0), "attn_softcap must be None or a positive number"),
])
def test_bad_family_switches_are_refused_by_name(bad, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("..", r"\.\.")):
        ModelConfig(n_layers=2, **bad)
