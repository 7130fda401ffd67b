"""Log-probabilities against a full forward's log_softmax: the pure functions, the engine's new tokens and
prompt scoring (chunked or not), and `glassformer generate --logprobs K [--json]`."""

import json

import pytest
import torch

from glassformer import generate
from glassformer.cli import main
from glassformer.generation.batching import Engine, Request
from glassformer.generation.logprobs import LogitsTap, logprobs_of, prompt_logprobs

from ..support import tiny_checkpoint, tiny_model

K = 5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest on a busy machine


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def _full(model, ids) -> torch.Tensor:
    """log_softmax of one forward over the whole text, no cache: (T, V) float64 as the reference."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return torch.log_softmax(logits[0].double(), -1)


def _check(entry, ref_row: torch.Tensor, tok: int) -> None:
    assert entry.id == tok
    assert abs(entry.logprob - float(ref_row[tok])) < 1e-5
    values, ids = ref_row.topk(len(entry.top))
    assert [i for i, _ in entry.top] == ids.tolist()
    assert max(abs(a - float(b)) for (_, a), b in zip(entry.top, values)) < 1e-5


def test_pure_functions_are_the_raw_log_softmax():
    logits = torch.randn(3, 50, dtype=torch.bfloat16) * 4
    chosen = torch.tensor([0, 7, 49])
    ref = torch.log_softmax(logits.double(), -1)
    for e, row, c in zip(logprobs_of(logits, chosen, 3), ref, chosen.tolist()):
        _check(e, row, c)
    assert logprobs_of(logits, chosen, 0)[0].top == []
    ids = [4, 9, 2, 30]
    scored = prompt_logprobs(logits[:, :40].float(), ids, 2)  # 3 positions score ids[1:]
    assert [e.id for e in scored] == ids[1:] and len(scored) == 3
    assert prompt_logprobs(logits, [4], 2) == []


def test_new_tokens_logprobs_equal_a_full_forward_alone_and_batched(model):
    prompts = [[5, 17, 300, 2], [9], list(range(40, 63))]
    engine = Engine(model, max_batch=3)
    kws = [dict(temperature=0), dict(seed=3, top_k=20, temperature=1.5), dict(seed=4, repetition_penalty=1.4)]
    tickets = [engine.submit(Request(p, 10, logprobs=K, **kw)) for p, kw in zip(prompts, kws)]
    while engine.step():
        pass
    for p, kw, t in zip(prompts, kws, tickets):
        events = [e for e in t.events(timeout=5) if e.token is not None]
        toks = [e.token for e in events]
        assert toks == list(generate(model, p, max_new_tokens=10, **kw))
        ref = _full(model, p + toks)  # the raw distribution: no temperature, top-k or penalty in it
        for j, e in enumerate(events):
            _check(e.logprob, ref[len(p) - 1 + j], toks[j])


@pytest.mark.parametrize("chunk", [256, 6])
def test_prompt_scoring_equals_a_full_forward(model, chunk):
    prompt = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model, max_batch=2, prefill_chunk=chunk)
    score_only = engine.submit(Request(prompt, 0, prompt_logprobs=K))
    echo = engine.submit(Request(prompt, 3, temperature=0, prompt_logprobs=0, logprobs=0))
    while engine.step():
        pass
    (only,) = list(score_only.events(timeout=5))
    assert only.token is None and only.finish == "length" and len(only.prompt) == len(prompt) - 1
    ref = _full(model, prompt)
    for t, e in enumerate(only.prompt):
        _check(e, ref[t], prompt[t + 1])
    events = list(echo.events(timeout=5))
    assert [e.id for e in events[0].prompt] == prompt[1:] and all(e.prompt is None for e in events[1:])
    assert [e.token for e in events] == list(generate(model, prompt, max_new_tokens=3, greedy=True))


def test_logits_tap_sees_one_forward_per_token(model):
    with LogitsTap() as tap:
        toks = list(generate(model, [1, 2, 3], max_new_tokens=6, greedy=True))
    assert len(tap.logits) == 6
    assert [int(x.argmax()) for x in tap.logits] == toks


TEXT = "Now is the winter of our discontent made glorious summer. Café, naïve. " * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp") / "ckpt"
    m, tok = tiny_checkpoint(path, TEXT)
    return path, m, tok


def test_cli_json_lines(ckpt, capsys):
    path, m, tok = ckpt
    argv = ["generate", "--checkpoint", str(path), "--prompt", "Now is", "--max-new-tokens", "8", "--seed", "2",
            "--top-k", "30", "--logprobs", "3", "--json"]
    assert main(argv) == 0
    lines = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    prompt = tok.encode("Now is")
    toks = list(generate(m, prompt, max_new_tokens=8, seed=2, top_k=30, stop=[tok.eot_id]))
    assert [r["id"] for r in lines] == toks and {r["row"] for r in lines} == {0}
    ref = _full(m, prompt + toks)
    for j, r in enumerate(lines):
        assert set(r) == {"row", "id", "token", "bytes", "logprob", "top"}
        assert bytes(r["bytes"]) == tok.id_to_bytes(r["id"]) and r["token"] == tok.id_to_piece(r["id"])
        assert abs(r["logprob"] - float(ref[len(prompt) - 1 + j, r["id"]])) < 1e-5
        assert [t["id"] for t in r["top"]] == ref[len(prompt) - 1 + j].topk(3).indices.tolist()
        assert set(r["top"][0]) == {"id", "token", "logprob"}


def test_cli_table_and_batches(ckpt, capsys):
    path, m, tok = ckpt
    base = ["generate", "--checkpoint", str(path), "--prompt", "Now is", "--max-new-tokens", "5", "--greedy"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(plain) and "=== log-probabilities" in out  # the text unchanged, then the table
    assert len(out[len(plain):].splitlines()) == 2 + 5
    assert main(base + ["--num-samples", "2", "--json"]) == 0  # --json alone: K = 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["row"] for r in rows] == [0, 1] * 5 and all(r["top"] == [] for r in rows)
    assert main(base + ["--logprobs", "-1"]) == 2
    assert "--logprobs" in capsys.readouterr().err
