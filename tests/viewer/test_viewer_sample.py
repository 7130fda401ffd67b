"""The sampling view: sampling_stages against Hugging Face's processors and generate's first token,
and POST /api/sample on the explorer (its answer, its validation, its limits)."""

from __future__ import annotations

import json

import pytest
import torch

from glassformer.generation import generate
from glassformer.generation.sampling_stages import LISTED, STAGES, sampling_stages
from glassformer.text.tokenizer import Tokenizer
from glassformer.viewer import source
from glassformer.viewer.server import MAX_TEXT, make_server

from ..support import reinit, synthetic_text, tiny_model
from .test_viewer_server import post_json, word_explorer

TEXT = "The king and queen walk to the castle where a knight waits"
SETTINGS = [
    dict(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, seed=0),
    dict(temperature=0.7, top_k=40, top_p=0.9, min_p=None, repetition_penalty=1.3, seed=1),
    dict(temperature=1.5, top_k=None, top_p=0.5, min_p=0.05, repetition_penalty=0.8, seed=7),
    dict(temperature=2.0, top_k=250, top_p=None, min_p=0.2, repetition_penalty=1.0, seed=123),
    dict(temperature=0.0, top_k=5, top_p=0.5, min_p=None, repetition_penalty=1.5, seed=3),
]


@pytest.fixture(scope="module")
def parts():
    tok = Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)
    model = reinit(tiny_model(vocab_size=tok.vocab_size), std=0.5)  # peaked: the cuts keep a few ids, not most
    return model, tok, source.explorer(model, tok, TEXT, model_name="tiny")


@pytest.fixture(scope="module")
def served(parts):
    server = make_server(parts[2], port=0)
    server.start_in_thread()
    yield server
    server.stop()


def hf_probs(logits: torch.Tensor, seen: list[int], s: dict) -> torch.Tensor:
    """The reference: Hugging Face's logits processors in their order, then softmax."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    procs = LogitsProcessorList()
    if s["repetition_penalty"] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(s["repetition_penalty"]))
    procs.append(TemperatureLogitsWarper(s["temperature"]))
    if s["top_k"] is not None:
        procs.append(TopKLogitsWarper(s["top_k"]))
    if s["top_p"] is not None:
        procs.append(TopPLogitsWarper(s["top_p"]))
    if s["min_p"] is not None:
        procs.append(MinPLogitsWarper(s["min_p"]))
    out = procs(torch.tensor([seen]), logits[None].clone())
    return torch.softmax(out, -1)[0]


@pytest.mark.parametrize("s", SETTINGS[:4])
def test_stages_against_hugging_face(s):
    g = torch.Generator().manual_seed(s["seed"])
    logits = torch.randn(500, generator=g) * 3  # (V,)
    seen = [3, 17, 17, 250, 499]
    out = sampling_stages(logits, seen, **s)
    assert [st["name"] for st in out["stages"]] == list(STAGES)
    want = hf_probs(logits, seen, s)
    final = out["stages"][-1]
    kept = int((want > 0).sum())
    assert final["kept"] == kept and len(final["ids"]) == min(kept, LISTED)
    assert final["values"] == pytest.approx(want[final["ids"]].tolist(), abs=1e-6)
    assert final["rest"] == pytest.approx(1 - sum(final["values"]), abs=1e-5)
    # The raw logits: the 200 largest, and the softmax mass of the other 300.
    first = out["stages"][0]
    assert first["ids"] == logits.topk(LISTED).indices.tolist()
    assert first["rest"] == pytest.approx(float(torch.softmax(logits, -1).sort().values[:300].sum()), rel=1e-5)
    # The penalty: seen tokens marked, their logits moved the way CTRL's rule says.
    pen = out["stages"][1]
    assert pen["seen"] == [3, 17, 250, 499]
    top = dict(zip(pen["ids"], pen["values"]))
    r = s["repetition_penalty"]
    for i in set(seen) & set(top):
        x = float(logits[i])
        assert top[i] == pytest.approx(x / r if x > 0 else x * r, rel=1e-6)


def test_disabled_stages_repeat_their_input():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    out = sampling_stages(logits, [1, 2], temperature=1.0, top_k=None, top_p=None, min_p=None)
    st = {s["name"]: s for s in out["stages"]}
    assert st["repetition_penalty"]["values"] == st["logits"]["values"] == st["temperature"]["values"]
    assert st["top_k"]["ids"] == st["temperature"]["ids"] and st["top_k"]["kept"] == 300
    assert st["min_p"]["values"] == st["top_p"]["values"] == st["probs"]["values"]
    out = sampling_stages(logits, [], top_k=3, top_p=1.0, min_p=0.0)
    st = {s["name"]: s for s in out["stages"]}
    assert st["top_k"]["ids"] == logits.topk(3).indices.tolist() and st["top_k"]["kept"] == 3
    assert st["top_p"]["ids"] == st["min_p"]["ids"] == st["probs"]["ids"] == st["top_k"]["ids"]


def test_chosen_is_generates_first_token(parts):
    model, tok, explorer = parts
    ids = tok.encode(TEXT)
    for position in (0, 3, len(ids) - 1):
        for s in SETTINGS:
            got = explorer.sample(TEXT, position, s)
            want = next(generate(model, ids[:position + 1], max_new_tokens=1, **s))
            assert got["chosen"] == want, (position, s)
            assert got["position"] == position and str(want) in got["pieces"]
            # The draw is one of the tokens the last stage keeps (the greedy one: the only one).
            assert want in got["stages"][-1]["ids"] or got["stages"][-1]["kept"] > LISTED
    seeds = {explorer.sample(TEXT, 2, dict(SETTINGS[2], seed=k))["chosen"] for k in range(12)}
    assert len(seeds) > 1  # the seed matters: not the argmax every time


def test_each_probability_has_its_calculation(parts):
    _, _, explorer = parts
    for s in SETTINGS:
        out = explorer.sample(TEXT, 5, s)
        final = out["stages"][-1]
        assert sorted(out["calc"], key=int) == sorted(map(str, final["ids"][:10]), key=int)
        for i, p in zip(final["ids"][:10], final["values"]):
            c = out["calc"][str(i)]
            assert c["value"] == p and c["result"] == pytest.approx(p, rel=1e-5)  # recomputed from the lines shown
            assert c["text"].startswith("logit z = ") and len(c["text"].splitlines()) == (3 if s["temperature"] == 0 else 7)


def test_post_api_sample(served, parts):
    model, tok, _ = parts
    ids = tok.encode(TEXT)
    req = {"text": TEXT, "position": 4, **SETTINGS[1]}
    status, headers, body = post_json(served, "/api/sample", req)
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    out = json.loads(body)
    assert [s["name"] for s in out["stages"]] == list(STAGES)
    assert set(out["stages"][0]) >= {"name", "ids", "values"}
    settings = {k: v for k, v in req.items() if k not in ("text", "position")}
    assert out["chosen"] == next(generate(model, ids[:5], max_new_tokens=1, **settings))
    # The settings default to the plain sampler (temperature 1, no filters, no penalty, seed 0).
    status, _, body = post_json(served, "/api/sample", {"text": TEXT, "position": 4})
    assert status == 200 and json.loads(body)["chosen"] == next(generate(model, ids[:5], max_new_tokens=1, seed=0))


@pytest.mark.parametrize("bad, words", [
    ({"position": -1}, "position must be a token index"),
    ({"position": 999}, "position must be a token index"),
    ({"position": "2"}, "needs a position"),
    ({}, "needs a position"),
    ({"position": 1, "temperature": -1}, "temperature must be >= 0"),
    ({"position": 1, "temperature": None}, "temperature must be a number"),
    ({"position": 1, "top_k": 1.5}, "top_k must be an integer"),
    ({"position": 1, "top_k": 0}, "top-k must be an integer >= 1"),
    ({"position": 1, "top_p": 0}, "top-p must be in (0, 1]"),
    ({"position": 1, "min_p": 2}, "min-p must be in [0, 1]"),
    ({"position": 1, "repetition_penalty": 0}, "repetition penalty must be > 0"),
    ({"position": 1, "seed": "x"}, "seed must be an integer"),
    ({"position": 1, "seed": -1}, "seed must be in"),
    ({"position": 1, "text": 5}, "text must be a string"),
    ({"position": 1, "text": "   "}, "empty"),
])
def test_bad_values_are_400(served, bad, words):
    status, _, body = post_json(served, "/api/sample", {"text": TEXT, **bad})
    assert status == 400 and words in json.loads(body)["error"]


def test_limits_and_a_server_without_sampler(served):
    status, _, body = post_json(served, "/api/sample", {"text": "a" * (MAX_TEXT + 1), "position": 0})
    assert status == 413
    server = make_server(word_explorer(), port=0)
    server.start_in_thread()
    try:
        status, _, body = post_json(server, "/api/sample", {"text": "the cat", "position": 0})
        assert status == 400 and "no sampling view" in json.loads(body)["error"]
    finally:
        server.stop()


def test_every_stage_has_its_calculation(parts):
    """Each drawn bar of the earlier stages opens a calculation whose result, recomputed from the
    numbers it shows (the head's product for a raw logit), is that stage's value."""
    model, tok, explorer = parts
    for s in SETTINGS:
        out = explorer.sample(TEXT, 5, s)
        assert set(out["calcs"]) == set(STAGES[:-1])
        for st in out["stages"][:-1]:
            calcs = out["calcs"][st["name"]]
            assert list(calcs) == [str(i) for i in st["ids"][:10]]
            for i, v in zip(st["ids"][:10], st["values"]):
                c = calcs[str(i)]
                assert c["value"] == v and c["result"] == pytest.approx(v, rel=1e-5, abs=1e-6), (st["name"], s, c)
                assert c["title"].endswith(f"= {float(v):.6g}") and out["labels"][str(i)] in c["title"]
        logit = out["calcs"]["logits"]
        first = next(iter(logit.values()))
        assert f"summed over its {model.config.dim} features" in first["text"]
    # The words of each stage's operation, with its numbers.
    out = explorer.sample(TEXT, 5, SETTINGS[2])
    i = out["stages"][5]["ids"][0]
    assert "p_max · min_p" in out["calcs"]["min_p"][str(i)]["text"] and "renormalised" in out["calcs"]["top_p"][str(i)]["text"]
    pen = out["stages"][1]
    for i in pen["ids"][:10]:
        said = out["calcs"]["repetition_penalty"][str(i)]["text"]
        assert ("seen: " in said) == (i in pen["seen"]) and ("not seen yet" in said) == (i not in pen["seen"])
    out = explorer.sample(TEXT, 5, SETTINGS[1])
    i = out["stages"][3]["ids"][0]
    assert "the 40-th largest is" in out["calcs"]["top_k"][str(i)]["text"]


def test_a_soft_capped_heads_raw_logits_are_not_called_a_product(parts):
    """With logit_softcap the raw logit is C·tanh(h·W / C), not h·W: no bar claims the product."""
    _, tok, _ = parts
    model = reinit(tiny_model(vocab_size=tok.vocab_size, logit_softcap=2.0), std=0.5)
    out = source.explorer(model, tok, TEXT, model_name="capped").sample(TEXT, 5, SETTINGS[0])
    logits = out["stages"][0]
    assert max(abs(v) for v in logits["values"]) < 2.0  # capped
    for i, v in zip(logits["ids"][:10], logits["values"]):
        c = out["calcs"]["logits"][str(i)]
        assert c["value"] == v and "summed over its" not in c["text"]


# ----------------------------------------------------------------------------- a saved page's grid

GRID_TEXT = "The king and queen walk"  # 10 tokens: the page's other parts (calculations, walks) grow with its length


def page_data(path) -> dict:
    """The data block of a written page, as the page parses it."""
    html = path.read_text(encoding="utf-8")
    start = html.index('id="glass-data">') + len('id="glass-data">')
    return json.loads(html[start:html.index("</script>", start)])


@pytest.fixture(scope="module")
def big_page(parts, tmp_path_factory):
    """The saved page of a model with GPT-2's vocabulary size (50,257 ids; the tokenizer knows 300)."""
    tok = parts[1]
    model = reinit(tiny_model(vocab_size=50257), std=0.5)
    path = source.write_page(tmp_path_factory.mktemp("grid") / "page.html", model, tok, GRID_TEXT, model_name="tiny")
    return model, tok, path


def test_saved_page_holds_the_servers_answers(big_page):
    model, tok, path = big_page
    assert path.stat().st_size < 5_000_000  # the bound for a saved page
    grid = page_data(path)["sampling"]
    T = len(tok.encode(GRID_TEXT))
    assert len(grid["temperature"]) <= 5 and len(grid["top_p"]) <= 5 and grid["positions"] == [T - 1, T // 2, 0]
    assert len(grid["answers"]) == len(grid["temperature"]) * len(grid["top_p"]) * len(grid["positions"])
    server = source.explorer(model, tok, GRID_TEXT, model_name="tiny")  # the server's sampler, a new one
    for t in grid["positions"]:
        for ti, temp in enumerate(grid["temperature"]):
            for pi, top_p in enumerate(grid["top_p"]):
                settings = source.grid_settings(temp, top_p)
                want = server.sample(GRID_TEXT, t, settings)
                got = source.expand_answer(grid, source.grid_key(t, ti, pi))
                assert got == json.loads(json.dumps(source.compact_answer(want)))
                assert got["chosen"] == want["chosen"]
                for a, b in zip(got["stages"], want["stages"]):
                    assert a["ids"] == b["ids"][:10] and a["values"] == b["values"][:10]
                    assert a["rest"] == pytest.approx(b["rest"] + sum(b["probs"][10:]), abs=1e-6)
                assert set(got["calcs"]) == set(STAGES[:-1]) and list(got["calc"]) == [str(i) for i in got["stages"][-1]["ids"]]
    # Against an independent reference: the page's top-p 0.8 at temperature 0.8 is logits_to_probs of a full forward.
    ids = tok.encode(GRID_TEXT)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids]))[0][0, -1] / 0.8, -1)  # (V,)
    p_sorted, order = probs.sort(descending=True)
    keep = order[(p_sorted.cumsum(0) - p_sorted) < 0.8]
    final = source.expand_answer(grid, source.grid_key(T - 1, 2, 1))["stages"][-1]
    assert final["kept"] == len(keep) and final["ids"] == keep[:10].tolist()
    assert final["values"] == pytest.approx((probs[keep[:10]] / probs[keep].sum()).tolist(), abs=1e-6)


LONG_TEXT = TEXT + " with his sword while the queen walks"  # twice GRID_TEXT's tokens: over 5 MB untrimmed


def test_a_long_saved_page_is_trimmed_to_fit(big_page, tmp_path):
    """Over PAGE_LIMIT, write_html drops stored calculations (last-listed first), then tile walks
    of other rows; the sampling grid, the focus token's calculations and the note stay right."""
    from glassformer.viewer import render

    model, tok, _ = big_page
    tr, args = source.page_args(model, tok, LONG_TEXT, model_name="tiny")
    full = render.build_payload(tr, mode="static", slim=True, **args)
    untrimmed = len(render.render_html(full, inline=True).encode("utf-8"))
    path = render.write_html(tmp_path / "long.html", tr, **args)
    data = page_data(path)
    assert untrimmed > render.PAGE_LIMIT >= path.stat().st_size
    assert data["sampling"] == json.loads(json.dumps(full["sampling"]))  # the grid whole
    kept = list(data["explain"])
    assert 0 < len(kept) < len(full["explain"]) and kept == list(full["explain"])[:len(kept)]  # a prefix: the focus token's first
    left = full["explain_left"] + len(full["explain"]) - len(kept)
    assert data["explain_left"] == left
    assert render._stored_text(len(kept), left) in data["notes"]
    # A limit nothing can meet is a clear error, not a silently broken page.
    with pytest.raises(Exception, match="give a shorter text"):
        render.fit_page(full, limit=1000)
