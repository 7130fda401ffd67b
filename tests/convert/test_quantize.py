"""int8 weights (per output channel, symmetric): the math against an independent reference, greedy
decoding against the quantized model's own full forward, the stored format, closeness to fp32,
and the CLI (convert --quantize, generate --quantize, bad types)."""

import json

import numpy as np
import pytest
import torch

from glassformer.checkpoint.folders import save_model
from glassformer.checkpoint.loading import load
from glassformer.cli import main
from glassformer.convert import quantize as qz
from glassformer.convert.quantize import INT8, Int8Linear, int8_per_channel, quantize_int8
from glassformer.generation.session import Session, generate

from ..support import greedy_by_full_forward, synthetic_text, tiny_checkpoint, tiny_model

PROMPT, STEPS = [1, 2, 3, 4], 10
PROJECTIONS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_up", "ffn.w_down")


def _reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row in numpy: scale = max|row| / 127 (1 for a zero row), q = round(row / scale) in [-127, 127]."""
    qs, scales = [], []
    for row in w.astype(np.float64):
        m = float(np.max(np.abs(row)))
        s = m / 127 if m > 0 else 1.0
        qs.append(np.clip(np.rint(row / s), -127, 127))
        scales.append(s)
    return np.array(qs, dtype=np.int64), np.array(scales)


def test_per_channel_math_matches_an_independent_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(12, 40, generator=g) * torch.logspace(-3, 1, 12)[:, None]  # rows of very different sizes
    w[5] = 0.0  # a zero row: scale 1, q all zero
    q, scale = int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == (12, 40) and scale.dtype == torch.float32 and scale.shape == (12,)
    rq, rs = _reference(w.numpy())
    np.testing.assert_allclose(scale.numpy(), rs, rtol=1e-6)
    assert (np.abs(q.numpy().astype(np.int64) - rq) <= 1).all()  # a tie may round either way in fp32
    assert (q.numpy().astype(np.int64) == rq).mean() > 0.99
    assert scale[5] == 1 and (q[5] == 0).all()
    nonzero = [i for i in range(12) if i != 5]
    assert (q[nonzero].abs().amax(1) == 127).all()  # each row's largest entry maps to ±127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round to nearest: half a step at most


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_multiplies_by_scale_times_q(rows, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=bias)
    m = Int8Linear.from_linear(lin)
    x = torch.randn(1, rows, 48)
    want = torch.nn.functional.linear(x.double(), m.dequantized().double(), None if not bias else lin.bias.double())
    with torch.no_grad():
        got = m(x)
    assert got.shape == (1, rows, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_compiled_form_and_the_fallback_give_the_kernels_product(monkeypatch):
    torch.manual_seed(1)
    m = Int8Linear.from_linear(torch.nn.Linear(32, 24))
    with torch.no_grad():
        eager = [m(torch.ones(1, r, 32) * 0.5) for r in (1, 5)]
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the cast forms, run eagerly
        cast = [m(torch.ones(1, r, 32) * 0.5) for r in (1, 5)]
    for a, b in zip(eager, cast):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        f64 = m.double()(torch.ones(1, 5, 32, dtype=torch.float64) * 0.5)  # a dtype the kernel refuses
    torch.testing.assert_close(f64.float(), eager[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_every_projection_and_an_untied_head_are_replaced(tie):
    model = quantize_int8(tiny_model(n_layers=2, tie_embeddings=tie))
    for b in model.blocks:
        for path in PROJECTIONS:
            assert isinstance(b.get_submodule(path), Int8Linear), path
    assert isinstance(model.lm_head, Int8Linear) != tie
    if tie:
        assert model.lm_head.weight is model.embed.weight
    assert model.embed.weight.dtype == torch.float32
    assert model.config.quantization == {"method": "int8_weight_only", "granularity": "per_channel"}
    sd = model.state_dict()
    assert sd["blocks.0.attn.wq.weight"].dtype == torch.int8 and sd["blocks.0.attn.wq.weight"].shape == (64, 64)
    assert sd["blocks.1.ffn.w_down.weight_scale"].dtype == torch.float32
    assert sd["blocks.1.ffn.w_down.weight_scale"].shape == (model.config.dim,)
    assert ("lm_head.weight_scale" in sd) != tie


def test_greedy_decoding_equals_the_int8_models_own_full_forward():
    fp32 = tiny_model(n_layers=2)
    plain = list(generate(fp32, PROMPT, max_new_tokens=STEPS, greedy=True))  # installs glassformer.speed
    model = quantize_int8(fp32)
    want = greedy_by_full_forward(model, PROMPT, STEPS)
    assert list(generate(model, PROMPT, max_new_tokens=STEPS, greedy=True)) == want
    prompts = [PROMPT, [7, 8]]
    steps = list(Session(model, 2).send(prompts, max_new_tokens=STEPS, greedy=True))
    assert [[s[b] for s in steps] for b in range(2)] == [greedy_by_full_forward(model, p, STEPS) for p in prompts]
    assert len(plain) == STEPS


@pytest.mark.slow
def test_compiled_greedy_decoding_equals_the_full_forward():
    model = quantize_int8(tiny_model(n_layers=2))
    steps = list(Session(model, 1, compile=True).send(PROMPT, max_new_tokens=6, greedy=True))
    assert steps == greedy_by_full_forward(model, PROMPT, 6)


def test_the_stored_format_round_trips(tmp_path):
    model = quantize_int8(tiny_model(n_layers=2))
    save_model(tmp_path / "q", model)
    meta = json.loads((tmp_path / "q" / "config.json").read_text())
    assert meta["model"]["quantization"] == INT8
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    assert stored["blocks.0.ffn.w_up.weight"].dtype == torch.int8
    assert stored["lm_head.weight_scale"].dtype == torch.float32
    back, _ = load(tmp_path / "q")
    assert isinstance(back.blocks[1].attn.wo, Int8Linear) and back.config.quantization == INT8
    ids = torch.tensor([[5, 9, 2, 44, 3, 17]])
    with torch.no_grad():
        assert torch.equal(model(ids)[0], back(ids)[0])
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k


def test_logits_close_to_fp32_on_a_small_model():
    # Per element the weight moves by at most half a step, max|row|/254; for a Gaussian row of 64
    # that is under 1% of the row's size, and the errors of 2 layers' 7 products add mostly at
    # random, so 3% relative (Frobenius) on the logits is a bound a real bug (a wrong scale, a
    # transposed q, a lost bias) exceeds many times over.
    fp32 = tiny_model(n_layers=2)
    ids = torch.tensor([list(range(1, 33))])
    with torch.no_grad():
        ref = fp32(ids)[0]
        got = quantize_int8(fp32)(ids)[0]
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.03
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_held_out_loss_within_one_percent_of_fp32_on_a_trained_model():
    ids = torch.tensor(list(synthetic_text(400, seed=1).encode())) % 256
    model = tiny_model(n_layers=2, vocab_size=256, max_seq_len=64).train()
    opt, g, n = torch.optim.AdamW(model.parameters(), lr=3e-3), torch.Generator().manual_seed(0), len(ids) * 9 // 10
    for _ in range(100):
        i = torch.randint(0, n - 65, (16,), generator=g).tolist()
        x, y = torch.stack([ids[j:j + 64] for j in i]), torch.stack([ids[j + 1:j + 65] for j in i])
        _, loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    val = ids[n:]
    B = (len(val) - 1) // 64
    x, y = val[:B * 64].view(B, 64), val[1:B * 64 + 1].view(B, 64)
    with torch.no_grad():
        before = model.eval()(x, targets=y)[1].item()
        after = quantize_int8(model)(x, targets=y)[1].item()
    assert before < 2.0  # it learned something (uniform over 256 bytes is 5.5 nats)
    assert abs(after - before) / before < 0.01  # the loss, hence bpb, within 1%


TEXT = "Now is the winter of our discontent made glorious summer by this sun of York. " * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("q8") / "ckpt"
    model, tok = tiny_checkpoint(path, TEXT)
    return path, tok


def _generated(capsys, *args) -> str:
    assert main(["generate", "--prompt", "Now is", "--greedy", "--max-new-tokens", "12", *args]) == 0
    return capsys.readouterr().out


def test_convert_and_generate_quantize_give_the_same_model(ckpt, tmp_path, capsys):
    path, tok = ckpt
    assert main(["convert", "--quantize", "int8", "--checkpoint", str(path), "--out", str(tmp_path / "q8")]) == 0
    assert "int8" in capsys.readouterr().out
    stored, _ = load(tmp_path / "q8")
    assert stored.config.quantization == INT8
    assert (tmp_path / "q8" / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    on_the_fly = _generated(capsys, "--checkpoint", str(path), "--quantize", "int8")
    from_stored = _generated(capsys, "--checkpoint", str(tmp_path / "q8"))
    again = _generated(capsys, "--checkpoint", str(tmp_path / "q8"), "--quantize", "int8")  # already int8: as is
    assert on_the_fly == from_stored == again
    ids = list(generate(stored, tok.encode("Now is"), max_new_tokens=12, greedy=True, stop=[tok.eot_id]))
    assert from_stored.startswith("Now is") and from_stored.strip() == ("Now is" + tok.decode(ids)).strip()


def test_unknown_quantization_is_refused_by_name_and_nothing_written(ckpt, tmp_path, capsys):
    path, _ = ckpt
    assert main(["convert", "--quantize", "int4", "--checkpoint", str(path), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "int4" in err and "int8" in err
    assert not (tmp_path / "x").exists()
    assert main(["generate", "--checkpoint", str(path), "--prompt", "Now", "--quantize", "int4"]) == 2
    err = capsys.readouterr().err
    assert "int4" in err and "int8" in err
    assert main(["convert", "--quantize", "int8", "--out", str(tmp_path / "y")]) == 2
    assert "--checkpoint" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_a_quantized_checkpoint_is_refused_where_float_weights_are_needed(ckpt, tmp_path, capsys):
    path, _ = ckpt
    assert main(["convert", "--quantize", "int8", "--checkpoint", str(path), "--out", str(tmp_path / "q8")]) == 0
    for argv in (["--to-hf", str(tmp_path / "q8")], ["--kv-heads", "1", "--checkpoint", str(tmp_path / "q8")]):
        assert main(["convert", *argv, "--out", str(tmp_path / "z")]) == 2
        assert "int8_weight_only" in capsys.readouterr().err and not (tmp_path / "z").exists()


def test_a_stored_quantization_this_version_cannot_read_is_refused(tmp_path):
    model = quantize_int8(tiny_model(n_layers=1))
    save_model(tmp_path / "q", model)
    meta = json.loads((tmp_path / "q" / "config.json").read_text())
    meta["model"]["quantization"] = {"method": "int4_weight_only", "granularity": "per_group"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(qz.UserError, match="int4_weight_only"):
        load(tmp_path / "q")


def test_an_eager_decode_step_never_makes_a_float_copy_of_a_weight():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names, self.shapes = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.names.append(str(func))
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                self.shapes.append(tuple(out.shape))
            return out

    model = quantize_int8(tiny_model(n_layers=1))
    weights = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Int8Linear)}
    with torch.no_grad(), Ops() as ops:
        model(torch.tensor([[3]]))
    assert sum("_weight_int8pack_mm" in n for n in ops.names) == 8  # 7 projections and the head
    assert not weights & set(ops.shapes)  # no float (out, in) tensor was made


def test_eval_quantize_scores_the_int8_model(ckpt, tmp_path, capsys, monkeypatch):
    path, _ = ckpt
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # eval's --threads would outlive the test
    (tmp_path / "t.txt").write_text(TEXT)
    argv = ["eval", "--data", str(tmp_path / "t.txt"), "--threads", "1", "--batch-size", "2"]

    def score(*extra) -> dict:
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    fp32 = score("--checkpoint", str(path))
    on_the_fly = score("--checkpoint", str(path), "--quantize", "int8")
    assert main(["convert", "--quantize", "int8", "--checkpoint", str(path), "--out", str(tmp_path / "q8")]) == 0
    capsys.readouterr()
    assert score("--checkpoint", str(tmp_path / "q8")) == on_the_fly
    assert on_the_fly["bpb"] != fp32["bpb"]  # it really scored other weights
    assert on_the_fly["bpb"] == pytest.approx(fp32["bpb"], rel=0.03)  # random weights: the logits bound's 3%


def test_a_cast_model_keeps_fp32_scales_and_runs_in_bfloat16():
    model = quantize_int8(tiny_model(n_layers=1))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = model(ids)[0]
        half = model.to(torch.bfloat16)
        assert half.blocks[0].attn.wq.weight_scale.dtype == torch.float32
        assert half.blocks[0].attn.wq.weight.dtype == torch.int8 and half.embed.weight.dtype == torch.bfloat16
        got = half(ids)[0]
        step = half(ids[:, :1])[0]  # one row: the kernel, in bf16
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()) < 0.05  # bf16 activations: about 3 digits
    assert ((step.float() - want[:, :1]).norm() / want[:, :1].norm()) < 0.05


def test_num_params_counts_int8_weights():
    for tie in (False, True):
        fp32 = tiny_model(n_layers=2, tie_embeddings=tie)
        n, n_body = fp32.num_params(), fp32.num_params(non_embedding=True)
        q = quantize_int8(fp32)
        assert not any(p.dtype == torch.int8 for p in q.parameters())  # they are buffers: the count must look there
        assert (q.num_params(), q.num_params(non_embedding=True)) == (n, n_body)


# ----------------------------------------------------------------------------- trace and explain


EXPLAINED = ("blocks.0.attn.q", "blocks.1.attn.k", "blocks.0.attn.v", "blocks.1.attn.out", "blocks.0.ffn.up",
             "blocks.1.ffn.gate", "blocks.0.ffn.down", "logits")


@pytest.fixture(scope="module")
def int8_model():
    from ..support import reinit

    return quantize_int8(reinit(tiny_model(n_layers=2, bias=True), std=0.3, seed=2))  # large weights, biases too


def _scale_times_q(e, model) -> None:
    """The last step is s[col]·(Σ x·q) (+ b): its first term the stored scale and the step of the int8 sum."""
    last, dot = e.steps[-1], e.steps[-2]
    scale, ref = last["terms"][0]
    assert scale["source"] == "weight" and scale["name"].endswith(".weight_scale") and ref["source"] == "step"
    q_name = scale["name"][: -len("_scale")]
    col = scale["index"][0]
    assert scale["value"] == float(model.state_dict()[scale["name"]][col])
    for term in dot["terms"]:
        q = term[1]
        assert q["name"] == q_name and q["index"][1] == col
        assert q["value"] == int(q["value"]) and -127 <= q["value"] <= 127  # the int8 value itself
        assert q["value"] == float(model.state_dict()[q_name][col, q["index"][0]])  # stored (out, in)
    bias = q_name[: -len("weight")] + "bias"  # the blocks' products have one (bias=True), the head none
    assert "s ⊙ q" in dot["text"] and (" + b" in last["formula"]) == (bias in model.state_dict())


def test_explain_shows_an_int8_weight_as_scale_times_q_and_its_numbers_add_up(int8_model):
    from glassformer import explain
    from glassformer.tracing.trace import trace

    from ..explaining.test_explain import check

    ids = [5, 9, 2, 44, 3, 17]
    tr = trace(int8_model, ids, with_weights=True)
    assert tr.config["quantization"] == INT8  # the trace says the model is quantized
    bare, parsed = trace(int8_model, ids), json.loads(tr.to_json(digits=9))  # 9 digits: float32 exactly
    assert parsed["config"]["quantization"] == INT8 and parsed["weights"]["lm_head.weight_scale"]["axes"] == ["out"]
    for k, probe in enumerate(EXPLAINED):
        shape = tr.probe(probe).data.shape
        idx = [(k + 3 * a) % n for a, n in enumerate(shape)]
        for e in (explain(tr, probe, idx), explain(bare, probe, idx, model=int8_model), explain(parsed, probe, idx)):
            check(e, tr, int8_model)  # every operand is what it names, and the steps recompute the traced value
            _scale_times_q(e, int8_model)


def test_a_cut_trace_keeps_the_scales_of_the_kept_columns(int8_model):
    from glassformer import explain
    from glassformer.tracing.trace import trace

    from ..explaining.test_explain import check

    tr = trace(int8_model, [5, 9, 2, 44], with_weights=True, heads=[1], top_k=3)
    H = int8_model.config.head_dim
    assert tr.weights["blocks.0.attn.wq.weight_scale"].index == {"out": list(range(H, 2 * H))}
    for probe, idx in (("blocks.0.attn.q", [2, 1, 3]), ("blocks.1.attn.v", [1, 0, 2]),
                       ("logits", [3, tr.probe("logits").index["vocab"][3][0]])):
        e = explain(tr, probe, idx)
        check(e, tr, int8_model)
        _scale_times_q(e, int8_model)


def test_a_float_models_trace_and_explain_are_as_before():
    from glassformer import explain
    from glassformer.tracing.trace import trace

    model = tiny_model(n_layers=1)
    tr = trace(model, [1, 2, 3], with_weights=True)
    assert tr.config["quantization"] is None and not any(n.endswith("_scale") for n in tr.weights)
    e = explain(tr, "blocks.0.attn.q", [1, 0, 0])
    assert len(e.steps) == 1 and e.steps[0]["formula"] == "Σ_i x[i]·W_Q[i,0]"


# ----------------------------------------------------------------------------- --quantize on every verb


@pytest.fixture(scope="module")
def stored_int8(ckpt, tmp_path_factory):
    path, _ = ckpt
    out = tmp_path_factory.mktemp("q8s") / "q8"
    assert main(["convert", "--quantize", "int8", "--checkpoint", str(path), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("verb", ["generate", "eval", "trace", "view", "chat"])
def test_every_verb_refuses_an_unknown_type_before_reading_weights(verb, tmp_path, capsys):
    # The checkpoint does not exist: the type must be refused before anything is read.
    extra = {"generate": ["--prompt", "x"], "eval": ["--data", "x.txt"], "trace": ["--out", str(tmp_path / "t.json")],
             "view": [], "chat": []}[verb]
    assert main([verb, "--checkpoint", str(tmp_path / "none"), "--quantize", "int4", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "int4" in err and "int8" in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("verb", ["trace", "view"])
def test_the_worked_toy_model_is_not_quantized(verb, tmp_path, capsys):
    assert main([verb, "--worked", "--quantize", "int8", *(["--out", str(tmp_path / "t.json")] if verb == "trace" else [])]) == 2
    assert "--checkpoint" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_trace_quantize_writes_the_int8_models_trace(ckpt, stored_int8, tmp_path, capsys):
    path, _ = ckpt
    files = {}
    for name, argv in (("fp32", ["--checkpoint", str(path)]), ("fly", ["--checkpoint", str(path), "--quantize", "int8"]),
                       ("stored", ["--checkpoint", str(stored_int8)])):
        files[name] = tmp_path / f"{name}.json"
        assert main(["trace", *argv, "--text", "Now is the winter", "--out", str(files[name]), "--with-weights",
                     "--no-analysis"]) == 0
    capsys.readouterr()
    fp32, fly, stored = (json.loads(files[k].read_text()) for k in ("fp32", "fly", "stored"))
    assert fp32["config"]["quantization"] is None and fly["config"]["quantization"] == INT8
    assert fly["probes"]["logits"] == stored["probes"]["logits"] != fp32["probes"]["logits"]
    assert fly["weights"]["blocks.1.ffn.w_up.weight_scale"] == stored["weights"]["blocks.1.ffn.w_up.weight_scale"]


def test_view_quantize_explores_the_int8_model(ckpt):
    from glassformer.cli import build_parser
    from glassformer.commands import view

    path, _ = ckpt
    ex = view.build_explorer(build_parser().parse_args(["view", "--checkpoint", str(path), "--quantize", "int8"]))
    page = ex.payload("Now is the")
    assert page["trace"]["config"]["quantization"] == INT8
    calc = ex.calculation("Now is the", "blocks.0.ffn.down", [1, 3])
    assert calc["steps"][-1]["terms"][0][0]["name"] == "blocks.0.ffn.w_down.weight_scale"
    assert calc["result"] == pytest.approx(calc["value"], rel=1e-5, abs=1e-5)


def test_chat_quantize_talks_with_the_int8_model(ckpt, stored_int8, tmp_path, capsys, monkeypatch):
    import io
    import sys

    import glassformer.generation.chat as chat_mod

    path, _ = ckpt
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                      "{% if add_generation_prompt %}assistant:{% endif %}")
    seen, real = [], chat_mod.ChatSession
    monkeypatch.setattr(chat_mod, "ChatSession", lambda model, *a, **k: seen.append(model) or real(model, *a, **k))

    def replies(*argv) -> str:
        monkeypatch.setattr(sys, "stdin", io.StringIO("Now is\nthe winter\n"))
        assert main(["chat", *argv, "--greedy", "--max-new-tokens", "8", "--template", str(tmp_path / "t.jinja")]) == 0
        return capsys.readouterr().out

    fly = replies("--checkpoint", str(path), "--quantize", "int8")
    assert isinstance(seen[-1].blocks[0].ffn.w_up, Int8Linear) and isinstance(seen[-1].lm_head, Int8Linear)
    assert replies("--checkpoint", str(stored_int8)) == fly
    replies("--checkpoint", str(path))
    assert not isinstance(seen[-1].blocks[0].ffn.w_up, Int8Linear)  # unset: as stored
