"""explain: every probe of every variant, recomputed from the returned operands, equals the trace."""

import json
import math
import random

import pytest
import torch

from glassformer import ModelConfig, Transformer, explain
from glassformer.errors import UserError
from glassformer.tracing.trace import trace, weight_matrix

from ..support import reinit, tiny_model

IDS = [7, 300, 42, 7, 511, 12, 99]

VARIANTS = {
    "pre-swiglu-rope-half": {},
    "post-relu-learned": dict(norm_placement="post", ffn="relu", pos="learned"),
    "pre-gelu-rope-interleaved-mha": dict(ffn="gelu", rope_pairs="interleaved", n_kv_heads=4),
    "post-gelu_tanh-none-layernorm-bias-mqa": dict(norm_placement="post", ffn="gelu_tanh", pos="none", norm="layer",
                                                   bias=True, n_kv_heads=1),
    "pre-relu-rope-tied-window": dict(ffn="relu", tie_embeddings=True, sliding_window=3, qkv_bias=True),
}


# ----------------------------------------------------------------------------- an independent recomputation


def _post(kind, x, step=None):
    if kind is None:
        return x
    if kind == "clamp":  # the bounds are the step's own (gpt-oss's SwiGLU: docs/trace-format.md)
        lo, hi = step["bounds"]
        return float(torch.tensor(x, dtype=torch.float64).clamp(min=lo, max=hi))
    fns = {"sqrt": torch.sqrt, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
           "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh"), "relu2": lambda v: torch.relu(v) ** 2}
    if kind not in fns:
        raise AssertionError(kind)
    return float(fns[kind](torch.tensor(x, dtype=torch.float64)))


def recompute(step):
    """The rule table of docs/trace-format.md, written again from the documentation."""
    rest = (step.get("rest") or {}).get("value", 0.0)
    if step["op"] == "sum":
        total = 0.0
        for term in step["terms"]:
            prod = 1.0
            for o in term:
                prod *= o["value"] ** o.get("power", 1)
            total += prod
        return _post(step["post"], total + rest, step)
    if step["op"] == "max":
        return max([o["value"] for o in step["over"]] + ([step["rest"]["value"]] if step.get("rest") else []))
    if step["op"] == "softmax":
        m = step["max"]
        return math.exp(step["target"]["value"] - m) / (sum(math.exp(o["value"] - m) for o in step["over"]) + rest)
    if step["op"] == "argmax":  # a router's pick: the id of the largest operand
        values = [o["value"] for o in step["over"]]
        return float(step["ids"][max(range(len(values)), key=values.__getitem__)])
    assert step["op"] == "masked"
    return None


def check(e, tr, model):
    """Operands are what they claim to be, and recomputing them gives the traced value."""
    d = e.to_dict()
    json.dumps(d, allow_nan=False)
    values = []
    for k, step in enumerate(d["steps"]):
        ops = [o for t in step.get("terms", []) for o in t] + step.get("over", [])
        ops += [step["target"]] if "target" in step else []
        for o in ops:
            if o["source"] == "probe":
                assert o["value"] == tr.value(o["name"], o["index"]), o
            elif o["source"] == "weight":
                assert o["value"] == float(weight_matrix(model, o["name"])[tuple(o["index"])]), o
            elif o["source"] == "step":
                assert o["index"][0] < k and o["value"] == values[o["index"][0]]
        v = recompute(step)
        if v is not None:
            assert v == pytest.approx(step["value"], rel=1e-9, abs=1e-12)
        values.append(step["value"])
        assert step["text"].startswith(step["label"] + " = ")
    traced = tr.value(e.probe, e.index)
    if math.isnan(traced):
        assert d["steps"][-1]["op"] == "masked" and d["result"] is None and d["value"] is None
    else:
        assert d["result"] == pytest.approx(traced, rel=1e-5, abs=1e-5), (e.probe, e.index, e.text)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_explain_recomputes_random_probes_of_random_models(name):
    m = tiny_model(**VARIANTS[name])
    reinit(m, std=0.3, seed=1)  # large weights: differences cannot hide under the tolerance
    tr = trace(m, IDS, with_weights=True)
    rng = random.Random(name)
    for probe, p in tr.probes.items():
        for _ in range(2):
            idx = [rng.randrange(n) for n in p.data.shape]
            check(explain(tr, probe, idx), tr, m)


def test_explain_reads_weights_from_the_model_and_from_a_parsed_file():
    m = tiny_model()
    bare = trace(m, IDS)
    with pytest.raises(UserError, match="with-weights"):
        explain(bare, "blocks.0.attn.q", [1, 0, 0])
    a = explain(bare, "blocks.1.ffn.down", [3, 5], model=m)
    b = explain(json.loads(trace(m, IDS, with_weights=True).to_json()), "blocks.1.ffn.down", [3, 5])
    assert a.result == pytest.approx(b.result, rel=1e-6) and a.label == b.label
    check(a, bare, m)


def test_wide_sums_show_the_largest_terms_and_sum_the_rest():
    m = reinit(tiny_model(), std=0.3)
    tr = trace(m, IDS, with_weights=True)
    e = explain(tr, "blocks.0.ffn.down", [2, 9], max_terms=5)
    step = e.steps[-1]
    F = m.config.ffn_dim
    assert len(step["terms"]) == 5 and step["rest"]["count"] == F - 5
    shown = [abs(t[0]["value"] * t[1]["value"]) for t in step["terms"]]
    act = tr["blocks.0.ffn.act"][2].double()
    w = m.blocks[0].ffn.w_down.weight[9].detach().double()
    prods = (act * w).abs().sort(descending=True).values
    assert sorted(shown, reverse=True) == pytest.approx(prods[:5].tolist())
    assert step["rest"]["value"] == pytest.approx(float((act * w).sum().detach()) - sum(t[0]["value"] * t[1]["value"] for t in step["terms"]))
    assert "[123 smaller terms:" in step["text"] or f"[{F - 5} smaller terms:" in step["text"]


def test_masked_weight_and_softmax_over_readable_keys():
    m = reinit(tiny_model(attention="naive"), std=0.3)
    tr = trace(m, IDS, with_weights=True)
    masked = explain(tr, "blocks.1.attn.weights", [1, 2, 4])
    assert masked.value is None and masked.steps[-1]["op"] == "masked" and "comes after" in masked.text
    e = explain(tr, "blocks.1.attn.weights", [4, 2, 1])
    soft = e.steps[-1]
    assert [o["index"][2] for o in soft["over"]] == [0, 1, 2, 3, 4]  # keys 5, 6 are in the future
    assert soft["max"] == max(o["value"] for o in soft["over"])
    check(e, tr, m)


def test_probability_from_top_k_logits_uses_the_stored_logsumexp():
    m = reinit(tiny_model(), std=0.3)
    tr = trace(m, IDS, with_weights=True, top_k=3)
    v = tr.probe("logits").index["vocab"][5][1]
    e = explain(tr, "probs", [5, v])
    assert e.steps[-1]["rest"]["count"] == m.config.vocab_size - 3
    check(e, tr, m)
    e = explain(tr, "logits", [5, v])
    check(e, tr, m)


def test_rope_explanation_states_the_angle_cos_and_sin():
    m = reinit(tiny_model(), std=0.3)
    tr = trace(m, IDS, with_weights=True)
    e = explain(tr, "blocks.0.attn.q_rot", [3, 1, 9])  # feature 9 of H=16: pair 1, second half
    theta = e.steps[0]
    assert theta["value"] == pytest.approx(3 * float(m.rope_inv_freq[1]))
    consts = {o["label"]: o["value"] for t in e.steps[1]["terms"] for o in t if o["source"] == "const"}
    assert consts["cos θ"] == pytest.approx(math.cos(theta["value"]), abs=1e-6)
    assert consts["sin θ"] == pytest.approx(math.sin(theta["value"]), abs=1e-6)
    assert "cos θ" in e.text and "rad" in e.text


def test_text_of_a_query_in_the_walkthroughs_toy_model():
    # The walkthrough's figures: cats embeds as [1, 1, -1, -1]; W_Q's columns are
    # [0, 0, 0, -1] and [-0.5, 0, 0.5, 0]; so q[cats] = [1, -1].
    cfg = ModelConfig(vocab_size=6, dim=4, n_layers=1, n_heads=1, head_dim=2, ffn_dim=8, ffn="relu",
                      norm_eps=1e-6, max_seq_len=8)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        m.embed.weight[3] = torch.tensor([1.0, 1.0, -1.0, -1.0])
        m.blocks[0].attn.wq.weight.copy_(torch.tensor([[0, 0, 0, -1.0], [-0.5, 0, 0.5, 0]]))
    tr = trace(m, [0, 2, 3, 5], tokens=["I", "like", "cats", "too"], with_weights=True)
    e = explain(tr, "blocks.0.attn.q", [2, 0, 0])
    assert e.text == "q[cats][0] = Σ_i x[i]·W_Q[i,0] = 1·0 + 1·0 + (−1)·0 + (−1)·(−1) = 1"
    assert [o["name"] for o in e.steps[0]["terms"][0]] == ["blocks.0.attn_norm", "blocks.0.attn.wq.weight"]
    e = explain(tr, "blocks.0.attn.q", [2, 0, 1])
    assert e.text.endswith("= −1")


def test_explain_rejects_bad_requests():
    m = tiny_model()
    tr = trace(m, IDS, with_weights=True)
    with pytest.raises(UserError):
        explain(tr, "blocks.0.attn.nothing", [0, 0])
    with pytest.raises(UserError):
        explain(tr, "blocks.0.attn.q", [0, 0])
    with pytest.raises(UserError):
        explain(tr, "blocks.0.attn.q", [99, 0, 0])
