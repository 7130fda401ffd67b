"""Direct logit attribution (glassformer.research.attribution, `glassformer attribute`): the parts sum
to the model's own logit difference, and each part is recomputed in numpy from a trace's probes and
weights (tracing.trace, another reader of the same run)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from glassformer.errors import UserError
from glassformer.probes import final_norm_reads
from glassformer.research.attribution import direct_logit_attribution
from glassformer.tracing.trace import trace
from ..support import one_error, run_cli, tiny_checkpoint, tiny_model

IDS = [5, 17, 301, 44, 9, 250, 3, 77, 120]
CONFIGS = [{}, dict(norm="layer", bias=True, pos="learned", ffn="gelu_tanh"), dict(ffn="none"),
           dict(tie_embeddings=True, qkv_bias=True), dict(logit_softcap=2.0),
           dict(n_experts=4, n_active_experts=2, n_shared_experts=1),  # the mixture is the ffn's part
           dict(norm_offset=True, embed_scale=True, attn_sinks=True, attn_bias=True)]  # Gemma's (1 + w), gpt-oss's sinks


def own_diff(model, ids, answer, wrong, position=-1):
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return float(logits[0, position, answer] - logits[0, position, wrong])


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_the_parts_sum_to_the_models_own_logit_difference(overrides):
    model = tiny_model(**overrides)
    for position in (-1, 4):
        out = direct_logit_attribution(model, IDS, 3, 5, position)
        assert abs(out["sum"] - out["logit_diff"]) < 1e-4
        assert out["stream_error"] < 1e-4  # the parts' vectors add up to the stream the final norm reads
        own = own_diff(model, IDS, 3, 5, position)
        cap = overrides.get("logit_softcap")
        if cap is None:
            assert out["logit_diff"] == pytest.approx(own, abs=1e-5)
        else:  # the parts split the difference before the cap, and the answer says so
            assert out["capped_logit_diff"] == pytest.approx(own, abs=1e-5) and "soft-caps" in out["note"]
            assert cap * math.atanh(out["answer_logit"] / cap) - cap * math.atanh(out["wrong_logit"] / cap) == \
                pytest.approx(out["logit_diff"], abs=1e-4)
    names = set(out["parts"])
    assert {f"blocks.{i}.attn.head{h}" for i in range(2) for h in range(4)} <= names and "embed" in names
    assert ({"blocks.0.ffn", "blocks.1.ffn"} <= names) == (overrides.get("ffn") != "none")


def test_each_part_is_its_vector_through_the_frozen_norm_recomputed_in_numpy():
    model = tiny_model()
    cfg = model.config
    tr = trace(model, IDS, with_weights=True)
    out = direct_logit_attribution(model, IDS, 3, 5)
    x = tr[final_norm_reads(cfg.n_layers, cfg.norm_placement, cfg.ffn)].double().numpy()[-1]  # (D,)
    s = np.sqrt(np.mean(x * x) + cfg.norm_eps)
    W_U = model.lm_head.weight.detach().double().numpy()
    read = model.final_norm.weight.detach().double().numpy() * (W_U[3] - W_U[5])
    H = cfg.head_dim
    for i in range(cfg.n_layers):
        z = tr[f"blocks.{i}.attn.z"].double().numpy()[-1]  # (N, H)
        W_O = tr.weights[f"blocks.{i}.attn.wo.weight"].data.double().numpy()  # (N·H, D), math layout
        for h in range(cfg.n_heads):
            assert out["parts"][f"blocks.{i}.attn.head{h}"] == pytest.approx(z[h] @ W_O[h * H:(h + 1) * H] @ read / s, abs=1e-6)
        f = tr[f"blocks.{i}.ffn.down"].double().numpy()[-1]
        assert out["parts"][f"blocks.{i}.ffn"] == pytest.approx(f @ read / s, abs=1e-6)
    assert out["parts"]["embed"] == pytest.approx(tr["embed"].double().numpy()[-1] @ read / s, abs=1e-6)
    assert out["scale"] == pytest.approx(s, rel=1e-9)


@pytest.mark.parametrize("placement, says", [("post", "the stream itself"), ("sandwich", "each sublayer's output")])
def test_a_model_whose_stream_is_no_sum_is_refused_in_one_line(placement, says):
    with pytest.raises(UserError, match="pre-norm") as e:
        direct_logit_attribution(tiny_model(norm_placement=placement), IDS, 3, 5)
    assert "\n" not in str(e.value) and says in str(e.value)


def test_the_command_prints_the_parts_as_its_last_json_line(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    tiny_checkpoint(folder, "the cat sat on the mat. the dog sat on the log. " * 20)
    html = tmp_path / "bars.html"
    argv = ["attribute", "--checkpoint", str(folder), "--text", "the cat sat on the", "--answer", " mat", "--wrong", " log"]
    assert run_cli(argv + ["--json", "--html", str(html)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(sum(out["parts"].values()) - out["logit_diff"]) < 1e-4
    assert out["answer"]["token"] == " mat" and "blocks.1.attn.head3" in out["parts"]
    assert "glass-research" in html.read_text()
    assert run_cli(argv) == 0 and "parts sum to" in capsys.readouterr().out
    one_error(capsys, argv[:-2] + ["--wrong", "#99999"], "--wrong", "0..")
    one_error(capsys, argv[:-4] + ["--answer", "the mat", "--wrong", " log"], "--answer", "2 tokens")
