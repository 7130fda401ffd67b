"""The generated-text view's data (viewer/generated.py) and POST /api/generate: the tokens are
generate's for the seed, every probability equals a full forward's softmax, the sampler's stages at
each step are its own with the drawn token among those kept; bad requests answer 400; and
`glassformer generate --html` writes the page under a size bound with the same tokens."""

from __future__ import annotations

import json
import re

import pytest
import torch

from glassformer.cli import main
from glassformer.generation import apply_repetition_penalty, generate, logits_to_probs
from glassformer.text.labels import token_label
from glassformer.text.tokenizer import Tokenizer
from glassformer.viewer import source
from glassformer.viewer.generated import MAX_TOKENS, STAGE_IDS
from glassformer.viewer.server import MAX_TEXT

from ..support import reinit, synthetic_text, tiny_checkpoint, tiny_model
from .test_viewer_server import post_json
from .test_viewer_sample import served  # noqa: F401 (a fixture: the explorer of this module's parts, served)

PROMPT = "The king and the queen"
SETTINGS = [
    dict(temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, seed=1),
    dict(temperature=0.8, top_k=40, top_p=0.9, min_p=None, repetition_penalty=1.3, seed=4),
    dict(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, seed=0),
]
N = 12  # new tokens per test generation


@pytest.fixture(scope="module")
def parts(one_thread):
    tok = Tokenizer.train([synthetic_text(200, 1)], vocab_size=300)
    model = reinit(tiny_model(vocab_size=tok.vocab_size), std=0.5)  # peaked: the draws are not near-uniform
    return model, tok, source.explorer(model, tok, PROMPT, model_name="tiny")


@pytest.fixture(scope="module")
def answers(parts):
    """The explorer's /api/generate answer for each of SETTINGS (computed once)."""
    return [parts[2].generation(PROMPT, N, s) for s in SETTINGS]


def reference_tokens(model, tok, s: dict, n: int = N) -> list[int]:
    return list(generate(model, tok.encode(PROMPT), max_new_tokens=n, stop=[tok.eot_id], **s))


def full_forward(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0][0]  # (T, V)


def test_tokens_are_generates_for_the_seed(parts, answers):
    model, tok, _ = parts
    for s, out in zip(SETTINGS, answers):
        g = out["generated"]
        want = reference_tokens(model, tok, s)
        assert [t["id"] for t in g["tokens"]] == want
        assert g["ids"] == tok.encode(PROMPT) + want and out["trace"]["ids"] == g["ids"]
        assert g["prompt_tokens"] == len(tok.encode(PROMPT)) and g["settings"] == s
        assert [t["position"] for t in g["tokens"]] == list(range(g["prompt_tokens"], len(g["ids"])))
    assert [t["id"] for t in answers[0]["generated"]["tokens"]] != [t["id"] for t in answers[1]["generated"]["tokens"]]


def test_probabilities_equal_a_full_forward(parts, answers):
    model, _, _ = parts
    for out in answers:
        g = out["generated"]
        probs = torch.softmax(full_forward(model, g["ids"]).double(), -1)  # (T, V)
        for t in g["tokens"]:
            row = probs[t["position"] - 1]  # the logits that chose the token at `position`
            assert t["query"] == t["position"] - 1
            assert t["prob"] == pytest.approx(float(row[t["id"]]), abs=1e-6)
            assert t["logprob"] == pytest.approx(float(row[t["id"]].log()), abs=1e-5)
            assert t["rank"] == int((row > row[t["id"]] + 1e-9).sum()) + 1
            assert [c["id"] for c in t["top"]] == row.topk(len(t["top"])).indices.tolist()
            for c in t["top"] + [t]:
                assert c["prob"] == pytest.approx(float(row[c["id"]]), abs=1e-6)
                assert c["calc"]["result"] == pytest.approx(c["prob"], abs=1e-6)  # recomputed from the numbers shown
                assert c["label"] == token_label(c["piece"])


def test_sampling_stages_are_the_samplers_at_each_step(parts, answers):
    model, _, _ = parts
    for s, out in zip(SETTINGS, answers):
        g = out["generated"]
        logits = full_forward(model, g["ids"])
        for t in g["tokens"]:
            smp, p = t["sampling"], t["position"]
            assert [st["name"] for st in smp["stages"]] == ["logits", "repetition_penalty", "temperature", "top_k",
                                                           "top_p", "min_p", "probs"]
            assert smp["chosen"] == t["id"] and all(len(st["ids"]) <= STAGE_IDS for st in smp["stages"])
            final = smp["stages"][-1]
            if s["temperature"] == 0:
                assert final["ids"] == [t["id"]] and smp["sampled"] == 1.0
                continue
            row = logits[p - 1][None]  # (1, V)
            seen = torch.zeros_like(row, dtype=torch.bool)
            seen[0, g["ids"][:p]] = True
            want = logits_to_probs(apply_repetition_penalty(row, seen, s["repetition_penalty"]), s["temperature"],
                                   s["top_k"], s["top_p"], s["min_p"])[0]
            assert final["ids"] == want.topk(len(final["ids"])).indices.tolist()
            assert final["probs"] == pytest.approx([float(want[i]) for i in final["ids"]], abs=1e-6)
            assert smp["sampled"] == pytest.approx(float(want[t["id"]]), abs=1e-6) and smp["sampled"] > 0
            assert smp["calc"][str(t["id"])]["result"] == pytest.approx(smp["sampled"], abs=1e-6)


def test_api_generate_answers_and_refuses_bad_input(parts, served):
    model, tok, _ = parts
    status, _, body = post_json(served, "/api/generate", {"text": PROMPT, "max_tokens": 5, "seed": 1, "temperature": 1.0})
    assert status == 200
    out = json.loads(body)
    assert [t["id"] for t in out["generated"]["tokens"]] == reference_tokens(model, tok, SETTINGS[0], 5)
    assert out["mode"] == "server" and out["labels"] == [token_label(p) for p in out["trace"]["tokens"]]
    long = "the king " * 25  # fits the context of 128 alone, not with 64 new tokens
    assert 64 < len(tok.encode(long)) < 128
    bad = [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": MAX_TOKENS + 1}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
           ({"temperature": "hot"}, "temperature"), ({"top_k": 0}, "top-k"), ({"top_p": 1.5}, "top-p"),
           ({"seed": -1}, "seed"), ({"seed": True}, "seed"), ({"steps": 3}, "unknown field"),
           ({"text": long, "max_tokens": 64}, "context"), ({"checkpoint": "step-000100"}, "--run"), ({"text": "   "}, "empty"), ({"text": 3}, "text")]
    for extra, words in bad:
        status, _, body = post_json(served, "/api/generate", {"text": PROMPT, **extra})
        assert status == 400, extra
        assert words in json.loads(body)["error"], (extra, body)
    status, _, body = post_json(served, "/api/generate", {"text": "a" * (MAX_TEXT + 1)})
    assert status == 413 and "limit" in json.loads(body)["error"]


def page_data(path) -> dict:
    page = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="glass-data">(.*?)</script>', page, re.S).group(1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-html") / "ckpt"
    model, tok = tiny_checkpoint(path, synthetic_text(200, 1))
    return path, model, tok


def test_generate_html_writes_the_page(checkpoint, tmp_path, capsys):
    path, model, tok = checkpoint
    out = tmp_path / "generated.html"
    prompt = "The king"
    argv = ["generate", "--checkpoint", str(path), "--prompt", prompt, "--seed", "3", "--max-new-tokens", "8",
            "--top-k", "50", "--html", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    want = list(generate(model, tok.encode(prompt), max_new_tokens=8, seed=3, top_k=50, stop=[tok.eot_id]))
    assert printed == prompt + tok.decode(want) + "\n"
    assert main(argv[:-2]) == 0 and capsys.readouterr().out == printed  # the same text without --html
    assert out.stat().st_size < 3_000_000  # a saved page of a 10-token text: about 2.5 MB
    data = page_data(out)
    g = data["generated"]
    assert data["mode"] == "static" and [t["id"] for t in g["tokens"]] == want
    assert data["trace"]["ids"] == tok.encode(prompt) + want and g["settings"]["top_k"] == 50
    probs = torch.softmax(full_forward(model, g["ids"]).double(), -1)
    assert [t["prob"] for t in g["tokens"]] == pytest.approx([float(probs[t["position"] - 1, t["id"]]) for t in g["tokens"]], abs=1e-6)


@pytest.mark.parametrize("extra, words", [
    (["--max-new-tokens", "200"], "at most 64"), (["--num-samples", "2"], "--num-samples 1"),
    (["--json"], "--json"), (["--max-new-tokens", "5", "--temperature", "-1"], "temperature")])
def test_generate_html_refuses(checkpoint, tmp_path, capsys, extra, words):
    path, _, _ = checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", PROMPT, "--html", str(tmp_path / "p.html")]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and err.count("\n") == 1
    assert not (tmp_path / "p.html").exists()
