"""Hugging Face folders in and out: config.json + safetensors (single or sharded) + tokenizer.json
(+ tokenizer_config.json, chat_template.jinja, generation_config.json).

    load_hf(folder)        -> (Transformer, tokenizer or None)
    save_hf(model, out)    -> the folder written (config.json, model.safetensors, tokenizer.json)
Every tensor is used by a rule (families.py) and every shape is checked before any data is
read; pickled `.bin` files only with allow_pickle (docs/convert.md#files, #errors).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint.builder import model_from_state, model_state
from ..checkpoint.checks import check_fits_memory, check_layers_held, open_safetensors
from ..checkpoint.folders import tensor_bytes, write_tokenizer
from ..config import ModelConfig
from ..errors import UserError
from ..files import atomic_folder, read_json
from .families import Family, family_for, family_named
from .transforms import Rule

SAFE, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# ----------------------------------------------------------------------------- reading weights


class Weights:
    """The tensors of a folder by name, read lazily: key -> (file, shape, read())."""

    def __init__(self) -> None:
        self.file: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self._read: dict[str, Callable[[], torch.Tensor]] = {}

    def add(self, key: str, file: Path, shape, read: Callable[[], torch.Tensor]) -> None:
        if key in self.file:
            raise UserError(f"{key} is stored twice: in {self.file[key].name} and {file.name}")
        self.file[key], self.shape[key], self._read[key] = file, tuple(shape), read

    def read(self, key: str) -> torch.Tensor:
        return self._read[key]()

    def take(self, key: str) -> tuple[Path, tuple[int, ...], Callable[[], torch.Tensor]]:
        """Remove `key` and give back its (file, shape, read): for a family that stores a tensor in
        another layout (families_moe.py's fused and MXFP4 experts) to add its pieces in its place."""
        return self.file.pop(key), self.shape.pop(key), self._read.pop(key)

    def rename(self, fn: Callable[[str], str]) -> None:
        self.file = {fn(k): v for k, v in self.file.items()}
        self.shape = {fn(k): v for k, v in self.shape.items()}
        self._read = {fn(k): v for k, v in self._read.items()}

    def drop(self, keep: Callable[[str], bool]) -> None:
        """Forget every tensor whose name `keep` refuses (never read: a multimodal folder's vision tower)."""
        for key in [k for k in self.file if not keep(k)]:
            del self.file[key], self.shape[key], self._read[key]


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a valid index file (needs a 'weight_map'): {e}") from None
    return weight_map


def _add_safetensors(w: Weights, file: Path, only: set[str] | None = None) -> None:
    handle = open_safetensors(file)  # the header checked, no tensor read
    keys = set(handle.keys())
    if only is not None:
        if keys - only:
            extra = sorted(keys - only)
            raise UserError(f"{file.name} holds {extra[:3]} which its index file does not list")
        if only - keys:
            raise UserError(f"the index file lists {sorted(only - keys)[:3]} in {file.name}, which does not hold them")
    for key in sorted(keys):
        w.add(key, file, handle.get_slice(key).get_shape(), lambda h=handle, k=key: h.get_tensor(k))


def _add_pickle(w: Weights, file: Path) -> None:
    try:
        try:  # mmap avoids a second copy in memory; files in the pre-1.6 format cannot be mapped
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"{file} could not be read with torch.load(weights_only=True): {e}") from None
    if not isinstance(state, dict):
        raise UserError(f"{file} holds a {type(state).__name__}, not a dict of tensors")
    for key, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{file}: {key} is a {type(t).__name__}, not a tensor")
        w.add(key, file, t.shape, lambda t=t: t)


def open_weights(folder: Path, allow_pickle: bool = False) -> Weights:
    """Every tensor of a Hugging Face folder, from model.safetensors, its sharded index, or (if allowed) pickles."""
    w = Weights()
    safe = (folder / SAFE_INDEX).is_file()
    if safe or ((folder / PICKLE_INDEX).is_file() and not (folder / SAFE).is_file()):
        index = folder / (SAFE_INDEX if safe else PICKLE_INDEX)
        if not safe and not allow_pickle:
            raise UserError(_pickle_refusal(index))
        by_file: dict[str, set[str]] = {}
        for key, name in _index_map(index).items():
            by_file.setdefault(name, set()).add(key)
        for name in sorted(by_file):
            shard = folder / name
            if not shard.is_file():
                raise UserError(f"{index.name} names {name}, which is not in {folder}")
            if safe:
                _add_safetensors(w, shard, by_file[name])
            else:
                _add_pickle(w, shard)
        return w
    if (folder / SAFE).is_file():
        _add_safetensors(w, folder / SAFE)
        return w
    if (folder / PICKLE).is_file():
        if not allow_pickle:
            raise UserError(_pickle_refusal(folder / PICKLE))
        _add_pickle(w, folder / PICKLE)
        return w
    raise UserError(f"{folder} holds no weights: expected {SAFE}, {SAFE_INDEX} or {PICKLE}")


def _pickle_refusal(file: Path) -> str:
    return (
        f"{file} is a pickled PyTorch checkpoint, and unpickling can run code: convert it to safetensors, "
        "or pass --allow-pickle (allow_pickle=True) to read it with torch.load(weights_only=True)"
    )


# ----------------------------------------------------------------------------- checking and mapping


def read_hf_config(folder: str | Path) -> dict:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: give a Hugging Face model folder (config.json + *.safetensors)")
    if not path.is_file():
        raise UserError(f"{folder} has no config.json: give a Hugging Face model folder (config.json + *.safetensors)")
    hf = read_json(path)
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise UserError(f"{path} has no model_type: it is not a Hugging Face transformers config")
    return hf


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor in our state dict for cfg (tied head stored once), built on the meta device."""
    from ..model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    sd = model.state_dict()
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight")
    return {k: tuple(v.shape) for k, v in sd.items()}


def hf_shapes(family: Family, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every Hugging Face tensor the config implies: the rules' to_hf run on meta tensors."""
    ours = {k: torch.empty(s, device="meta") for k, s in our_shapes(cfg).items()}
    rules = family.rules(cfg)
    covered = [k for r in rules for k in r.ours]
    assert sorted(covered) == sorted(ours), f"{family.name} rules do not cover our state dict: {set(ours) ^ set(covered)}"
    return {r.hf: tuple(r.to_hf(ours, cfg).shape) for r in rules}


def _listing(keys: list[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def check_weights(w: Weights, family: Family, cfg: ModelConfig, folder: Path) -> list[Rule]:
    """The rules to apply, after checking that every key is used, none missing, every shape right."""
    adapt = getattr(family, "adapt_weights", None)  # a family that also reads other layouts (families_moe.py)
    if adapt is not None:
        adapt(w, cfg)
    if w.file and not any(k.startswith(family.prefix) for k in w.file):
        # Saved from the base model (the hub's gpt2 is): names lack the prefix.
        w.rename(lambda k: k if k.startswith("lm_head.") else family.prefix + k)
    rules = family.rules(cfg)
    want = hf_shapes(family, cfg)
    tied_head = cfg.tie_embeddings and "lm_head.weight" in w.file
    unexpected = [k for k in w.file if k not in want and not family.ignored(k) and not (tied_head and k == "lm_head.weight")]
    missing = [k for k in want if k not in w.file]
    if missing:
        raise UserError(f"{folder}: missing weights {_listing(missing)} (config.json says {cfg.n_layers} layers)")
    if unexpected:
        raise UserError(f"{folder}: unexpected weights {_listing(unexpected)} that no {family.name} rule uses")
    for key, shape in want.items():
        if w.shape[key] != shape:
            raise UserError(
                f"{w.file[key].name}: {key} has shape {list(w.shape[key])}, but config.json implies {list(shape)}"
            )
    if tied_head and w.shape["lm_head.weight"] != want[family.embed_key]:
        raise UserError(f"{w.file['lm_head.weight'].name}: lm_head.weight has shape {list(w.shape['lm_head.weight'])}, "
                        f"but the tied embedding is {list(want[family.embed_key])}")
    return rules


def hf_to_our_state(w: Weights, family: Family, cfg: ModelConfig, folder: Path, dtype: torch.dtype | None):
    """Our state dict from a checked Hugging Face folder, cast to dtype (None: the stored dtype)."""
    rules = check_weights(w, family, cfg, folder)
    dtype = dtype or w.read(family.embed_key).dtype
    if dtype not in _DTYPE_NAMES:
        raise UserError(f"{folder}: weights are {dtype}; glassformer reads float32, float16 and bfloat16 (use --dtype)")
    state: dict[str, torch.Tensor] = {}
    for rule in rules:
        t = w.read(rule.hf)
        if not t.is_floating_point():
            raise UserError(f"{w.file[rule.hf].name}: {rule.hf} is {t.dtype}, not a floating-point tensor")
        for k, v in rule.to_ours(t, cfg).items():
            state[k] = v.to(dtype).contiguous()
    if cfg.tie_embeddings and "lm_head.weight" in w.file:
        head = w.read("lm_head.weight").to(dtype)
        if not torch.equal(head, state["embed.weight"]):
            raise UserError(f"{w.file['lm_head.weight'].name}: config.json says tie_word_embeddings, "
                            "but lm_head.weight differs from the token embedding")
    return state


def _tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from ..text.tokenizer import Tokenizer
    except ImportError:
        return None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # a foreign tokenizer.json the class cannot read: the model still loads
        warnings.warn(f"{path} could not be read as a glassformer tokenizer ({e}); continuing without one")
        return None
    # tokenizer_config.json (chat template, special tokens), chat_template.jinja, generation_config.json:
    # a malformed one is the user's error, not a reason to drop the tokenizer.
    return tok.read_configs(folder)


def load_hf(folder: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
            allow_pickle: bool = False):
    """(model, tokenizer or None) from a Hugging Face folder. dtype None keeps the stored dtype."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    family = family_named(hf["model_type"], str(folder / "config.json"))
    cfg, dtype = family.config_from_hf(hf), parse_dtype(dtype)
    w = open_weights(folder, allow_pickle)
    # Before the rules build a model of cfg (on the meta device, which takes minutes for 100,000 layers):
    # its layers against those the files hold, its weights against this machine's memory (a stored
    # dtype is at least 2 bytes a number).
    check_layers_held(cfg, folder / "config.json", w.file, folder)
    check_fits_memory(cfg, folder / "config.json", dtype.itemsize if dtype else 2)
    state = hf_to_our_state(w, family, cfg, folder, dtype)
    return model_from_state(cfg, state, device, where=str(folder)), _tokenizer(folder)


# ----------------------------------------------------------------------------- writing


def hf_state_from_model(model: torch.nn.Module, family: Family, dtype: torch.dtype | None = None) -> dict:
    cfg = model.config
    ours = model_state(model)
    out = {}
    for rule in family.rules(cfg):
        t = rule.to_hf(ours, cfg)
        out[rule.hf] = (t if dtype is None else t.to(dtype)).detach().to("cpu").contiguous()
    return out


def hf_config(model: torch.nn.Module, family: Family, dtype: torch.dtype, eot_id: int | None) -> dict[str, Any]:
    hf = family.config_to_hf(model.config)
    hf["torch_dtype"] = hf["dtype"] = _DTYPE_NAMES[dtype]  # transformers < 5 reads the first, >= 5 the second
    # GPT-2's end-of-text token also begins a text; Llama-family models have a separate BOS we do not know.
    hf["bos_token_id"] = eot_id if family.name == "gpt2" else None
    hf["eos_token_id"] = eot_id
    hf["pad_token_id"] = None
    return hf


def save_hf(model: torch.nn.Module, out: str | Path, tokenizer: Any = None, dtype: str | torch.dtype | None = None,
            eot_id: int | None = None, family: str | None = None) -> Path:
    """Write `model` as a Hugging Face folder of the family that can hold it (atomically).

    family: a model_type to write instead of the first family that holds the model (e.g. 'phi3',
    whose fused projections hold what Llama's separate ones do); refused by name if it cannot.
    tokenizer: None, a tokenizer.json path (copied as is, with tokenizer_config.json, chat_template.jinja
    and generation_config.json beside it), or a Tokenizer (written by save_folder).
    eot_id: the end-of-text id for config.json (default: tokenizer.eot_id when it has one).
    """
    from safetensors.torch import save_file

    family = family_for(model.config, family)
    dtype = parse_dtype(dtype) or next(model.parameters()).dtype
    state = hf_state_from_model(model, family, dtype)
    eot = eot_id if eot_id is not None else getattr(tokenizer, "eot_id", None)

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(hf_config(model, family, dtype, eot), indent=2) + "\n")
        save_file(state, str(tmp / SAFE), metadata={"format": "pt"})
        write_tokenizer(tmp, tokenizer)

    return atomic_folder(out, write, need=tensor_bytes(state))


def to_transformers(model: torch.nn.Module, dtype: str | torch.dtype | None = None, family: str | None = None,
                    **kwargs):
    """A `transformers` model holding exactly `model`'s weights (exported by save_hf and loaded
    back by transformers itself), on the same device: the twin for side-by-side comparisons.
    family: as save_hf's (e.g. 'phi3'); kwargs go to from_pretrained (e.g. attn_implementation="sdpa")."""
    import tempfile

    import transformers

    dtype = parse_dtype(dtype) or next(model.parameters()).dtype
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_hf(model, Path(tmp) / "hf", dtype=dtype, family=family)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    return hf.to(next(model.parameters()).device)
