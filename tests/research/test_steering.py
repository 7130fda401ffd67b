"""Steering vectors: the vector is the mean stream difference the probes record; adding it through a
forward pre-hook equals changing the stream probe by hand; steered decoding with the KV cache and in
batches equals steered full forwards; the CLI writes it and generate/chat take --steer VEC[:SCALE];
a vector made for another model is refused naming both shapes."""

from __future__ import annotations

import pytest
import torch

from glassformer import ModelConfig, Transformer
from glassformer.cli import main
from glassformer.probes import stream_probes
from glassformer.research.steering import (SteeringVector, contrastive, load_vector, parse_spec, save_vector,
                                           steer)
from glassformer.tracing.interventions import run_with

from ..support import greedy_by_full_forward, greedy_cached, one_error, reinit, tiny_checkpoint

TEXT = ("The cat sat on the mat and the dog ran in the park. I love this, it is wonderful and kind. "
        "I hate this, it is awful and cruel. ") * 20
POSITIVE = ["I love this, it is wonderful", "what a kind and lovely day", "this is wonderful"]
NEGATIVE = ["I hate this, it is awful", "what a cruel and awful day", "this is awful and cruel today"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("steer") / "ckpt"
    model, tok = tiny_checkpoint(path, TEXT)
    return path, model, tok


def _model(norm_placement="pre", n_layers=3, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset("tiny", n_layers=n_layers, norm_placement=norm_placement, **overrides)
    return reinit(Transformer(cfg), seed=seed).eval()


def _vector(model, layer, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return SteeringVector(torch.randn(model.config.dim, generator=g), layer, model.config.n_layers, scale)


def test_the_vector_is_the_mean_difference_the_probes_record(ckpt):
    path, model, tok = ckpt
    for layer in range(model.config.n_layers):
        name = stream_probes(layer, model.config.norm_placement)["in"]
        for reduce in ("last", "mean"):
            vec = contrastive(model, tok, POSITIVE, NEGATIVE, layer, reduce)

            def side(texts):
                rows = []
                for t in texts:
                    x = run_with(model, tok.encode(t), {}, record=[name])[1][name][0]  # (T, D)
                    rows.append(x[-1] if reduce == "last" else x.mean(0))
                return torch.stack(rows).double().mean(0)

            want = (side(POSITIVE) - side(NEGATIVE)).float()
            assert torch.allclose(vec.direction, want, atol=1e-5), (layer, reduce)


FAMILIES = {"pre": {}, "post": {}, "sandwich": {}, "post_branch": {},
            "moe": dict(n_experts=4, n_active_experts=2)}  # the norm placements, and a mixture of experts


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layer", [0, 2])
def test_steering_adds_to_the_stream_entering_the_block(family, layer):
    """The hook's logits equal the unsteered model's with the stream probe entering block L changed
    by hand (the probes' own intervention path: another route to the same place)."""
    norm_placement = "pre" if family == "moe" else family
    model = _model(norm_placement, **FAMILIES[family])
    vec = _vector(model, layer, scale=3.0)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    name = stream_probes(layer, norm_placement)["in"]
    want, _ = run_with(model, ids, {name: lambda n, x: x + 3.0 * vec.direction})
    plain, _ = run_with(model, ids, {})
    with steer(model, vec):
        got = model(ids)[0]
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)  # the vector does move the logits
    assert torch.equal(model(ids)[0], plain)  # and leaving the block removes it


def test_steered_decoding_with_the_cache_and_in_batches_equals_full_forwards():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with steer(model, [_vector(model, 1, scale=4.0), _vector(model, 2, seed=2, scale=-2.0)]):
        for b in range(2):
            assert greedy_cached(model, ids[b:b + 1], 8) == greedy_by_full_forward(model, ids[b].tolist(), 8)
        batched, _ = model(ids)  # (2, T, V): each row as if alone
        for b in range(2):
            assert torch.allclose(batched[b], model(ids[b:b + 1])[0][0], atol=1e-5)


def test_per_row_scales_steer_each_row_by_its_own_amount():
    model = _model()
    vec = _vector(model, 1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with steer(model, vec) as s:
        s.row_scales = torch.tensor([0.0, 2.5])
        got = model(ids)[0]
    plain = model(ids[:1])[0][0]
    with steer(model, vec.scaled(2.5)):
        want = model(ids[1:])[0][0]
    assert torch.allclose(got[0], plain, atol=1e-5) and torch.allclose(got[1], want, atol=1e-5)


def test_a_vector_for_another_model_is_refused_naming_both_shapes(tmp_path):
    from glassformer.errors import UserError

    model = _model(n_layers=3)
    other = Transformer(ModelConfig.from_preset("tiny", dim=32, n_heads=2, n_kv_heads=1, n_layers=5))
    wide = SteeringVector(torch.zeros(32), 4, 5)
    for bad in (wide, SteeringVector(torch.zeros(64), 4, 5)):
        with pytest.raises(UserError) as e:
            steer(model, bad)
        msg = str(e.value)
        assert f"width {bad.dim} at the stream entering block 4 (of 5 blocks)" in msg
        assert "width 64 and 3 blocks" in msg and "\n" not in msg
    steer(other, wide).remove()  # it fits the model it was made for


def test_files_round_trip_and_bad_files_are_one_line(tmp_path):
    from glassformer.errors import UserError

    model = _model()
    vec = _vector(model, 2)
    path = save_vector(tmp_path / "v.safetensors", vec)
    back = load_vector(f"{path}:-1.5")
    assert torch.equal(back.direction, vec.direction) and (back.layer, back.n_layers, back.scale) == (2, 3, -1.5)
    assert parse_spec(str(path)) == (str(path), 1.0)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    for spec, words in ((f"{path}:big", "must be a number"), (str(tmp_path / "none.safetensors"), "does not exist"),
                        (str(tmp_path / "junk.safetensors"), "not a safetensors file")):
        with pytest.raises(UserError, match=words):
            load_vector(spec)


def test_steer_cli_then_generate_and_chat_take_it(ckpt, tmp_path, capsys, monkeypatch):
    import io
    import json

    path, model, tok = ckpt
    pos, neg = tmp_path / "pos.txt", tmp_path / "neg.txt"
    pos.write_text("\n".join(POSITIVE) + "\n")
    neg.write_text("\n".join(NEGATIVE) + "\n")
    vec = tmp_path / "kind.safetensors"
    assert main(["steer", "--checkpoint", str(path), "--positive", str(pos), "--negative", str(neg), "--layer", "1",
                 "--out", str(vec), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["layer"] == 1 and report["dim"] == model.config.dim and report["positive"] == 3
    want = contrastive(model, tok, POSITIVE, NEGATIVE, 1).direction
    assert torch.allclose(load_vector(str(vec)).direction, want, atol=1e-6)

    def generated(*extra):
        assert main(["generate", "--checkpoint", str(path), "--prompt", "The cat", "--greedy", "--max-new-tokens", "12",
                     *extra]) == 0
        return capsys.readouterr().out

    plain = generated()
    assert generated("--steer", f"{vec}:0") == plain
    big = 8 * float(report["stream_norm"]) / float(report["norm"])  # about 8 times the stream's length
    steered = generated("--steer", f"{vec}:{big}")
    assert steered != plain
    with steer(model, load_vector(f"{vec}:{big}")):  # the same tokens as the Python side steered
        ids = tok.encode("The cat")
        toks = greedy_by_full_forward(model, ids, 12)
    assert steered.startswith("The cat" + tok.decode([t for t in toks if t != tok.eot_id])[:5])

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")

    def chatted(scale):
        monkeypatch.setattr("sys.stdin", io.StringIO("The cat\n"))
        assert main(["chat", "--checkpoint", str(path), "--template", str(template), "--greedy", "--max-new-tokens",
                     "8", "--steer", f"{vec}:{scale}"]) == 0
        return capsys.readouterr().out

    assert chatted(0) != chatted(big)


def test_cli_refusals_are_one_line(ckpt, tmp_path, capsys):
    path, model, tok = ckpt
    pos, empty = tmp_path / "pos.txt", tmp_path / "empty.txt"
    pos.write_text("\n".join(POSITIVE))
    empty.write_text("\n \n")
    base = ["steer", "--checkpoint", str(path), "--out", str(tmp_path / "v.safetensors")]
    one_error(capsys, base + ["--positive", str(pos), "--negative", str(empty), "--layer", "0"], "--negative", "no text")
    one_error(capsys, base + ["--positive", str(pos), "--negative", str(pos), "--layer", "7"], "--layer 7", "2 blocks")
    other = tmp_path / "other.safetensors"
    save_vector(other, SteeringVector(torch.zeros(32), 3, 4))
    one_error(capsys, ["generate", "--checkpoint", str(path), "--prompt", "The", "--steer", f"{other}:2"],
              "width 32", "block 3 (of 4 blocks)", "width 64 and 2 blocks")
    one_error(capsys, ["generate", "--checkpoint", str(path), "--prompt", "The", "--steer", f"{other}:x"],
              "must be a number")


def test_convert_writes_llama_cpps_control_vector_file(tmp_path, capsys):
    """direction.{L-1} (llama.cpp adds direction.il to layer il's output, the stream entering block il+1),
    the scale baked in, F32, arch 'controlvector' with the model's graph as hint; L < 2 has no place."""
    import gguf

    from glassformer.convert.control_vector import read_control_vector

    model = _model(n_layers=4)
    vec = SteeringVector(torch.randn(64, generator=torch.Generator().manual_seed(3)), 2, 4,
                         meta={"config": __import__("json").dumps(model.config.to_dict())})
    save_vector(tmp_path / "v.safetensors", vec)
    out = tmp_path / "cv.gguf"
    assert main(["convert", "--control-vector", f"{tmp_path / 'v.safetensors'}:-2", "--out", str(out)]) == 0
    r = gguf.GGUFReader(str(out))
    fields = {k: f.contents() for k, f in r.fields.items()}
    assert fields["general.architecture"] == "controlvector"
    assert fields["controlvector.model_hint"] == "llama" and fields["controlvector.layer_count"] == 1
    assert [(t.name, t.tensor_type.name) for t in r.tensors] == [("direction.1", "F32")]
    buf = read_control_vector(out, 64, 4)  # layer 1 at [0:64], as llama.cpp's loader places it
    assert torch.allclose(torch.from_numpy(buf[:64]), -2 * vec.direction) and not buf[64:].any()
    save_vector(tmp_path / "early.safetensors", SteeringVector(torch.zeros(64), 1, 4))
    one_error(capsys, ["convert", "--control-vector", str(tmp_path / "early.safetensors"), "--out",
                       str(tmp_path / "e.gguf")], "entering block 1", "--layer 2 or later")
    one_error(capsys, ["convert", "--control-vector", str(tmp_path / "v.safetensors"), "--out", str(out)],
              "already exists")
    one_error(capsys, ["convert", "--control-vector", str(tmp_path / "v.safetensors"), "--out", str(tmp_path / "x"),
                       "--dtype", "f16"], "--dtype")


def test_the_engine_steers_each_request_by_its_own_multiple():
    """Requests with steer 0, 1 and 3 decode together (one batched prefill, batched decode steps); each
    gets the greedy tokens of the model steered alone at that multiple."""
    from glassformer.generation.batching import Engine, Request

    model = _model()
    vec = _vector(model, 1, scale=0.3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    want = []
    for ids, k in zip(prompts, (0.0, 1.0, 3.0)):
        with steer(model, vec.scaled(0.3 * k)):
            want.append(greedy_by_full_forward(model, ids, 10))
    assert len({tuple(w) for w in want}) == 3  # the multiples do change the tokens
    s = steer(model, vec)
    engine = Engine(model, max_batch=4)
    tickets = [engine.submit(Request(ids, 10, temperature=0.0, steer=k)) for ids, k in zip(prompts, (0.0, None, 3.0))]
    while engine.step():
        pass
    got = [[e.token for e in t.events(timeout=0) if e.token is not None] for t in tickets]
    assert got == want
    s.remove()
    assert getattr(model, "steering", None) is None


def test_a_request_steer_on_an_unsteered_model_is_refused():
    from glassformer.errors import UserError
    from glassformer.generation.batching import Engine, Request
    from glassformer.serve import schemas

    engine = Engine(_model(), max_batch=2)
    with pytest.raises(UserError, match="start the server with --steer"):
        engine.submit(Request([1, 2], 3, steer=2.0))
    req = schemas.parse(schemas.CompletionRequest, b'{"model": "m", "prompt": "hi", "steer": -2}')
    assert schemas.sampling_of(req)["steer"] == -2.0
    with pytest.raises(schemas.ApiError, match="steer"):
        schemas.parse(schemas.CompletionRequest, b'{"model": "m", "prompt": "hi", "steer": "2"}')


def test_serve_takes_steer_per_request_and_refuses_it_unsteered(ckpt):
    """The OpenAI route: "steer" scales the server's vector for one request (0: the plain model's text);
    a server started without --steer answers 400 naming the field."""
    import httpx

    from glassformer.generation.batching import Engine
    from glassformer.serve.backend import Backend
    from glassformer.serve.http import Limits, Server, make_app
    from glassformer.serve.openai import add_routes, openai_error

    _, model, tok = ckpt
    prompt = tok.encode("The cat sat")
    vec = SteeringVector(contrastive(model, tok, POSITIVE, NEGATIVE, 1).direction, 1, model.config.n_layers, 1.0)
    texts = {}
    for k in (0.0, 3.0):
        with steer(model, vec.scaled(k)):
            ids = greedy_by_full_forward(model, prompt, 8)
        stop = [i for i, t in enumerate(ids) if t in tok.eos_ids]
        texts[k] = tok.decode(ids[:stop[0]] if stop else ids)
    assert texts[0.0] != texts[3.0]
    for steered in (True, False):
        s = steer(model, vec) if steered else None
        backend, limits = Backend("m"), Limits()
        backend.steered = steered
        app = add_routes(make_app(host="127.0.0.1", port=0, api_key=None, limits=limits, error_body=openai_error),
                         backend)
        server = Server(app, "127.0.0.1", 0, limits)
        url = server.start_in_thread()
        engine = Engine(model, max_batch=2).start()
        backend.ready(engine, model, tok)
        try:
            def ask(k):
                return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "The cat sat", "max_tokens": 8,
                                                                 "temperature": 0, "steer": k}, timeout=30)

            if steered:
                for k in (0.0, 3.0):
                    r = ask(k)
                    assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[k], r.text
            else:
                r = ask(1)
                assert r.status_code == 400 and r.json()["error"]["param"] == "steer", r.text
        finally:
            engine.stop()
            server.stop()
            if s is not None:
                s.remove()


def test_serve_steer_in_the_engines_process(ckpt, tmp_path):
    """`serve --steer VEC:S` with the engine in a process of its own (serve's default): the child loads
    the model through generate's loader, steered there, and each request's multiple reaches it."""
    import argparse
    import functools

    from glassformer.cli import build_parser
    from glassformer.commands.generate import _load_model
    from glassformer.generation.batching import Request
    from glassformer.serve.worker import ProcessEngine

    path, model, tok = ckpt
    vec = contrastive(model, tok, POSITIVE, NEGATIVE, 1)
    save_vector(tmp_path / "v.safetensors", vec)
    args = build_parser().parse_args(["serve", "--checkpoint", str(path), "--steer", f"{tmp_path / 'v.safetensors'}:1.5"])
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
    args.attention = options.attention = None  # (as serve's run sets it)
    prompt = tok.encode("The cat sat")
    want = {}
    for k in (0.0, 2.0):
        with steer(model, vec.scaled(1.5 * k)):
            want[k] = greedy_by_full_forward(model, prompt, 8)
    assert want[0.0] != want[2.0]
    engine = ProcessEngine(functools.partial(_load_model, options), max_batch=2).start().wait_ready(120)
    try:
        tickets = {k: engine.submit(Request(prompt, 8, temperature=0.0, steer=k)) for k in want}
        got = {k: [e.token for e in t.events(timeout=60) if e.token is not None] for k, t in tickets.items()}
    finally:
        engine.stop()
    assert got == want


def test_a_two_block_model_has_no_control_vector_place(tmp_path, capsys):
    save_vector(tmp_path / "v.safetensors", SteeringVector(torch.zeros(64), 1, 2))
    one_error(capsys, ["convert", "--control-vector", str(tmp_path / "v.safetensors"), "--out", str(tmp_path / "v.gguf")],
              "2-block model has no block 2")
