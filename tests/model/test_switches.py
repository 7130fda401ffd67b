"""The speedrun switches (qk_norm, ffn='relu2', logit_softcap, value_embeddings): each one's forward
against a naive forward written here, a training step, KV-cache decoding, the weight and FLOP
counts, export refused by name, explain's rules recomputed, and old checkpoints unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from glassformer import KVCache, ModelConfig, Transformer, explain
from glassformer.convert.families import family_for
from glassformer.convert.gguf import gguf_arch
from glassformer.cost.flops import forward_flops
from glassformer.cost.memory import activations
from glassformer.cost.params import weights
from glassformer.errors import UserError
from glassformer.tracing.interventions import logit_lens
from glassformer.tracing.trace import trace

from ..support import REPO, tiny_model

SWITCHES = {
    "qk_norm": dict(qk_norm=True),
    "relu2": dict(ffn="relu2"),
    "logit_softcap": dict(logit_softcap=2.0),  # a small cap, so that it bends the logits of a reinit model
    "value_embeddings": dict(value_embeddings=True, n_layers=3),
    "all": dict(qk_norm=True, ffn="relu2", logit_softcap=2.0, value_embeddings=True, n_layers=3),
}
# The name an export refusal must say for each switch.
NAMES = {"qk_norm": "qk_norm", "relu2": "relu2", "logit_softcap": "logit_softcap", "value_embeddings": "value_embeddings"}
IDS = torch.tensor([[7, 300, 42, 7, 511, 12, 99, 3, 42]])


# ----------------------------------------------------------------------------- a naive forward


def _rms(x, eps, weight=None):
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _rope_half(x, pos, theta):
    """Pair feature i with i + H/2, turn pair i by pos·theta^(-2i/H): (a cos − b sin, a sin + b cos)."""
    H = x.shape[-1]
    out = x.clone()
    for i in range(H // 2):
        ang = pos.double() * theta ** (-2 * i / H)  # (T,)
        c, s = torch.cos(ang).float()[:, None], torch.sin(ang).float()[:, None]
        a, b = x[..., i], x[..., i + H // 2]  # (T, heads)
        out[..., i], out[..., i + H // 2] = a * c - b * s, a * s + b * c
    return out


def _naive_attention(cfg, sd, i, h, ids):
    T, H, N, K = h.shape[0], cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    p = f"blocks.{i}.attn."
    q = (h @ sd[p + "wq.weight"].T).view(T, N, H)
    k = (h @ sd[p + "wk.weight"].T).view(T, K, H)
    v = h @ sd[p + "wv.weight"].T
    if p + "ve.weight" in sd:  # the token's row of this layer's value table, added to V
        v = v + sd[p + "ve.weight"][ids]
    v = v.view(T, K, H)
    if cfg.qk_norm:
        q, k = _rms(q, cfg.norm_eps), _rms(k, cfg.norm_eps)
    pos = torch.arange(T)
    q, k = _rope_half(q, pos, cfg.rope_theta), _rope_half(k, pos, cfg.rope_theta)
    out = torch.zeros(T, N, H)
    for n in range(N):
        kv = n // (N // K)
        s = q[:, n] @ k[:, kv].T / math.sqrt(H)  # (T, T)
        s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        out[:, n] = torch.softmax(s, -1) @ v[:, kv]
    return out.reshape(T, N * H) @ sd[p + "wo.weight"].T


def _naive_ffn(cfg, sd, i, h):
    p = f"blocks.{i}.ffn."
    up = h @ sd[p + "w_up.weight"].T
    if cfg.ffn == "swiglu":
        act = F.silu(h @ sd[p + "w_gate.weight"].T) * up
    else:
        assert cfg.ffn == "relu2"
        act = torch.where(up > 0, up, torch.zeros_like(up)) ** 2
    return act @ sd[p + "w_down.weight"].T


def naive_logits(model, ids):
    """The pre-norm RMSNorm RoPE model with each switch, from its state dict, one row of ids."""
    cfg, sd = model.config, model.state_dict()
    x = sd["embed.weight"][ids]  # (T, D)
    for i in range(cfg.n_layers):
        x = x + _naive_attention(cfg, sd, i, _rms(x, cfg.norm_eps, sd[f"blocks.{i}.attn_norm.weight"]), ids)
        x = x + _naive_ffn(cfg, sd, i, _rms(x, cfg.norm_eps, sd[f"blocks.{i}.ffn_norm.weight"]))
    logits = _rms(x, cfg.norm_eps, sd["final_norm.weight"]) @ model.lm_head.weight.T
    if cfg.logit_softcap is not None:
        logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
    return logits


@pytest.fixture(scope="module", params=list(SWITCHES))
def switched(request):
    return request.param, tiny_model(**SWITCHES[request.param])


def test_forward_equals_a_naive_forward(switched):
    name, model = switched
    with torch.no_grad():
        got, _ = model(IDS)
        ref = naive_logits(model, IDS[0])
    torch.testing.assert_close(got[0], ref, rtol=1e-4, atol=1e-4)
    if "logit_softcap" in SWITCHES[name]:
        assert got.abs().max() < 2.0  # the cap holds


@pytest.mark.parametrize("name", ["qk_norm", "logit_softcap"])
def test_the_switch_changes_the_forward(name):
    """The same weights with the switch off give other logits (the switch is not a no-op); relu2 and
    value_embeddings change the weights themselves (no gate; extra tables)."""
    model = tiny_model(**SWITCHES[name])
    off = Transformer(model.config.replace(**{k: ModelConfig.__dataclass_fields__[k].default for k in SWITCHES[name]}))
    off.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(IDS)[0], off.eval()(IDS)[0], atol=1e-3)


def test_one_training_step(switched):
    """Every weight (the value tables too) gets a gradient, and one AdamW step lowers the batch's loss."""
    name, model = switched
    m = Transformer(model.config)
    m.load_state_dict(model.state_dict())
    m.train()
    x, y = IDS[:, :-1], IDS[:, 1:]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _, loss = m(x, y)
    loss.backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        if n.endswith("attn.ve.weight"):
            assert p.grad[x[0]].abs().sum() > 0 and p.grad[511 if 511 not in x[0] else 0].abs().sum() == 0
    opt.step()
    with torch.no_grad():
        _, after = m(x, y)
    assert after < loss


def test_kv_cache_decoding_equals_the_full_forward(switched):
    _, model = switched
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(ids)
        cache = KVCache.for_model(model, 2, 16)
        steps = [model(ids[:, :5], cache=cache, pos=0)[0]]
        for t in range(5, 13):
            steps.append(model(ids[:, t:t + 1], cache=cache, pos=t)[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_weights_and_flops_counted(switched):
    """cost.weights equals numel; forward FLOPs equal FlopCounterMode on the naive kernel."""
    name, model = switched
    cfg = model.config
    assert weights(cfg)["total"] == model.num_params() == sum(p.numel() for p in model.parameters())
    assert weights(cfg)["non_embedding"] == model.num_params(non_embedding=True)
    naive = Transformer(cfg.replace(attention="naive"))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        naive(IDS)
    assert forward_flops(cfg, 1, IDS.shape[1], "naive")["total"] == fc.get_total_flops()


def _saved_elements(model, B, T) -> int:
    """Floating-point elements autograd keeps for backward in one training forward, each storage once."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and t.dtype.is_floating_point:
            seen.setdefault(st.data_ptr(), st.nbytes() // t.element_size())
        return t

    idx = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(seen.values())


@pytest.mark.parametrize("name,off", [("qk_norm", dict(qk_norm=False)), ("logit_softcap", dict(logit_softcap=None)),
                                      ("relu2", dict(ffn="relu"))])
def test_activations_counted(name, off):
    """What the switch adds to the saved activations, estimated (cost.activations) and measured, agree exactly."""
    cfg = ModelConfig.from_preset("tiny", **SWITCHES[name])
    base = cfg.replace(**off)
    measured = _saved_elements(Transformer(cfg).train(), 2, 32) - _saved_elements(Transformer(base).train(), 2, 32)
    assert measured > 0
    assert activations(cfg, 2, 32)["total"] - activations(base, 2, 32)["total"] == measured


@pytest.mark.parametrize("name", list(NAMES))
def test_export_refuses_by_name(name):
    cfg = ModelConfig.from_preset("tiny", **SWITCHES[name])
    with pytest.raises(UserError, match=NAMES[name]) as hf:
        family_for(cfg)
    assert "Hugging Face" in str(hf.value)
    with pytest.raises(UserError, match=NAMES[name]) as gg:
        gguf_arch(cfg)
    assert "GGUF" in str(gg.value)


def test_value_embeddings_sit_on_every_other_layer_ending_with_the_last():
    """nanochat's rule: layer i has one when i % 2 == (L − 1) % 2."""
    for L, want in ((1, [0]), (3, [0, 2]), (4, [1, 3])):
        cfg = ModelConfig.from_preset("tiny", n_layers=L, value_embeddings=True)
        assert cfg.value_embed_layers == want
        keys = [k for k in Transformer(cfg).state_dict() if k.endswith("attn.ve.weight")]
        assert keys == [f"blocks.{i}.attn.ve.weight" for i in want]
        assert all(Transformer(cfg).state_dict()[k].shape == (512, cfg.kv_dim) for k in keys)
    assert ModelConfig.from_preset("tiny").value_embed_layers == []


@pytest.mark.parametrize("bad", [dict(logit_softcap=0.0), dict(logit_softcap=-3), dict(logit_softcap=True),
                                 dict(qk_norm="yes"), dict(value_embeddings=1), dict(ffn="relu3")])
def test_config_refuses_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ModelConfig.from_preset("tiny", **bad)


def test_config_round_trips_and_old_configs_get_the_defaults():
    cfg = ModelConfig.from_preset("tiny", **SWITCHES["all"])
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    old = {k: v for k, v in ModelConfig().to_dict().items() if k not in ("qk_norm", "logit_softcap", "value_embeddings")}
    back = ModelConfig.from_dict(old)
    assert (back.qk_norm, back.logit_softcap, back.value_embeddings) == (False, None, False)


def test_an_old_checkpoint_gives_the_same_logits():
    """tests/data/tiny_checkpoint_v1's config.json predates the switches: they default off, and
    its logits stay those it was saved with (bitwise on the machine that wrote them; within a few
    units in the last place on a chip whose matrix-product kernels sum in another order:
    tests/checkpoint/test_checkpoint.py)."""
    from safetensors.torch import load_file

    import glassformer

    data = REPO / "tests" / "data"
    model, _ = glassformer.load(data / "tiny_checkpoint_v1")
    assert (model.config.qk_norm, model.config.logit_softcap, model.config.value_embeddings) == (False, None, False)
    ref = load_file(data / "tiny_checkpoint_v1_logits.safetensors")
    with torch.no_grad():
        logits, _ = model.eval()(ref["ids"])
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def test_the_logit_lens_ends_at_the_capped_logits():
    model = tiny_model(logit_softcap=2.0)
    with torch.no_grad():
        lens = logit_lens(model, IDS[0].tolist())
        logits, _ = model(IDS)
    torch.testing.assert_close(lens[-1], logits[0], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- explain


def _post(kind, x):
    """Each step's closing function, written again here."""
    table = {None: lambda v: v, "sqrt": math.sqrt, "tanh": math.tanh, "relu2": lambda v: (v if v > 0 else 0.0) ** 2,
             "silu": lambda v: v / (1 + math.exp(-v))}
    return table[kind](x)


def _recomputed(e, tr):
    """Recompute every step from its operands; probe operands must be the trace's numbers."""
    steps = e.to_dict()["steps"]
    for step in steps:
        assert step["op"] == "sum"
        for t in step["terms"] + step.get("fixed", []):
            for o in t:
                if o["source"] == "probe":
                    assert o["value"] == tr.value(o["name"], o["index"])
        total = sum(math.prod(o["value"] ** o.get("power", 1) for o in t) for t in step["terms"])
        total += (step.get("rest") or {}).get("value", 0.0)
        assert _post(step.get("post"), total) == pytest.approx(step["value"], rel=1e-9, abs=1e-12)
    return steps[-1]["value"]


@pytest.fixture(scope="module")
def traced():
    model = tiny_model(**SWITCHES["all"])
    return model, trace(model, IDS[0].tolist())


@pytest.mark.parametrize("probe,index", [
    ("blocks.0.attn.q_norm", (4, 1, 3)), ("blocks.2.attn.k_norm", (6, 1, 10)), ("blocks.1.attn.q_rot", (5, 2, 12)),
    ("blocks.0.attn.ve", (3, 1, 5)), ("blocks.2.attn.v", (8, 0, 7)), ("blocks.1.attn.v", (2, 1, 0)),
    ("blocks.1.ffn.act", (6, 11)), ("head.uncapped", (5, 42)), ("logits", (5, 42)),
])
def test_explain_recomputes_the_new_probes(traced, probe, index):
    """Each new rule's steps recompute to the traced number; the number itself is checked against a
    direct recomputation from the model's weights and the trace's inputs."""
    model, tr = traced
    e = explain(tr, probe, index, model=model)
    got = _recomputed(e, tr)
    assert got == pytest.approx(tr.value(probe, list(index)), rel=1e-5, abs=1e-6)
    assert tr.value(probe, list(index)) == pytest.approx(_direct(model, tr, probe, index), rel=1e-5, abs=1e-6)


def _direct(model, tr, probe, index):
    """The probe's number from its definition, with torch on the trace's inputs."""
    cfg, sd = model.config, model.state_dict()
    t, *rest = index
    leaf = probe.rsplit(".", 1)[-1]
    if leaf in ("q_norm", "k_norm"):
        x = tr[probe[: -len("_norm")]][t, rest[0]]  # (H,)
        return float(x[rest[1]] / torch.sqrt((x * x).mean() + cfg.norm_eps))
    if leaf == "ve":
        return float(sd[probe + ".weight"][tr.ids[t], rest[0] * cfg.head_dim + rest[1]])
    if leaf == "v":
        i = int(probe.split(".")[1])
        x = tr[f"blocks.{i}.attn_norm"][t]  # (D,)
        c = rest[0] * cfg.head_dim + rest[1]
        ve = sd[f"blocks.{i}.attn.ve.weight"][tr.ids[t], c] if i in cfg.value_embed_layers else 0.0
        return float(x @ sd[f"blocks.{i}.attn.wv.weight"][c] + ve)
    if leaf == "q_rot":  # half pairs: feature j ≥ H/2 is a·sin θ + b·cos θ of the normalised query
        H, j = cfg.head_dim, rest[1]
        assert j >= H // 2
        q = tr[probe.replace("_rot", "_norm")][t, rest[0]]  # (H,)
        angle = t * cfg.rope_theta ** (-2 * (j - H // 2) / H)
        return float(q[j - H // 2]) * math.sin(angle) + float(q[j]) * math.cos(angle)
    if leaf == "act":
        up = float(tr[probe.replace(".act", ".up")][t, rest[0]])
        return max(up, 0.0) ** 2
    raw = float(tr["final_norm"][t] @ model.lm_head.weight.detach()[rest[0]])
    return raw if leaf == "uncapped" else cfg.logit_softcap * math.tanh(raw / cfg.logit_softcap)


def test_explain_rotates_the_normalised_query(traced):
    model, tr = traced
    e = explain(tr, "blocks.1.attn.q_rot", (5, 2, 12), model=model)
    names = {o["name"] for s in e.to_dict()["steps"] for t in s["terms"] for o in t if o["source"] == "probe"}
    assert names == {"blocks.1.attn.q_norm"}


def test_the_trace_holds_the_new_probes(traced):
    model, tr = traced
    cfg = model.config
    T = IDS.shape[1]
    assert tr.probe("blocks.0.attn.q_norm").axes == ["token", "head", "feature"]
    assert tuple(tr["blocks.0.attn.q_norm"].shape) == (T, cfg.n_heads, cfg.head_dim)
    assert tuple(tr["blocks.2.attn.k_norm"].shape) == (T, cfg.n_kv_heads, cfg.head_dim)
    assert "blocks.0.attn.ve" in tr.probes and "blocks.1.attn.ve" not in tr.probes
    assert tuple(tr["head.uncapped"].shape) == (T, cfg.vocab_size)


def test_explain_from_a_trace_file_with_weights_and_top_k(tmp_path):
    """A trace written to JSON with its weights and only the top 5 logits explains the capped logit and
    the value embedding without the model."""
    from glassformer.tracing.format import as_trace

    model = tiny_model(**SWITCHES["all"])
    tr = trace(model, IDS[0].tolist(), top_k=5, with_weights=True)
    path = tmp_path / "t.json"
    tr.to_json(path)
    back = as_trace(str(path))
    v = back.probe("logits").index["vocab"][4][0]  # the largest logit at token 4
    assert back.probe("head.uncapped").index["vocab"][4] == back.probe("logits").index["vocab"][4]
    e = explain(back, "logits", (4, v))
    assert _recomputed(e, back) == pytest.approx(back.value("logits", [4, v]), rel=1e-5)
    e = explain(back, "blocks.2.attn.v", (3, 1, 2))
    assert _recomputed(e, back) == pytest.approx(back.value("blocks.2.attn.v", [3, 1, 2]), rel=1e-5, abs=1e-6)


def test_pooling_kv_heads_pools_the_value_tables_too():
    """convert --kv-heads on a model with value embeddings: each new value head is the mean of its
    group's old ones, the value table's share included."""
    from glassformer.convert.heads import convert_kv_heads

    model = tiny_model(value_embeddings=True, n_layers=3)  # 2 KV heads
    pooled = convert_kv_heads(model, 1)
    assert pooled.blocks[0].attn.ve.weight.shape == (512, pooled.config.kv_dim)
    old, new = trace(model, IDS[0].tolist()), trace(pooled, IDS[0].tolist())
    for i in (0, 2):  # the layers with a value table
        torch.testing.assert_close(new[f"blocks.{i}.attn.ve"][:, 0], old[f"blocks.{i}.attn.ve"].mean(1), rtol=1e-5, atol=1e-6)
    # layer 0 reads the same input in both models: its whole v (x·W_V + ve) is the group's mean
    torch.testing.assert_close(new["blocks.0.attn.v"][:, 0], old["blocks.0.attn.v"].mean(1), rtol=1e-5, atol=1e-6)
