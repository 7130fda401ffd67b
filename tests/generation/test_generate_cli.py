"""`glassformer generate`: streamed text equals the Python API's tokens; batches; stop strings; errors."""

import pytest

from glassformer import generate
from glassformer.cli import main
from glassformer.generation.streaming import TextStream

from ..support import tiny_checkpoint

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York. "
        "Café, naïve, façade — 日本語のテキスト. ") * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    model, tok = tiny_checkpoint(path, TEXT)
    return path, model, tok


def _api_text(model, tok, prompt, **kw):
    ids = list(generate(model, tok.encode(prompt), stop=[tok.eot_id], **kw))
    return tok.decode([i for i in ids if i != tok.eot_id])


def test_greedy_stream_equals_the_api(ckpt, capsys):
    path, model, tok = ckpt
    assert main(["generate", "--checkpoint", str(path), "--prompt", "Now is", "--greedy", "--max-new-tokens", "30"]) == 0
    out = capsys.readouterr().out
    assert out == "Now is" + _api_text(model, tok, "Now is", max_new_tokens=30, greedy=True) + "\n"


def test_the_cache_is_sized_to_the_call(ckpt, capsys, monkeypatch):
    """prompt + new tokens, not the model's whole context (a compiled step on a GPU reads the
    whole cache every step); the slide policy keeps the full context to slide in."""
    import importlib

    gen = importlib.import_module("glassformer.generation.session")  # the module (the package's name is the function)
    sizes = []

    class Recording(gen.Session):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            sizes.append(self.max_len)

    monkeypatch.setattr(gen, "Session", Recording)
    path, model, tok = ckpt
    for policy in ("error", "slide"):
        args = ["generate", "--checkpoint", str(path), "--prompt", "Now is", "--greedy", "--max-new-tokens", "7"]
        assert main(args + ["--context-policy", policy]) == 0
    assert sizes == [len(tok.encode("Now is")) + 7, model.config.max_seq_len]
    capsys.readouterr()


def test_seeded_samples_repeat_and_differ(ckpt, capsys):
    path, model, tok = ckpt
    argv = ["generate", "--checkpoint", str(path), "--prompt", "Café", "--seed", "3", "--max-new-tokens", "25",
            "--num-samples", "2", "--top-k", "40", "--temperature", "1.2"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    blocks = first.split("=== prompt 1, sample 2 ===\n")
    assert blocks[0].startswith("=== prompt 1, sample 1 ===\nCafé") and blocks[1].startswith("Café")
    assert blocks[0].split("\n", 1)[1] != blocks[1]  # the two samples differ


def test_prompts_file_batch_equals_each_alone(ckpt, capsys, tmp_path):
    path, model, tok = ckpt
    prompts = ["Now is the winter of our", "日本", "made glorious summer by this sun"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
    assert main(["generate", "--checkpoint", str(path), "--prompts-file", str(f), "--greedy", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    want = "".join(f"=== prompt {i + 1} ===\n{p}{_api_text(model, tok, p, max_new_tokens=20, greedy=True)}\n"
                   for i, p in enumerate(prompts))
    assert out == want


def test_stop_string_ends_the_text_before_it(ckpt, capsys):
    path, model, tok = ckpt
    full = _api_text(model, tok, "Now is", max_new_tokens=40, greedy=True)
    stop = full[10:13]
    assert main(["generate", "--checkpoint", str(path), "--prompt", "Now is", "--greedy", "--max-new-tokens", "40",
                 "--stop", stop, "--stop", "never-there"]) == 0
    assert capsys.readouterr().out == "Now is" + full[:full.index(stop)] + "\n"


def test_stream_never_prints_half_a_character(ckpt):
    _, _, tok = ckpt
    text = "façade 日本語 é"
    # One token per byte: every multi-byte character arrives split across tokens.
    byte_ids = [next(i for i in range(tok.vocab_size) if tok.id_to_bytes(i) == bytes([b])) for b in text.encode("utf-8")]
    s = TextStream(tok)
    pieces = [s.push(i) for i in byte_ids] + [s.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[2] == "" and pieces[3] == "ç"  # "ç" is two bytes: nothing, then the whole character


def test_stream_holds_back_a_possible_stop_string(ckpt):
    _, _, tok = ckpt
    s = TextStream(tok, stops=["END"])
    got = [s.push(i) for i in tok.encode("abc EN")]
    assert "".join(got) == "abc "  # 'EN' might become 'END'
    got = [s.push(i) for i in tok.encode("D more")]
    assert "".join(got) == "" and s.done


@pytest.mark.parametrize("extra, match", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "0"], "top-k"),
    (["--prompt", ""], "empty"),
    (["--max-new-tokens", "1000"], "context"),
])
def test_bad_input_is_one_line_and_exit_2(ckpt, capsys, extra, match):
    path, _, _ = ckpt
    argv = ["generate", "--checkpoint", str(path), "--prompt", "Now", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and match in err and err.count("\n") == 1


def test_missing_and_incomplete_checkpoints(ckpt, capsys, tmp_path):
    path, _, _ = ckpt
    assert main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "COMPLETE").unlink()
    assert main(["generate", "--checkpoint", str(broken), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "incomplete" in err and err.count("\n") == 1
    (broken / "COMPLETE").write_text("ok\n")
    (broken / "model.safetensors").unlink()
    assert main(["generate", "--checkpoint", str(broken), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "model.safetensors" in err and err.count("\n") == 1


def test_a_runs_pointer_file_names_its_checkpoint(ckpt, capsys, tmp_path):
    import shutil

    path, _, _ = ckpt
    run = tmp_path / "run"
    shutil.copytree(path, run / "step-000007")
    (run / "best").write_text("step-000007\n")
    args = ["--prompt", "ab", "--max-new-tokens", "5", "--greedy"]
    assert main(["generate", "--checkpoint", str(path), *args]) == 0
    direct = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(run / "best"), *args]) == 0
    assert capsys.readouterr().out == direct  # the same checkpoint, so the same greedy text
    (run / "step-000007" / "COMPLETE").unlink()
    assert main(["generate", "--checkpoint", str(run / "best"), *args]) == 2
    err = capsys.readouterr().err
    assert "step-000007" in err and "incomplete" in err and err.count("\n") == 1


def test_compiled_generation_prints_the_same_text_and_its_steady_rate(ckpt, capsys):
    path, _, _ = ckpt
    args = ["generate", "--checkpoint", str(path), "--prompt", "Now is", "--greedy", "--max-new-tokens", "12"]
    assert main(args) == 0
    eager = capsys.readouterr()
    assert main(args + ["--compile"]) == 0
    compiled = capsys.readouterr()
    assert compiled.out == eager.out
    # The rate it prints leaves out the prefill and the first decode step (where compiling happens).
    assert "prefill" in eager.err and "with compiling" not in eager.err
    assert "first decode step" in compiled.err and "with compiling" in compiled.err and "tokens/s" in compiled.err
