"""Every valid sampling setting gives a distribution, and non-finite logits an error (issue 42, item 4).

A property test over the whole valid range of temperature, top-k, top-p, min-p and the repetition
penalty, down to 5e-324 and up to 1.8e308, on logits with ties, large magnitudes and -inf entries:
the probabilities are finite and sum to 1, and the drawn token is one the stages keep. Then each
reproduction of the issue (generate --temperature 1e-45 printed 0 tokens; the server answered ""
to temperature 1e-40, top_p 1e-300 and repetition_penalty 1e-50; so did the explorer's generate),
and NaN logits from the model: an error naming them, never a silent token 0.
"""

from __future__ import annotations

import math
from unittest import mock

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glassformer import generate
from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.generation import sampling
from glassformer.generation.sampling import (NonFiniteLogits, apply_repetition_penalty, check_sampling, draw,
                                             logits_to_probs, sample, temperature_stage)
from glassformer.generation.sampling_stages import sampling_stages
from glassformer.viewer import source

from ..serve.served import KEY, NAME, Served
from ..support import tiny_checkpoint

INF = float("inf")
F32_MAX = torch.finfo(torch.float32).max
TINY = [5e-324, 1e-320, 1e-300, 1e-50, 1e-45, 1e-40, 1.1e-38]  # below float32's normal numbers, most below all of it

temperatures = st.one_of(st.sampled_from([0.0, *TINY, 1e-30, 1e-6, 0.7, 1.0, 1.5, 1e30, 3.5e38, 1e300, 1.7e308]),
                         st.floats(0, 1.7e308))
top_ks = st.one_of(st.none(), st.integers(1, 30))
top_ps = st.one_of(st.none(), st.sampled_from([*TINY, 0.5, 1.0]), st.floats(5e-324, 1.0))
min_ps = st.one_of(st.none(), st.sampled_from([0.0, *TINY, 0.5, 1.0]), st.floats(0.0, 1.0))
penalties = st.one_of(st.sampled_from([*TINY, 1e-7, 0.3, 1.0, 1.3, 1e7, 1e50, 1e300, 1.7e308]),
                      st.floats(5e-324, 1.7e308))
values = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.5, F32_MAX, -F32_MAX, 1e30, -1e30, 1e-40, -INF]),
                   st.floats(-F32_MAX, F32_MAX, width=32))


@st.composite
def logit_rows(draw_):
    """(B, V) float32 logits, each row with at least one finite entry, and a seen mask (B, V)."""
    B, V = draw_(st.integers(1, 3)), draw_(st.integers(1, 24))
    rows = [draw_(st.lists(values, min_size=V, max_size=V)) for _ in range(B)]
    for r in rows:
        if all(x == -INF for x in r):
            r[draw_(st.integers(0, V - 1))] = draw_(st.floats(-F32_MAX, F32_MAX, width=32))
    seen = [draw_(st.lists(st.booleans(), min_size=V, max_size=V)) for _ in range(B)]
    return torch.tensor(rows, dtype=torch.float32), torch.tensor(seen)


def as_on(device: str):
    """The sampler as it runs on `device`, on the CPU: on a GPU each row is settled by tensor operations
    (no read back, no sync); MPS has no float64 either."""
    return mock.patch.multiple(sampling, _has_f64=lambda x: device != "mps",
                               _all_numbers=(lambda values, finite: None) if device != "cpu" else sampling._all_numbers)


@pytest.mark.parametrize("device", ["cpu", "cuda", "mps"])
@given(zs=logit_rows(), T=temperatures, k=top_ks, p=top_ps, m=min_ps, r=penalties, seed=st.integers(0, 2 ** 32))
def test_every_valid_setting_gives_a_distribution_and_a_kept_token(device, zs, T, k, p, m, r, seed):
    with as_on(device):
        check_every_valid_setting(zs, T, k, p, m, r, seed)


def check_every_valid_setting(zs, T, k, p, m, r, seed):
    z, seen = zs
    check_sampling(T, k, p, m, r)  # all valid
    pen = apply_repetition_penalty(z, seen, r)
    assert torch.equal(torch.isfinite(pen), torch.isfinite(z))  # finite stays finite, -inf stays -inf
    g = torch.Generator().manual_seed(seed)
    token = sample(pen, temperature=T, top_k=k, top_p=p, min_p=m, generator=g)  # (B,)
    rows = torch.arange(z.shape[0])
    if T == 0:
        assert torch.equal(pen[rows, token], pen.max(-1).values)
        return
    probs = logits_to_probs(pen, T, k, p, m)  # (B, V)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.double().sum(-1), torch.ones(z.shape[0], dtype=torch.float64), atol=1e-5)
    assert (probs[z == -INF] == 0).all()  # a masked token stays masked
    assert (probs[rows, token] > 0).all()  # the drawn token is one the stages keep
    # The explorer's stages of the first row: numbers JSON can carry, the draw among the kept ids.
    out = sampling_stages(z[0], torch.nonzero(seen[0]).flatten().tolist(), T, k, p, m, r, seed=seed)
    assert out["chosen"] in out["stages"][-1]["ids"]
    assert all(math.isfinite(x) for s in out["stages"] for x in s["probs"] + [s["rest"]])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_temperature_whose_quotient_overflows_is_greedy_first_of_ties(device):
    with as_on(device):
        check_overflow_is_greedy()


def check_overflow_is_greedy():
    z = torch.tensor([[1.0, 3e9, 3e9, -2.0], [-1e9, -5e9, -1e9, -INF]])  # over 1e-300: +1e309, -1e309
    assert torch.equal(temperature_stage(z, 1e-300).isfinite(), torch.tensor([[False, True, False, False],
                                                                             [True, False, False, False]]))
    for T in (1e-300, 5e-324):
        assert draw(z, temperature=T).tolist() == [1, 0]
        assert torch.equal(logits_to_probs(z, T), torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64))
    # float32 arithmetic (T in its normal range) overflows at 3.4e38: a logit of 1e9 over 1e-30.
    assert draw(torch.tensor([[0.0, 1e9, 2e9]]), temperature=1e-30).tolist() == [2]
    # A tiny top_p keeps exactly the most likely token.
    assert torch.equal(logits_to_probs(torch.tensor([[0.0, 2.0, 1.0]]), top_p=1e-300), torch.tensor([[0.0, 1, 0]]))


def test_a_tiny_or_huge_penalty_keeps_the_order_of_the_seen_logits():
    z = torch.tensor([[2.0, 3.0, -1.0, -0.5, 1.0]])
    seen = torch.tensor([[True, True, True, True, False]])
    low = apply_repetition_penalty(z, seen, 1e-50)  # seen positives far above all, seen negatives near 0
    assert low.dtype == torch.float64 and low[0].argsort().tolist() == [2, 3, 4, 0, 1]
    assert sample(low).tolist() == [1]  # the largest seen positive logit, certain
    high = apply_repetition_penalty(z, seen, 1e300)
    assert high[0].argsort().tolist() == [2, 3, 0, 1, 4] and torch.isfinite(high).all()
    # In float32 (as Hugging Face), a result past float32's range saturates instead of overflowing.
    assert apply_repetition_penalty(torch.tensor([[-3e38, 2e38]]), torch.tensor([[True, True]]), 1.5).tolist() == \
        [[-F32_MAX, pytest.approx(2e38 / 1.5)]]


@pytest.mark.parametrize("bad", [
    ([[float("nan"), 1.0, 2.0]]), ([[1.0, INF, 0.0]]), ([[-INF, -INF, -INF]]),
])
@pytest.mark.parametrize("T", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_logits_that_are_not_finite_are_an_error_never_token_0(bad, T, device):
    logits = torch.tensor(bad + [[0.0, 300.0, 1.0]])  # the bad row, and a good one (token 1, certain)
    with as_on(device):
        assert draw(logits, temperature=T).tolist() == [-1, 1]
    with pytest.raises(NonFiniteLogits, match="the model's logits are not finite"):
        sample(logits, temperature=T)
    with pytest.raises(NonFiniteLogits):
        sampling_stages(logits[0], [], temperature=T)


@pytest.mark.parametrize("kw, words", [
    (dict(temperature=INF), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=INF), "top-k"), (dict(top_k=float("nan")), "top-k"),
    (dict(top_p=float("nan")), "top-p"), (dict(min_p=float("nan")), "min-p"),
    (dict(repetition_penalty=INF), "repetition penalty"), (dict(repetition_penalty=float("nan")), "repetition penalty"),
])
def test_settings_that_are_not_finite_are_refused_by_name(kw, words):
    with pytest.raises(UserError, match=words):
        check_sampling(**kw)


# ----------------------------------------------------------------------------- the reproductions

TEXT = "Now is the winter of our discontent made glorious summer by this sun of York. " * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("range") / "ckpt"
    model, tok = tiny_checkpoint(path, TEXT)
    return path, model, tok


def _generate(path, *flags) -> list[str]:
    return ["generate", "--checkpoint", str(path), "--prompt", "Now is", "--max-new-tokens", "12", "--seed", "3",
            *flags]


@pytest.mark.parametrize("flags", [("--temperature", "1e-45"), ("--top-p", "1e-300")])
def test_generate_with_a_tiny_temperature_or_top_p_prints_the_greedy_text(ckpt, capsys, flags):
    path = ckpt[0]
    assert main(_generate(path, "--greedy")) == 0
    greedy = capsys.readouterr()
    assert main(_generate(path, *flags)) == 0
    got = capsys.readouterr()
    assert got.out == greedy.out and len(got.out) > len("Now is\n") + 5  # was "Now is" and "0 tokens"
    assert "12 tokens" in got.err


def test_generate_with_a_tiny_penalty_draws_from_the_exact_distribution(ckpt):
    _, model, tok = ckpt
    ids = tok.encode("Now is")
    r = 1e-50
    got = list(generate(model, ids, max_new_tokens=12, repetition_penalty=r, seed=3))
    assert len(got) == 12
    text = list(ids)
    for t in got:  # the float64 reference: CTRL's rule on the full forward's last logits
        with torch.no_grad():
            z = model(torch.tensor([text]))[0][0, -1].double()  # (V,)
        seen = torch.zeros_like(z, dtype=torch.bool)
        seen[text] = True
        p = torch.softmax(torch.where(seen, torch.where(z > 0, z / r, z * r), z), -1)
        assert p[t] > 1e-3, (t, float(p[t]))
        text.append(t)


@pytest.mark.parametrize("flag, words", [
    ("--temperature", "temperature must be >= 0 (0 means greedy) and finite"),
    ("--repetition-penalty", "repetition penalty must be > 0 (1 means none) and finite"),
])
def test_generate_refuses_an_infinite_setting_by_name(ckpt, capsys, flag, words):
    assert main(_generate(ckpt[0], flag, "inf")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {words}, got inf") and "Traceback" not in err


def test_generate_refuses_nan_logits_with_one_line(ckpt, tmp_path, capsys):
    from glassformer.checkpoint.folders import save_model

    _, model, tok = ckpt
    broken = type(model)(model.config).eval()
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.final_norm.weight.fill_(float("nan"))
    save_model(tmp_path / "nan", broken, tok)
    for flags in (("--greedy",), ("--temperature", "0.8"), ("--temperature", "1e-45")):
        assert main(_generate(tmp_path / "nan", *flags)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the model's logits are not finite") and "Traceback" not in err


@pytest.fixture(scope="module")
def served():
    s = Served(max_batch=2, engine="thread")
    yield s
    s.stop()


def _completion(s: Served, **kw) -> httpx.Response:
    ids = s.tok.encode("The king")
    return httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 8, "seed": 5, **kw},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _text(s: Served, tokens) -> str:
    return s.tok.decode([t for t in tokens if t not in s.eos])


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(top_p=1e-300)])
def test_the_server_answers_a_tiny_temperature_or_top_p_with_the_greedy_text(served, kw):
    ids = served.tok.encode("The king")
    want = _text(served, generate(served.model, ids, max_new_tokens=8, greedy=True, stop=served.eos))
    r = _completion(served, **kw)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == want and want  # was "" with finish_reason "stop"


def test_the_server_answers_a_tiny_penalty_with_generates_tokens(served):
    ids = served.tok.encode("The king")
    want = _text(served, generate(served.model, ids, max_new_tokens=8, repetition_penalty=1e-50, seed=5,
                                  stop=served.eos))
    r = _completion(served, repetition_penalty=1e-50)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want and want


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, stream=True)])
def test_nan_logits_from_the_model_are_a_500_not_an_empty_completion(served, kw):
    head = served.engine.model.lm_head
    hook = head.register_forward_hook(lambda module, args, out: torch.full_like(out, float("nan")))
    try:
        r = _completion(served, **kw)
        if kw.get("stream"):
            assert r.status_code == 200 and "server_error" in r.text and '"text":""' not in r.text.replace(" ", "")
        else:
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    finally:
        hook.remove()
    assert _completion(served, **kw).status_code == 200  # the model mended, the server goes on


def test_the_explorers_generate_with_a_tiny_temperature(ckpt):
    _, model, tok = ckpt
    explorer = source.explorer(model, tok, "Now is", model_name="tiny")
    greedy = list(generate(model, tok.encode("Now is"), max_new_tokens=6, stop=[tok.eot_id], greedy=True))
    settings = dict(temperature=1e-40, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0, seed=0)
    g = explorer.generation("Now is", 6, settings)["generated"]
    assert [t["id"] for t in g["tokens"]] == greedy and greedy
    for t in g["tokens"]:
        smp = t["sampling"]
        assert smp["sampled"] == 1.0 and smp["stages"][-1]["ids"] == [t["id"]]
        assert smp["calc"][str(t["id"])]["result"] == pytest.approx(1.0)


def test_the_explorer_answers_nan_logits_with_a_500_that_says_so(ckpt):
    from glassformer.viewer.server import make_server

    _, model, tok = ckpt
    broken = type(model)(model.config).eval()
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.final_norm.weight.fill_(float("nan"))
    server = make_server(source.explorer(broken, tok, "Now is", model_name="tiny"), port=0)
    server.start_in_thread()
    try:
        for path, body in (("/api/generate", {"text": "Now is", "max_tokens": 3, "temperature": 0.8}),
                           ("/api/sample", {"text": "Now is", "position": 1, "temperature": 0})):
            r = httpx.post(server.url + path, json=body, timeout=60)
            assert r.status_code == 500 and r.json()["error"].startswith("the model's logits are not finite"), path
    finally:
        server.stop()


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("sampling_kw", [dict(greedy=True), dict(temperature=0.8), dict(temperature=1e-45, top_p=1e-300)])
def test_a_session_refuses_logits_that_turn_nan_midway(ckpt, run_ahead, sampling_kw):
    """The tokens before the NaN step are the normal ones; then the error (a step queued ahead of the
    host feeds no -1 to the embedding: the error is NonFiniteLogits, not an index error)."""
    from glassformer.generation.session import Session

    _, model, tok = ckpt
    ids = tok.encode("Now is")
    want = list(Session(model, run_ahead=run_ahead).send(ids, max_new_tokens=8, seed=1, **sampling_kw))
    calls = []

    def nan_from_the_fourth(module, args, out):
        calls.append(1)
        return torch.full_like(out, float("nan")) if len(calls) >= 4 else out

    hook = model.lm_head.register_forward_hook(nan_from_the_fourth)
    got = []
    try:
        with pytest.raises(NonFiniteLogits):
            for t in Session(model, run_ahead=run_ahead).send(ids, max_new_tokens=8, seed=1, **sampling_kw):
                got.append(t)
    finally:
        hook.remove()
    assert got == want[:3]
