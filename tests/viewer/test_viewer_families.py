"""The explorer on the families' switches (issue 45), without a browser: the page data of a mixture
model carries each token's route through the experts (which, with what weight, per layer), a sink
model's sink weights, the post norms; every cost formula the page shows evaluates to the estimate;
`glassformer view`/`trace`/`explain` run on a tiny model of each switch."""

from __future__ import annotations

import json
import math
import re

import pytest

from glassformer.config import ModelConfig
from glassformer.cost import estimate
from glassformer.viewer import render, source
from glassformer.explaining.explain import explain
from glassformer.tracing.trace import trace
from glassformer.viewer.cost_calc import figure
from glassformer.viewer.families import families_part

from ..explaining.test_explain_families import FAMILIES
from ..support import NumberTokenizer, reinit, tiny_model


IDS = [5, 9, 2, 7, 11, 3, 8]
TEXT = " ".join(map(str, IDS))


def family_model(name):
    return reinit(tiny_model(**FAMILIES[name]), std=0.3, seed=1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cost_formulas_shown_equal_the_estimate(name):
    cfg = ModelConfig.from_preset("tiny", **FAMILIES[name])
    view = source.costs_view(cfg, 7)
    r = estimate(cfg, batch=1, seq=7, dtype="fp32", hardware="h100")
    rows = [row for row in view["rows"] if row["value"] is not None]
    assert all("calc" in row for row in rows), [row["key"] for row in rows if "calc" not in row]
    for row in rows:
        filled = row["calc"]["substituted"]
        assert re.fullmatch(r"[0-9+\-·/(). ceil]*", filled), filled
        got = eval(filled.replace("·", "*"), {"__builtins__": {}, "ceil": math.ceil})  # noqa: S307
        assert got == pytest.approx(figure(r, row["key"]), rel=1e-12), (row["key"], row["calc"]["text"])


def test_the_page_data_of_a_mixture_carries_each_tokens_route():
    model = family_model("qwen3_moe")  # layer 1 is the mixture, layer 0 stays dense
    tr, args = source.page_args(model, NumberTokenizer(), TEXT, model_name="moe", mode="server")
    payload = render.build_payload(tr, mode="server", **args)
    fam = payload["families"]
    moe = fam["moe"]
    assert moe["experts"] == 4 and moe["k"] == 2 and [m["layer"] for m in moe["layers"]] == [1]
    layer = moe["layers"][0]
    ids, weights = tr["blocks.1.ffn.expert_ids"], tr["blocks.1.ffn.expert_weights"]
    for t in range(len(IDS)):
        route = layer["routes"][t]
        assert [r["expert"] for r in route] == [int(e) for e in ids[t]]
        assert [r["weight"] for r in route] == pytest.approx(weights[t].tolist(), abs=1e-6)
        assert sum(r["weight"] for r in route) == pytest.approx(1.0, abs=1e-5)  # renormalised
        assert layer["probs"][t] == pytest.approx(tr["blocks.1.ffn.router_probs"][t].tolist(), abs=1e-6)
    slots = [e for row in layer["routes"] for e in (r["expert"] for r in row)]
    assert layer["load"] == [slots.count(e) for e in range(4)]
    # an expert's own probes (its routed tokens only) stay with the server's trace, not the page's drawing
    assert not [n for n in payload["trace"]["probes"] if ".ffn.experts." in n]
    assert "blocks.1.ffn.expert_out" in payload["trace"]["probes"] and not [n for n in payload["rms"] if ".experts." in n]
    json.dumps(payload, allow_nan=False)
    # the page's script for the families is part of the page, and its view's section is there
    page = render.render_html(payload, inline=True)
    assert "G.view({ draw" in render.static_file("families.js") and 'id="view-families"' in page
    assert "families.js" in render.VIEW_SCRIPTS


def test_the_page_data_of_sinks_and_post_norms():
    model = family_model("gpt_oss")
    tr = source.trace_for_page(model, IDS, [f"t{i}" for i in IDS])
    sinks = families_part(tr.to_dict())["sinks"]
    assert [s["layer"] for s in sinks] == [0, 1]
    for s in sinks:
        want = tr[f"blocks.{s['layer']}.attn.sink_weight"]
        for got, row in zip(s["weight"], want.tolist()):
            assert got == pytest.approx(row, abs=1e-6)
        assert s["window"] == model.config.window_at(s["layer"])
    fam = families_part(trace(family_model("gemma2"), IDS).to_dict())
    assert fam["norms"]["placement"] == "sandwich" and fam["norms"]["offset"] is True
    assert fam["norms"]["adds"][0] == {"attn": "blocks.0.attn_post_norm", "ffn": "blocks.0.ffn_post_norm"}
    assert [k["window"] for k in fam["layers"]] == [3, None] and fam["scores"]["softcap"] == 2.0
    assert families_part(trace(tiny_model(), IDS).to_dict()) is None  # a plain model: nothing new to draw


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_a_saved_pages_calculations_of_the_new_numbers(name):
    """A saved page stores the calculations of the families' numbers it draws, and each recomputes
    to the traced number."""
    model = family_model(name)
    tr, args = source.page_args(model, NumberTokenizer(), TEXT, model_name=name, mode="server")
    payload = render.build_payload(tr, mode="static", explain=lambda p, i: explain(tr, p, i, model=model),
                                   explain_limit=300, **args)
    new = [k for k in payload["explain"] if re.search(r"(post_norm|sink_weight|router_probs|expert_weights|q_norm)\|", k)]
    assert new
    for key in new:
        c = payload["explain"][key]
        assert c["result"] == pytest.approx(c["value"], rel=1e-5, abs=1e-5), key


@pytest.mark.parametrize("name", ["gemma2", "smollm3", "olmo2", "gpt_oss"])
def test_the_flashattention_walks_rerun_each_layer_as_the_model_ran_it(name):
    """The walks a page shows rerun the tiled kernel over the traced q, k, v with each layer's own
    window, score scale and cap (and the unturned q, k of a NoPE layer): o / l after the last tile,
    times 1 − the sink's weight with sinks, is the traced z; the trace's own tile log's walks too."""
    import torch

    model = family_model(name)
    tr = source.trace_for_page(model, IDS, [f"t{i}" for i in IDS])
    walks = source.tile_walks(tr, 2, [len(IDS) - 1, 3])
    walks.update(render._with_traced_tiles(tr.to_dict(), None)["walks"])
    for key, walk in walks.items():
        layer, head, row, _ = map(int, key.split("|"))
        z = tr[f"blocks.{layer}.attn.z"][row, head]
        assert torch.allclose(torch.tensor(walk["output"]), z, atol=1e-5), key


def test_view_of_a_mixture_checkpoint_answers_with_routes_and_explains_them(tmp_path):
    """`glassformer view --checkpoint` on a gpt-oss-like mixture: its explorer's answer carries the
    routes and the sinks, and a route's weight, a sink's weight and an expert's own number explain."""
    import torch

    from glassformer import Transformer
    from glassformer.checkpoint.folders import save_model
    from glassformer.cli import build_parser
    from glassformer.commands import view
    from glassformer.text.tokenizer import Tokenizer

    from ..support import synthetic_text

    tok = Tokenizer.train([synthetic_text(100, 1)], vocab_size=300)
    cfg = ModelConfig.from_preset("tiny", **{**FAMILIES["gpt_oss"], "vocab_size": tok.vocab_size})
    torch.manual_seed(0)
    save_model(tmp_path / "ckpt", reinit(Transformer(cfg), std=0.2).eval(), tok)
    ex = view.build_explorer(build_parser().parse_args(["view", "--checkpoint", str(tmp_path / "ckpt")]))
    text = "the cat sat on the mat"
    page = ex.payload(text)
    moe = page["families"]["moe"]
    assert [m["layer"] for m in moe["layers"]] == [0, 1] and page["families"]["sinks"]
    route = moe["layers"][1]["routes"][2]
    calc = ex.calculation(text, "blocks.1.ffn.expert_weights", [2, 1])
    assert calc["value"] == pytest.approx(route[1]["weight"], abs=1e-6)
    assert calc["result"] == pytest.approx(calc["value"], rel=1e-5, abs=1e-6)
    calc = ex.calculation(text, "blocks.0.attn.sink_weight", [3, 2])
    assert calc["result"] == pytest.approx(calc["value"], rel=1e-5, abs=1e-6)
    e = route[0]["expert"]
    calc = ex.calculation(text, f"blocks.1.ffn.experts.{e}.down", [2, 5])
    assert calc["result"] == pytest.approx(calc["value"], rel=1e-5, abs=1e-5)
