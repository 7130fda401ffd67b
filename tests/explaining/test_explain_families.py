"""explain on the families' switches (issue 45): every probe of a tiny model of each family's switches,
recomputed from the returned operands, equals the trace; the new step kinds (argmax, clamp, sigmoid)
recompute by the documented rules (docs/trace-format.md#explain-results)."""

import json
import math
import random

import pytest
import torch

from glassformer import explain
from glassformer.tracing.trace import trace

from ..support import reinit, tiny_model
from .test_explain import check

IDS = [7, 300, 42, 7, 511, 12, 99]

FAMILIES = {
    # Gemma 2: (1 + w) norms before and after each sublayer, GeGLU, √D on the embedding, its own
    # query scale, soft-capped scores and logits, sliding and full layers alternating
    "gemma2": dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True, query_pre_attn_scalar=24.0,
                   attn_softcap=2.0, logit_softcap=3.0, layer_types=["sliding_attention", "full_attention"],
                   sliding_window=3),
    # Gemma 3: per-head QK norms with (1 + w) gains, a RoPE base of its own on the sliding layers
    "gemma3": dict(norm_offset=True, norm_placement="sandwich", ffn="geglu", embed_scale=True, qk_norm="head",
                   query_pre_attn_scalar=16.0, layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                   rope_local_theta=100.0),
    "qwen3": dict(qk_norm="head"),
    "olmo2": dict(norm_placement="post_branch", qk_norm="proj"),
    "smollm3": dict(nope_layers=[1]),
    "qwen3_moe": dict(qk_norm="head", n_experts=4, n_active_experts=2, expert_dim=32, moe_layers=[1]),
    "olmoe": dict(qk_norm="proj", n_experts=4, n_active_experts=2, router_renorm=False, expert_dim=32),
    "shared_sigmoid": dict(n_experts=4, n_active_experts=2, n_shared_experts=2, router="sigmoid", expert_dim=16),
    # gpt-oss: sinks, biases everywhere, the clamped SwiGLU (a small limit, so the clamps act), YaRN
    "gpt_oss": dict(attn_sinks=True, attn_bias=True, ffn="swiglu_clamp", swiglu_limit=0.3, ffn_bias=True,
                    n_experts=4, n_active_experts=2, expert_dim=32, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=3, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0, "original_max_position_embeddings": 32}),
}


def family_model(name):
    m = tiny_model(**FAMILIES[name])
    return reinit(m, std=0.3, seed=1)  # large weights (and norm gains off identity): no difference hides


@pytest.mark.parametrize("name", list(FAMILIES))
def test_explain_recomputes_every_probe_of_each_family(name):
    m = family_model(name)
    tr = trace(m, IDS, with_weights=True)
    rng = random.Random(name)
    for probe, p in tr.probes.items():
        for _ in range(2):
            idx = [rng.randrange(n) for n in p.data.shape]
            if "token" in p.index:  # an expert's probe: its rows are the tokens routed to it
                idx[0] = p.index["token"][idx[0]]
            check(explain(tr, probe, idx), tr, m)


def test_the_new_probes_are_traced_and_explained():
    """Each family's own probes exist and each explains into the steps its switch adds."""
    tr = trace(family_model("gpt_oss"), IDS, with_weights=True)
    for leaf in ("attn.sink_weight", "ffn.router_logits", "ffn.router_probs", "ffn.expert_ids", "ffn.expert_weights",
                 "ffn.expert_out"):
        assert f"blocks.0.{leaf}" in tr.probes, leaf
    w = tr["blocks.0.attn.weights"].nan_to_num().sum(-1) + tr["blocks.0.attn.sink_weight"]
    assert torch.allclose(w, torch.ones_like(w), atol=1e-5)  # the keys' weights sum to 1 − the sink's
    e = explain(tr, "blocks.0.attn.sink_weight", [4, 1])
    assert "sink" in e.steps[-1]["target"]["label"] and e.steps[-1]["target"]["name"] == "blocks.0.attn.sinks"
    e = explain(tr, "blocks.1.ffn.expert_ids", [3, 1])
    assert e.steps[-1]["op"] == "argmax" and len(e.steps[-1]["over"]) == 3  # the slot-0 expert is not offered again
    e = explain(tr, "blocks.1.ffn.act", [2, 5]) if "blocks.1.ffn.act" in tr.probes else None
    assert e is None  # a mixture layer's activations are its experts' own
    expert = next(n for n in tr.probes if n.startswith("blocks.1.ffn.experts.") and n.endswith(".act"))
    t = tr.probe(expert).index["token"][0]
    e = explain(tr, expert, [t, 3])
    assert any(s.get("post") == "clamp" for s in e.steps) and any(s.get("post") == "sigmoid" for s in e.steps)
    g = family_model("gemma2")
    tg = trace(g, IDS, with_weights=True)
    e = explain(tg, "blocks.0.attn_post_norm", [2, 5])
    assert any(s["label"] == "1 + w[5]" for s in e.steps)  # Gemma's gain is 1 + w, w the stored weight
    e = explain(tg, "blocks.1.attn.scores", [5, 0, 2])
    assert [s["post"] for s in e.steps][-2:] == ["tanh", None] and "1/√s_q" in e.steps[1]["formula"]
    e = explain(tg, "blocks.0.attn.weights", [5, 0, 1])  # a sliding layer of window 3: key 1 is out of reach
    assert e.value is None and "sliding window of 3" in e.text
    assert not math.isnan(tg.value("blocks.1.attn.weights", [5, 0, 1]))  # the full layer reads it


def test_an_experts_probe_names_its_tokens_and_survives_the_file(tmp_path):
    """An expert fires on its own tokens: its probe's rows are those tokens (index.token), and a trace
    file keeps them so, so explain reads the same numbers back."""
    m = family_model("olmoe")
    tr = trace(m, IDS, with_weights=True)
    ids = tr["blocks.0.ffn.expert_ids"]  # (T, k)
    for e in range(4):
        name = f"blocks.0.ffn.experts.{e}.down"
        routed = [t for t in range(len(IDS)) if e in ids[t].tolist()]
        if not routed:
            assert name not in tr.probes
            continue
        assert tr.probe(name).index["token"] == routed and tr[name].shape[0] == len(routed)
        for j in range(2):  # the mixture's slot output is the chosen expert's down, token by token
            for t in routed:
                if int(ids[t, j]) == e:
                    assert torch.equal(tr["blocks.0.ffn.expert_out"][t, j], tr[name][routed.index(t)])
    path = tmp_path / "t.json"
    tr.to_json(path)
    back = json.loads(path.read_text())
    t = tr.probe("blocks.0.ffn.experts.0.up").index["token"][-1] if "blocks.0.ffn.experts.0.up" in tr.probes else None
    if t is not None:
        a = explain(tr, "blocks.0.ffn.experts.0.up", [t, 3])
        b = explain(back, "blocks.0.ffn.experts.0.up", [t, 3])
        assert a.result == pytest.approx(b.result, rel=1e-6)
    a = explain(back, "blocks.0.ffn.down", [5, 7])
    assert a.result == pytest.approx(tr.value("blocks.0.ffn.down", [5, 7]), rel=1e-5, abs=1e-5)
