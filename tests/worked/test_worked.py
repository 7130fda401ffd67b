"""The toy model of the hand-calculation walkthrough reproduces every figure it prints."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from glassformer.worked import model as worked
from glassformer.worked.figures import figures
from glassformer.cli import main
from glassformer.errors import UserError

from ..support import WORKED_FIGURES

DATA = WORKED_FIGURES


class Printed(float):
    """A float that remembers the digits it was printed with."""

    tol: float


def _printed(text: str) -> Printed:
    x = Printed(text)
    x.tol = float(Decimal("0.5") * Decimal(10) ** Decimal(text).as_tuple().exponent)  # half a unit of the last digit
    return x


def _reference() -> dict:
    return json.loads(DATA.read_text(), parse_float=_printed)


def _compare(ref, got, path: str, checked: list) -> None:
    if isinstance(ref, dict):
        assert isinstance(got, dict), path
        assert set(got) == set(ref), f"{path}: keys differ: {sorted(set(got) ^ set(ref))}"
        for k in ref:
            _compare(ref[k], got[k], f"{path}.{k}", checked)
    elif isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref), f"{path}: {got!r} vs {ref!r}"
        for i, (r, g) in enumerate(zip(ref, got)):
            _compare(r, g, f"{path}[{i}]", checked)
    elif isinstance(ref, str):
        assert got == ref, f"{path}: prose differs: {got!r} vs {ref!r}"
    else:
        assert isinstance(got, (int, float)) and not isinstance(got, bool), f"{path}: {got!r} is not a number"
        tol = ref.tol if isinstance(ref, Printed) else 0.005  # whole numbers to 0.005
        assert abs(got - ref) <= tol, f"{path}: {got} is not {ref} to ±{tol}"
        checked.append(path)


def _count_numbers(x) -> int:
    if isinstance(x, dict):
        return sum(_count_numbers(v) for v in x.values())
    if isinstance(x, list):
        return sum(_count_numbers(v) for v in x)
    return 0 if isinstance(x, str) else 1


def test_every_figure_of_the_walkthrough_to_its_printed_digits(capsys):
    assert main(["worked", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    checked: list[str] = []
    _compare(_reference(), got, "", checked)
    assert len(checked) == _count_numbers(_reference()) == 149  # every number of the file was reached


def test_figures_come_from_the_model_not_from_the_file(monkeypatch):
    """Change one printed weight and the figures that depend on it move (so nothing is copied)."""
    base = figures()
    monkeypatch.setattr(worked, "W_O", [[1, 0, 0, 0.5], [0, 1, -0.5, 0]])
    moved = figures()
    assert moved["head0"]["attention_output_cats"] == base["head0"]["attention_output_cats"]
    assert moved["head0"]["attention_result_after_W_O_cats"][2] == pytest.approx(
        -base["head0"]["attention_result_after_W_O_cats"][2], abs=1e-6)
    assert moved["two_blocks_prenorm_rms_cats"][3] != pytest.approx(base["two_blocks_prenorm_rms_cats"][3], abs=1e-3)


def _rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _turn(v: torch.Tensor, p: int) -> torch.Tensor:
    c, s = math.cos(p), math.sin(p)
    return torch.stack([v[..., 0] * c - v[..., 1] * s, v[..., 0] * s + v[..., 1] * c], -1)


def test_one_head_model_matches_the_formulas_in_float64():
    """An independent forward pass written from the formulas, on the same constant matrices."""
    M = {k: torch.tensor(getattr(worked, k), dtype=torch.float64)
         for k in ("EMBEDDING", "W_Q", "W_K", "W_V", "W_O", "W_UP", "W_DOWN")}
    ids = worked.encode(worked.SENTENCE)
    x = M["EMBEDDING"][ids]  # (T, D)
    T = len(ids)
    n = _rmsnorm(x)
    q, k, v = n @ M["W_Q"], n @ M["W_K"], n @ M["W_V"]  # (T, H)
    qr = torch.stack([_turn(q[t], t) for t in range(T)])
    kr = torch.stack([_turn(k[t], t) for t in range(T)])
    s = (qr @ kr.T) / math.sqrt(2)  # (T, T)
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    z = torch.softmax(s, -1) @ v
    h = x + z @ M["W_O"]
    y = h + torch.relu(_rmsnorm(h) @ M["W_UP"]) @ M["W_DOWN"]

    p = worked.run(worked.build_one_head(), ids)
    for name, want in (("blocks.0.attn.q_rot", qr), ("blocks.0.attn.k_rot", kr), ("blocks.0.attn.z", z),
                       ("blocks.0.resid_mid", h), ("blocks.0.resid_out", y)):
        assert torch.allclose(p[name].double().reshape(want.shape), want, atol=1e-5), name


def test_gqa_and_mqa_keys_are_the_means_of_the_mha_keys():
    ids = worked.encode(worked.SENTENCE)
    k_mha = worked.run(worked.build_four_heads(), ids)["blocks.0.attn.k"]  # (T, 4, H)
    k_gqa = worked.run(worked.build_gqa(), ids)["blocks.0.attn.k"]  # (T, 2, H)
    k_mqa = worked.run(worked.build_mqa(), ids)["blocks.0.attn.k"]  # (T, 1, H)
    assert torch.allclose(k_gqa[:, 0], k_mha[:, :2].mean(1), atol=1e-6)
    assert torch.allclose(k_gqa[:, 1], k_mha[:, 2:].mean(1), atol=1e-6)
    assert torch.allclose(k_mqa[:, 0], k_mha.mean(1), atol=1e-6)
    # Head 0 of the four-head model is the one-head model's head.
    one = worked.run(worked.build_one_head(), ids)
    assert torch.allclose(k_mha[:, 0], one["blocks.0.attn.k"][:, 0])


def test_word_tokenizer():
    tok = worked.WordTokenizer()
    assert tok.encode("I like cats too") == [0, 2, 3, 5]
    assert tok.encode(["you", "like", "DOGS"]) == [1, 2, 4]
    assert tok.decode([1, 2, 4]) == "you like dogs"
    assert tok.vocab_size == 6 and tok.id_to_piece(5) == "too"
    with pytest.raises(UserError, match="unknown word 'birds'.*I, you, like, cats, dogs, too"):
        tok.encode("I like birds")
    with pytest.raises(UserError, match="no words"):
        tok.encode("   ")


def test_saved_tokenizer_json_encodes_like_the_word_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    worked.TOKENIZER.save(tmp_path / "tokenizer.json")
    tk = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "I like cats too you dogs"
    assert tk.encode(text).ids == worked.encode(text)
    assert tk.decode(worked.encode(text)) == text
    assert tk.get_vocab_size() == worked.TOKENIZER.vocab_size


def test_load_worked():
    model, tok = worked.load_worked("gqa")
    assert model.config.n_kv_heads == 2 and tok is worked.TOKENIZER
    with pytest.raises(UserError, match="one_head"):
        worked.load_worked("huge")


def test_other_sentences_run_through_every_toy_model():
    ids = worked.encode("you like dogs too I")
    for name, build in worked.MODELS.items():
        logits, _ = build()(torch.tensor([ids]))
        assert logits.shape == (1, 5, 6) and torch.isfinite(logits).all(), name


def test_printout_has_every_section(capsys):
    assert main(["worked"]) == 0
    out = capsys.readouterr().out
    for n in range(1, 15):
        assert f"\n{n}. " in out
    assert "1.00 -> 1.11 -> 1.52 -> 1.87 -> 2.26" in out
    assert "o = [-0.425, 0.724]" in out


def test_html_without_a_viewer_is_a_clear_error(capsys):
    try:
        from glassformer.viewer import write_worked_html  # noqa: F401
    except ImportError:
        assert main(["worked", "--html", "never-written.html"]) == 2
        assert capsys.readouterr().err.startswith("error: --html needs the explorer page")
        assert not Path("never-written.html").exists()
    else:
        pytest.skip("the viewer is installed; its own tests cover the page")
