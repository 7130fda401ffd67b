"""Hugging Face Hub names, offline: a cache folder laid out the way huggingface_hub documents it
(HF_HOME/hub/models--org--name/{blobs, refs/<branch>, snapshots/<commit>/<file> -> ../../blobs/<hash>}),
holding tiny Llama models saved by transformers, read through huggingface_hub's own snapshot_download.

No test reaches the network: HF_HUB_OFFLINE=1, except the one that points the Hub at a closed local port.
"""

import hashlib
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from glassformer.checkpoint.folders import save_model  # noqa: E402
from glassformer.checkpoint.hub import FILES, PICKLE_FILES  # noqa: E402
from glassformer.checkpoint.loading import load  # noqa: E402
from glassformer.cli import main  # noqa: E402
from glassformer.errors import UserError  # noqa: E402

from ..support import reinit, tiny_model  # noqa: E402

V = 97
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
IDS = torch.tensor([[1, 5, 9, 33, 2, 71, 40, 8]])


def hf_llama(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return reinit(transformers.LlamaForCausalLM(cfg), std=0.15, seed=seed).eval()


def put_in_cache(hub: Path, repo: str, commit: str, folder: Path, refs: tuple[str, ...] = ()) -> None:
    """folder's files as snapshot `commit` of `repo`: content-addressed blobs, relative symlinks, refs."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # a commit hash, no newline, as huggingface_hub writes it


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """HF_HOME with org/name (main -> A, v1 -> B), org/native (a glassformer checkpoint) and
    the folders they came from: (home, {name: (folder, reference logits)})."""
    root = tmp_path_factory.mktemp("hub")
    hub, made = root / "home" / "hub", {}
    for seed, commit, refs in ((0, COMMIT_A, ("main",)), (1, COMMIT_B, ("v1",))):
        hf = hf_llama(seed)
        hf.save_pretrained(root / commit)
        put_in_cache(hub, "org/name", commit, root / commit, refs)
        made[commit] = root / commit, logits_of(hf)
    native = tiny_model(seed=2)
    save_model(root / "native", native)
    put_in_cache(hub, "org/native", COMMIT_A, root / "native", ("main",))
    made["native"] = root / "native", logits_of(native)
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_bytes((root / COMMIT_A / "config.json").read_bytes())
    put_in_cache(hub, "org/config-only", COMMIT_A, root / "config-only", ("main",))
    return root / "home", made


@pytest.fixture
def offline(models, monkeypatch):
    home, made = models
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return made


def assert_same(ref: torch.Tensor, got: torch.Tensor) -> None:
    assert ref.abs().max() > 0.1
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("name,expect", [
    ("org/name", COMMIT_A), ("org/name@main", COMMIT_A), ("org/name@v1", COMMIT_B),
    (f"org/name@{COMMIT_B}", COMMIT_B), ("org/native", "native"),
])
def test_a_hub_name_loads_its_snapshot(offline, name, expect):
    folder, ref = offline[expect]
    model, _ = load(name)
    assert_same(ref, logits_of(model))
    local, _ = load(folder)  # the same model as the folder the snapshot was made from
    assert torch.equal(logits_of(local), logits_of(model))


def test_hf_hub_cache_comes_before_hf_home(offline, models, monkeypatch, tmp_path):
    import glassformer

    home, _ = models
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    model, _ = glassformer.load("org/name@v1")
    assert_same(offline[COMMIT_B][1], logits_of(model))


def test_an_existing_path_wins_over_a_hub_name(offline, tmp_path, monkeypatch):
    folder, ref = offline[COMMIT_B]
    (tmp_path / "org").mkdir()
    os.symlink(folder, tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    model, _ = load("org/name")  # the folder here (B), not the cache's main (A)
    assert_same(ref, logits_of(model))


def test_convert_from_hf_takes_a_hub_name(offline, tmp_path):
    folder, ref = offline[COMMIT_B]
    assert main(["convert", "--from-hf", "org/name@v1", "--out", str(tmp_path / "out")]) == 0
    model, _ = load(tmp_path / "out")
    assert_same(ref, logits_of(model))


def test_train_init_from_takes_a_hub_name(offline):
    from glassformer.config import TrainConfig
    from glassformer.train.setup import build_model

    _, ref = offline[COMMIT_A]
    model, grown = build_model(TrainConfig(init_from="org/name"), {"vocab_size": V})
    assert grown is None
    assert_same(ref, logits_of(model.eval()))


@pytest.mark.parametrize("name,missing", [("org/missing", "org/missing"), ("org/name@v2", "org/name@v2")])
def test_offline_and_missing_names_both_readings(offline, name, missing):
    with pytest.raises(UserError) as e:
        load(name)
    msg = str(e.value)
    assert f"no folder {name} here" in msg
    assert f"{missing} is not in the Hugging Face cache (offline" in msg


def test_the_cli_prints_the_offline_error_on_one_line(offline, capsys):
    assert main(["generate", "--checkpoint", "org/missing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no folder org/missing here") and "Hugging Face cache" in err
    assert err.count("\n") == 1


def test_a_path_that_is_no_hub_name_keeps_the_folder_error(offline):
    with pytest.raises(UserError, match="does not exist"):
        load("runs/demo/step-000100")


def test_an_unreachable_hub_is_a_clear_error(offline, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(UserError, match="no folder org/missing here, and the Hugging Face Hub could not be reached"):
        load("org/missing")


def test_without_huggingface_hub_the_error_says_what_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # `import huggingface_hub` now fails
    with pytest.raises(UserError, match=r'pip install "glassformer\[hf\]"'):
        load("org/name")


def test_only_what_loading_reads_is_fetched():
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
            "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "additional_chat_templates/tool_use.jinja", "COMPLETE", "adapter.safetensors",
            "README.md",
            ".gitattributes", "consolidated.safetensors", "original/model.safetensors", "onnx/model.onnx",
            "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
            "tf_model.h5", "flax_model.msgpack", "model.gguf"]
    got = set(filter_repo_objects(repo, allow_patterns=FILES))
    assert got == set(repo[:12])
    with_pickle = set(filter_repo_objects(repo, allow_patterns=FILES + PICKLE_FILES))
    assert with_pickle - got == {"pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"}


def test_cost_reads_only_the_config_and_load_wants_weights(offline, capsys):
    assert main(["cost", "--checkpoint", "org/config-only"]) == 0  # the cost of a model whose weights never came
    assert capsys.readouterr().out
    with pytest.raises(UserError, match="org/config-only on the Hugging Face Hub has no weights glassformer reads"):
        load("org/config-only")
