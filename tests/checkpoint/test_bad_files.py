"""Bad checkpoint files: each is one `error:` line naming the file and what to do (exit 2 from the
command line, a UserError from the Python API), found before anything large is allocated
(checkpoint/checks.py, files.atomic_folder; docs/convert.md#bad-files).

Damaged weights (half a file, 4 bytes, none, a header length of 2^60, offsets past the end), configs
that are not JSON objects or hold wrong-typed fields, sizes that outgrow the machine or the weights
file (vocab_size 10^12, n_layers 100,000), adapters whose rank disagrees with their tensors (r
300,000 and 1e9), a disk that fills during a save, a resumed run's config.json, and GGUF files (cut,
foreign, empty, a header claiming a 4 TiB tensor, a bad glassformer.config, tokenizer file names that
leave the checkpoint)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from glassformer.checkpoint.loading import load
from glassformer.errors import UserError

from ..support import one_error, run_cli, synthetic_text, tiny_checkpoint, tiny_model

# What safetensors' writer raised when a save filled a real (tmpfs) disk: it is not an OSError.
DISK_FULL_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"
GROWTH_LIMIT = 100 * 2**20  # bytes the process's peak memory may rise while refusing a file


def peak_growth(fn) -> int | None:
    """How far this process's peak resident memory rose (bytes) while fn() ran. Linux lets the peak be
    reset first (/proc/self/clear_refs), so earlier tests cannot hide a rise; elsewhere, the growth of
    the peak so far (getrusage); None where neither is available."""
    status = Path("/proc/self/status")

    def field(name: str) -> int:
        return int(re.search(rf"{name}:\s+(\d+) kB", status.read_text())[1]) * 1024

    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = field("VmRSS")
        fn()
        return field("VmHWM") - before
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        fn()
        return None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KB on Linux


def small_footprint(capsys, argv: list[str], *names: str) -> str:
    """one_error, with the process's peak memory rising less than GROWTH_LIMIT meanwhile: measured on a
    second run, as the first imports what the command needs (80 MB of modules for convert)."""
    said = [one_error(capsys, argv, *names)]
    growth = peak_growth(lambda: said.append(one_error(capsys, argv, *names)))
    assert growth is None or growth < GROWTH_LIMIT, f"peak memory rose {growth / 2**20:.0f} MB"
    return said[0]


# ----------------------------------------------------------------------------- the folders damaged


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny checkpoint with a tokenizer."""
    root = tmp_path_factory.mktemp("bad_files")
    tiny_checkpoint(root / "good", synthetic_text(100, 0))
    return root / "good"


def copy_of(good: Path, tmp_path: Path, name: str = "bad") -> Path:
    dst = tmp_path / name
    shutil.copytree(good, dst)
    return dst


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file at path with change(its value) (which may edit the value in place)."""
    value = json.loads(path.read_text())
    new = change(value)
    path.write_text(json.dumps(value if new is None else new))


def argv_for(verb: str, folder: Path, tmp_path: Path) -> list[str]:
    """A verb run on a checkpoint folder, with the other arguments it needs (eval: a text file in tmp_path)."""
    if verb == "eval":
        (tmp_path / "text.txt").write_text(synthetic_text(20, 3))
        return ["eval", "--checkpoint", str(folder), "--data", str(tmp_path / "text.txt")]
    if verb == "convert":
        return ["convert", "--kv-heads", "1", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]
    return ["generate", "--checkpoint", str(folder), "--prompt", "the", "--max-new-tokens", "2"]


def header_of(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its tensors' bytes."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def offsets_past_the_end(data: bytes) -> bytes:
    """The last tensor's offsets moved a gigabyte past the end of the file."""
    header, body = header_of(data)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    a, b = header[last]["data_offsets"]
    header[last]["data_offsets"] = [a + 2**30, b + 2**30]
    return with_header(header, body)


DAMAGE = {
    "half": lambda data: data[: len(data) // 2],
    "4 bytes": lambda data: data[:4],
    "0 bytes": lambda data: b"",
    "header length 2^60": lambda data: struct.pack("<Q", 2**60) + data[8:],
    "offsets past the end": offsets_past_the_end,
}


@pytest.mark.parametrize("verb", ["generate", "eval", "convert"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_weights_are_one_line(good, tmp_path, capsys, damage, verb):
    folder = copy_of(good, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(DAMAGE[damage](weights.read_bytes()))
    one_error(capsys, argv_for(verb, folder, tmp_path), weights, "not a readable safetensors file",
              "truncated or damaged", "again")
    assert not (tmp_path / "out").exists()


CONVERT_ROUTES = {  # every convert route that reads a native checkpoint (--to-hf read the header itself first)
    "--to-hf": lambda src, out: ["--to-hf", src, "--out", out],
    "--to-gguf": lambda src, out: ["--to-gguf", src, "--out", f"{out}.gguf"],
    "--quantize int8": lambda src, out: ["--quantize", "int8", "--checkpoint", src, "--out", out],
    "--kv-heads": lambda src, out: ["--kv-heads", "1", "--checkpoint", src, "--out", out],
    "--merge-lora": lambda src, out: ["--merge-lora", src, "--out", out],
}


@pytest.mark.parametrize("route", list(CONVERT_ROUTES))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_weights_are_one_line_on_every_convert_route(good, tmp_path, capsys, damage, route):
    folder = copy_of(good, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(DAMAGE[damage](weights.read_bytes()))
    one_error(capsys, ["convert", *CONVERT_ROUTES[route](str(folder), str(tmp_path / "out"))], weights,
              "not a readable safetensors file", "truncated or damaged")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_damaged_weights_are_a_user_error_from_the_api(good, tmp_path):
    folder = copy_of(good, tmp_path)
    (folder / "model.safetensors").write_bytes(b"\0" * 4)
    with pytest.raises(UserError, match=re.escape(str(folder / "model.safetensors"))):
        load(folder)


def test_the_hugging_face_path_shares_the_checker(tmp_path):
    """A damaged Hugging Face folder gets the same line as a native checkpoint (one checker)."""
    from glassformer.convert.hf import load_hf, save_hf

    hf = save_hf(tiny_model(), tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 2**60))
    with pytest.raises(UserError, match="model.safetensors is not a readable safetensors file .*truncated or damaged"):
        load_hf(hf)


# ----------------------------------------------------------------------------- config.json


CONFIGS = {  # what is done to config.json -> what the line names besides the file
    "a list": (lambda meta: [meta], "a list"),
    "a number": (lambda meta: 42, "a number"),
    "model a string": (lambda meta: {**meta, "model": "tiny"}, '"model"'),
    "n_kv_heads text": (lambda meta: meta["model"].update(n_kv_heads="2"), "n_kv_heads"),
    "bias text": (lambda meta: meta["model"].update(bias="yes"), "bias"),
    "rope_scaling a number": (lambda meta: meta["model"].update(rope_scaling=2), "rope_scaling"),
    "format_version text": (lambda meta: meta.update(format_version="1"), "format_version"),
    "vocab_size 1e12 (a float)": (lambda meta: meta["model"].update(vocab_size=1e12), "vocab_size"),
}


@pytest.mark.parametrize("verb", ["generate", "eval", "convert"])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_bad_config_is_one_line_naming_it(good, tmp_path, capsys, case, verb):
    folder = copy_of(good, tmp_path)
    change, named = CONFIGS[case]
    edit_json(folder / "config.json", change)
    one_error(capsys, argv_for(verb, folder, tmp_path), folder / "config.json", named)


def test_a_config_past_the_machine_s_memory_says_how_much(good, tmp_path, capsys):
    """vocab_size 10^12: 128 trillion weights, refused from the config alone, saying what they need."""
    folder = copy_of(good, tmp_path)
    edit_json(folder / "config.json", lambda meta: meta["model"].update(vocab_size=10**12))
    err = small_footprint(capsys, argv_for("generate", folder, tmp_path), folder / "config.json",
                          "128,000,000,", "466 TiB of memory", "this machine has")
    assert "vocab_size 1,000,000,000,000" in err


def test_the_memory_limit_is_the_machine_s(good, tmp_path, monkeypatch):
    """A sound checkpoint is refused on a machine too small for it (its RAM as os.sysconf tells it)."""
    import glassformer.checkpoint.checks as checks

    monkeypatch.setattr(checks, "ram_bytes", lambda: 100 * 1024)
    with pytest.raises(UserError, match=r"config.json describes [\d,]+ weights .* which need 511 KiB of memory; "
                                        r"this machine has 100 KiB"):
        load(good)
    monkeypatch.setattr(checks, "ram_bytes", lambda: None)  # a system that does not say: no limit
    load(good)


def test_a_config_with_more_layers_than_its_weights_is_refused_at_once(good, tmp_path, capsys):
    """n_layers 100,000 over a two-layer file: building that model (even on the meta device) took over
    two minutes and 3.8 GB; the config's weight count is checked against the file's header first."""
    folder = copy_of(good, tmp_path)
    edit_json(folder / "config.json", lambda meta: meta["model"].update(n_layers=100_000))
    for verb in ("generate", "convert"):
        small_footprint(capsys, argv_for(verb, folder, tmp_path), folder / "config.json", "n_layers 100,000",
                        folder / "model.safetensors", "do not belong together")


def test_a_config_with_more_experts_than_its_weights_is_refused_at_once(tmp_path, capsys):
    """n_experts 4,096 over a file of 4 experts a layer: one line, before 4,096 experts a layer are built."""
    from glassformer.checkpoint.folders import save_model

    folder = tmp_path / "moe"
    save_model(folder, tiny_model(n_experts=4, n_active_experts=2, expert_dim=16), None)
    edit_json(folder / "config.json", lambda meta: meta["model"].update(n_experts=4096))
    small_footprint(capsys, argv_for("generate", folder, tmp_path), folder / "config.json", "n_experts 4,096",
                    "holds the weights of 4 experts")


def test_a_hugging_face_config_with_more_layers_than_its_weights(tmp_path, capsys):
    from glassformer.convert.hf import save_hf

    hf = save_hf(tiny_model(), tmp_path / "hf")
    edit_json(hf / "config.json", lambda c: c.update(num_hidden_layers=100_000))
    small_footprint(capsys, ["convert", "--from-hf", str(hf), "--out", str(tmp_path / "out")],
                    hf / "config.json", "n_layers 100,000", "do not belong together")


# ----------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def adapters(good, tmp_path_factory):
    """A PEFT folder (its base beside it) and a glassformer adapter checkpoint on `good`, both rank 2."""
    from glassformer.checkpoint.adapters import save_adapter
    from glassformer.convert.lora import LoraConfig, apply_lora
    from glassformer.convert.peft import save_peft

    root = tmp_path_factory.mktemp("adapters")
    model, _ = load(good)
    apply_lora(model, LoraConfig(r=2, alpha=4.0))
    save_peft(model, root / "peft")
    save_adapter(root / "adapter", model, good)
    return root


@pytest.mark.parametrize("r", [300_000, 1e9])
def test_a_peft_rank_past_its_tensors_is_refused_before_allocating(adapters, tmp_path, capsys, r):
    """r 300,000 allocated 3 GB of adapters before the shapes were compared; r 1e9 was a traceback."""
    folder = copy_of(adapters / "peft", tmp_path)
    edit_json(folder / "adapter_config.json", lambda c: c.update(r=r))
    for verb in ("convert", "generate"):
        argv = (["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "out")] if verb == "convert"
                else argv_for("generate", folder, tmp_path))
        small_footprint(capsys, argv, folder / "adapter_model.safetensors", folder / "adapter_config.json",
                        f"r {int(r):,}", "rank-2")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("r", [300_000, 1e9])
def test_an_adapter_checkpoint_rank_past_its_tensors(good, adapters, tmp_path, capsys, r):
    folder = copy_of(adapters / "adapter", tmp_path)
    edit_json(folder / "config.json", lambda c: c["lora"].update(r=r, base={**c["lora"]["base"], "path": str(good)}))
    small_footprint(capsys, ["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "out")],
                    folder / "adapter.safetensors", folder / "config.json", f"r {int(r):,}", "rank-2")


ADAPTER_CONFIGS = {  # what is done to adapter_config.json -> what the line names
    "a list": (lambda c: [c], "a list"),
    "r text": (lambda c: c.update(r="8"), "'r'"),
    "r 2.5": (lambda c: c.update(r=2.5), "r must be a whole number"),
    "lora_alpha 0": (lambda c: c.update(lora_alpha=0), "lora_alpha"),
    "lora_dropout text": (lambda c: c.update(lora_dropout="x"), "lora_dropout"),
    "base a number": (lambda c: c.update(base_model_name_or_path=5), "base_model_name_or_path"),
}


@pytest.mark.parametrize("case", list(ADAPTER_CONFIGS))
def test_a_bad_adapter_config_is_one_line_naming_it(adapters, tmp_path, capsys, case):
    folder = copy_of(adapters / "peft", tmp_path)
    change, named = ADAPTER_CONFIGS[case]
    edit_json(folder / "adapter_config.json", change)
    for argv in (["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "out")],
                 argv_for("generate", folder, tmp_path)):
        one_error(capsys, argv, folder / "adapter_config.json", named)


@pytest.mark.parametrize("lora", [[1], {"r": 2, "alpha": 4.0}, {"r": "2", "alpha": 4.0, "base": {"path": "x", "sha256": "y"}}])
def test_a_bad_lora_record_is_one_line_naming_it(adapters, tmp_path, capsys, lora):
    folder = copy_of(adapters / "adapter", tmp_path)
    edit_json(folder / "config.json", lambda c: c.update(lora=lora))
    one_error(capsys, ["convert", "--merge-lora", str(folder), "--out", str(tmp_path / "out")],
              folder / "config.json", "lora")


# ----------------------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def gguf_file(good, tmp_path_factory) -> Path:
    """`good` written as a GGUF file (f32, with its glassformer.config and tokenizer files keys: a
    tokenizer_config.json with a chat template beside its tokenizer.json)."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf")
    src = copy_of(good, root, "src")
    template = "{% for m in messages %}" + "{{ m['role'] }}: {{ m['content'] }}\n" * 4 + "{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert run_cli(["convert", "--to-gguf", str(src), "--out", str(root / "good.gguf")]) == 0
    return root / "good.gguf"


def gguf_string(data: bytes, key: str) -> tuple[int, int]:
    """(start, length) of the string value of `key` in a GGUF file's bytes (the key, its type, its length)."""
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack("<I", data[at:at + 4])[0] == 8  # GGUF's string type
    return at + 12, struct.unpack("<Q", data[at + 4:at + 12])[0]


def with_gguf_string(data: bytes, key: str, text: str) -> bytes:
    """The file with key's string replaced by text, padded with spaces to the same length (so every
    offset after it stays where it was; JSON allows the spaces)."""
    start, n = gguf_string(data, key)
    new = text.encode()
    assert len(new) <= n
    return data[:start] + new + b" " * (n - len(new)) + data[start + n:]


def with_gguf_config(data: bytes, change) -> bytes:
    start, n = gguf_string(data, "glassformer.config")
    fields = json.loads(data[start:start + n])
    new = change(fields)
    return with_gguf_string(data, "glassformer.config", json.dumps(fields if new is None else new, separators=(",", ":")))


def huge_embedding(data: bytes) -> bytes:
    """token_embd.weight's header says 2^34 rows of 64 (4 TiB of f32) in a half-megabyte file."""
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack("<I", data[at:at + 4])[0] == 2  # two dimensions: (dim, vocab), innermost first
    return data[:at + 12] + struct.pack("<Q", 2**34) + data[at + 20:]


GGUF_DAMAGE = {
    "half": lambda data: data[: len(data) // 2],
    "4 bytes": lambda data: data[:4],
    "0 bytes": lambda data: b"",
    "garbage": lambda data: bytes(range(256)) * 64,
    "GGUF then garbage": lambda data: b"GGUF" + bytes(range(256)) * 64,
    "a 4 TiB tensor in the header": huge_embedding,
}


@pytest.mark.parametrize("damage", list(GGUF_DAMAGE))
def test_a_damaged_gguf_file_is_one_line(gguf_file, tmp_path, capsys, damage):
    """convert --from-gguf on a cut, foreign or empty file: one line naming it and what to do (it was
    the reader's bare words, without what to do), nothing allocated for what its header claims."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(GGUF_DAMAGE[damage](gguf_file.read_bytes()))
    small_footprint(capsys, ["convert", "--from-gguf", str(bad), "--out", str(tmp_path / "out")], bad,
                    "truncated, damaged or not a GGUF file", "convert or download it again")
    assert not (tmp_path / "out").exists()


KEY = "'s glassformer.config key"
GGUF_CONFIGS = {  # what is done to the file's glassformer.config -> what the line says after the file's name
    "not JSON": (lambda fields: "{x", KEY, "is not JSON"),
    "a list": (lambda fields: [fields], KEY, "a list"),
    "n_kv_heads text": (lambda fields: fields.update(n_kv_heads="2"), KEY, "n_kv_heads"),
    "n_layers 100,000": (lambda fields: fields.update(n_layers=100_000), KEY, "holds the tensors of 2 layers"),
    "vocab_size 10^12": (lambda fields: fields.update(vocab_size=10**12), KEY, "this machine has"),
    "head_dim 12": (lambda fields: fields.update(head_dim=12), ": tensor blk.0.attn_q.weight [64, 64]",
                    "does not fit its config"),
}


@pytest.mark.parametrize("case", list(GGUF_CONFIGS))
def test_a_bad_gguf_config_key_is_one_line_naming_it(gguf_file, tmp_path, capsys, case):
    """A list or a head_dim its tensors cannot take was a traceback, a wrong-typed field a line not
    naming the file, n_layers 100,000 a model built to find tensors missing; now each is one line."""
    change, where, named = GGUF_CONFIGS[case]
    bad = tmp_path / "bad.gguf"
    data = gguf_file.read_bytes()
    if case == "not JSON":
        bad.write_bytes(with_gguf_string(data, "glassformer.config", change(None)))
    else:
        bad.write_bytes(with_gguf_config(data, change))
    small_footprint(capsys, ["convert", "--from-gguf", str(bad), "--out", str(tmp_path / "out")],
                    f"{bad}{where}", named)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../escaped.txt", "{tmp}/absolute.txt", "additional_chat_templates/../../up.jinja",
                                  "tokenizer.json"])
def test_a_gguf_file_writes_its_tokenizer_files_inside_the_checkpoint_alone(gguf_file, tmp_path, capsys, name):
    """The glassformer.tokenizer_files key names files to write beside tokenizer.json: a name that
    leaves the checkpoint (or replaces its tokenizer.json) is refused; it was written where it pointed."""
    name = name.format(tmp=tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(with_gguf_string(gguf_file.read_bytes(), "glassformer.tokenizer_files", json.dumps({name: "x"})))
    one_error(capsys, ["convert", "--from-gguf", str(bad), "--out", str(tmp_path / "sub" / "out")],
              f"{bad}'s glassformer.tokenizer_files key", repr(name))
    assert [p.name for p in tmp_path.rglob("*")] == ["bad.gguf"]  # refused before anything was written


# ----------------------------------------------------------------------------- a resumed run's config.json


TRAIN_ARGS = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--eval-tokens", "64",
              "--no-progress", "--threads", "1"]


def train_argv(data: Path, out: Path, *more: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), *TRAIN_ARGS, *more]


def last_line_error(capsys, argv: list[str], *names) -> str:
    """Run argv: exit 2 and one `error:` line, the last on stderr (train says what it resumes before
    it), naming each of names; no traceback."""
    capsys.readouterr()
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    for name in names:
        assert str(name) in errors[0], err
    return errors[0]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, Path]:
    """(data folder, run folder) of a run two steps long."""
    from ..support import make_prepared

    root = tmp_path_factory.mktemp("resume")
    data = make_prepared(root / "data", n_train=300, n_val=60)
    assert run_cli(train_argv(data, root / "run", "--max-steps", "2")) == 0
    return data, root / "run"


RESUMED_CONFIGS = {  # what is done to the step folder's config.json -> what the line names besides it
    "a list": (lambda meta: [meta], "a list"),
    "model a string": (lambda meta: {**meta, "model": "tiny"}, '"model"'),
    "n_kv_heads text": (lambda meta: meta["model"].update(n_kv_heads="2"), "n_kv_heads"),
    "n_layers 100,000": (lambda meta: meta["model"].update(n_layers=100_000), "do not belong together"),
    "vocab_size 10^12": (lambda meta: meta["model"].update(vocab_size=10**12), "this machine has"),
}


@pytest.mark.parametrize("case", list(RESUMED_CONFIGS))
def test_a_bad_config_in_a_resumed_run_is_one_line_naming_it(trained_run, tmp_path, capsys, case):
    """train --resume checks the step folder's config.json as load() does, before a model is built:
    a list or a wrong-typed field was a traceback, n_layers 100,000 built for minutes."""
    data, run = trained_run
    out = copy_of(run, tmp_path, "run")
    config = out / (out / "latest").read_text().strip() / "config.json"
    change, named = RESUMED_CONFIGS[case]
    edit_json(config, change)
    argv = train_argv(data, out, "--max-steps", "4", "--resume")
    last_line_error(capsys, argv, config, named)
    growth = peak_growth(lambda: last_line_error(capsys, argv, config, named))
    assert growth is None or growth < GROWTH_LIMIT, f"peak memory rose {growth / 2**20:.0f} MB"


@pytest.mark.parametrize("change, named", [(lambda state: [state], "a list"),
                                           (lambda state: state.update(config=[1]), '"config"')])
def test_a_bad_train_state_in_a_resumed_run_is_one_line_naming_it(trained_run, tmp_path, capsys, change, named):
    """train --resume reads the run's saved settings from train_state.json first: a list there was an
    AttributeError traceback."""
    data, run = trained_run
    out = copy_of(run, tmp_path, "run")
    state = out / (out / "latest").read_text().strip() / "train_state.json"
    edit_json(state, change)
    last_line_error(capsys, train_argv(data, out, "--max-steps", "4", "--resume"), state, named)


# ----------------------------------------------------------------------------- a full disk


def tree_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def full_disk(monkeypatch):
    """safetensors' writer writes part of its file, then fails as it does when the disk is full."""
    import safetensors.torch
    from safetensors import SafetensorError

    calls = []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        Path(filename).write_bytes(b"\0" * 1000)
        raise SafetensorError(DISK_FULL_TEXT)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_a_full_disk_during_convert_is_one_line(good, tmp_path, capsys, full_disk):
    out = tmp_path / "out"
    err = one_error(capsys, argv_for("convert", good, tmp_path),
                    f"the disk filled while writing {out} (No space left on device)", "bytes free",
                    "its tensors alone take", "the partial folder was removed")
    assert full_disk and sorted(p.name for p in tmp_path.iterdir()) == []  # no out, no temporary folder
    assert "SafetensorError" not in err


def test_a_full_disk_leaves_the_previous_checkpoint(good, tmp_path, full_disk):
    from glassformer.checkpoint.folders import save_model
    from glassformer.errors import DiskFullError

    dst = copy_of(good, tmp_path, "ckpt")
    before = tree_digest(dst)
    model, tok = load(good)
    with pytest.raises(DiskFullError, match=f"{re.escape(str(dst))} is as it was"):
        save_model(dst, model, tok)
    assert tree_digest(dst) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert isinstance(DiskFullError("x"), UserError) and isinstance(DiskFullError("x"), OSError)


def test_too_little_free_space_is_refused_before_writing(good, tmp_path, monkeypatch):
    """The bytes a save needs are checked against the free space first: nothing is written at all."""
    import glassformer.files as files
    from glassformer.checkpoint.folders import save_model

    monkeypatch.setattr(files, "free_bytes", lambda folder: 1000)
    model, tok = load(good)
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with pytest.raises(UserError, match=f"not enough space on the disk for .*out: its tensors alone take {need:,} bytes, "
                                        "1,000 are free; nothing was written"):
        save_model(tmp_path / "out", model, tok)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_during_training_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    """A run whose next checkpoint does not fit stops with the DiskFullError's own line (the folder and
    the bytes, each said once, and the previous checkpoint); that checkpoint is untouched and --resume
    continues from it once there is space."""
    import safetensors.torch
    from safetensors import SafetensorError

    from ..support import make_prepared

    data = make_prepared(tmp_path / "data", n_train=300, n_val=60)
    out = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(out), "--preset", "tiny", "--batch-size", "2", "--seq-len", "16",
            "--eval-every", "0", "--eval-tokens", "64", "--no-progress", "--threads", "1", "--max-steps", "4"]
    real, before = safetensors.torch.save_file, {}

    def full_at_step_4(tensors, filename, metadata=None):
        if ".step-000004.tmp-" not in filename:
            return real(tensors, filename, metadata=metadata)
        before.setdefault("step-000002", tree_digest(out / "step-000002"))  # complete, as the step-4 write begins
        raise SafetensorError(DISK_FULL_TEXT)

    monkeypatch.setattr(safetensors.torch, "save_file", full_at_step_4)
    capsys.readouterr()
    assert run_cli([*args, "--snapshot-every", "2"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err, err
    line = errors[0]
    assert line.startswith(f"error: the disk filled while writing {out}/step-000004 (No space left on device): "
                           "it needs more than the "), line
    assert f"; {out}/step-000002 is intact: --resume continues from it" in line, line
    for once in (f"{out}/step-000004", "No space left on device", "bytes free", "partial", "free some space"):
        assert line.count(once) == 1, line  # the loop's own wrapping said the folder and the advice twice
    assert "could not write checkpoint" not in line and "SafetensorError" not in line
    assert (out / "latest").read_text().strip() == "step-000002"
    assert tree_digest(out / "step-000002") == before["step-000002"]
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    monkeypatch.setattr(safetensors.torch, "save_file", real)  # space again
    assert run_cli([*args, "--snapshot-every", "2", "--resume"]) == 0
    assert (out / "latest").read_text().strip() == "step-000004"
