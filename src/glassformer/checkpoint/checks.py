"""Bad checkpoint files, each refused with one line that names the file and says what to do, before
anything large is allocated (docs/convert.md#bad-files). Every loader of weights comes through here:
native checkpoints, Hugging Face folders, adapter checkpoints, PEFT folders and training state.

    open_safetensors(file)        a safetensors file's handle; safetensors itself checks the header
                                  (its length against the file's, the JSON, each tensor's dtype, shape
                                  and offsets inside the file) before a tensor is read
    header_shapes(handle)         {name: shape}, from the header alone
    read_tensors(handle, file)    the tensors, read once the header has been checked against the config
    read_safetensors(file)        both at once, where nothing is to be checked in between (training state)
    json_object(value, file)      the JSON that must be an object (config.json, adapter_config.json)
    model_config(meta, file)      a native config.json's ModelConfig, every field's type checked
    check_fits_memory(cfg, ...)   the weights a config describes against this machine's memory
    check_layers_held(cfg, ...)   a config's layers against those its weights file holds
    check_adapter_file(...)       an adapter file's shapes against its rank and its base's products
"""

from __future__ import annotations

import re

from pathlib import Path

from ..config import ModelConfig
from ..cost.hardware import ram_bytes
from ..cost.params import num_weights
from ..cost.report import human
from ..errors import UserError

DAMAGED = "it is truncated or damaged: save, convert or download it again"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def open_safetensors(file: str | Path):
    """safe_open(file): the header is read and checked (safetensors refuses a header longer than
    100 MB or than the file, and tensors whose offsets pass the file's end) but no tensor is read.

    >>> open_safetensors("nothing/model.safetensors")
    Traceback (most recent call last):
    glassformer.errors.UserError: nothing/model.safetensors is missing: the checkpoint is incomplete; save, convert or download it again
    """
    from safetensors import safe_open

    if not Path(file).is_file():
        raise UserError(f"{file} is missing: the checkpoint is incomplete; save, convert or download it again")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error type (and OSError) for every bad header
        raise UserError(f"{file} is not a readable safetensors file ({_first_line(e)}): {DAMAGED}") from None


def header_shapes(handle) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the header alone."""
    return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}


def read_tensors(handle, file: str | Path, keys=None) -> dict:
    """The tensors named by keys (all by default), each read from the checked file."""
    try:
        return {k: handle.get_tensor(k) for k in (handle.keys() if keys is None else keys)}
    except Exception as e:  # the file changed under us, or a dtype this torch cannot hold
        raise UserError(f"{file}: a tensor could not be read ({_first_line(e)}): {DAMAGED}") from None


def read_safetensors(file: str | Path) -> dict:
    """Every tensor of a safetensors file (safetensors.torch.load_file, with a bad file refused by name)."""
    return read_tensors(open_safetensors(file), file)


def json_object(value, file: str | Path) -> dict:
    """value, the JSON of `file`, when it is an object; else a UserError naming the file."""
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", bool: "true/false", type(None): "null"}.get(type(value), "a number")
        raise UserError(f"{file} holds {kind}, not a JSON object of settings: {DAMAGED}")
    return value


def model_config(meta: dict, file: str | Path) -> ModelConfig:
    """The ModelConfig of a glassformer config.json ({"model": {...}}), every field's type and value
    checked (ModelConfig's own rules); a UserError naming the file and the field."""
    fields = meta.get("model")
    if not isinstance(fields, dict):
        raise UserError(f"{file}: \"model\" must be an object of ModelConfig fields, not {type(fields).__name__}: "
                        f"{DAMAGED}")
    try:
        return ModelConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise UserError(f"{file}: {_first_line(e)}: fix the file, or restore the config.json saved with these "
                        "weights") from None


def _shape_words(cfg: ModelConfig) -> str:
    return f"vocab_size {cfg.vocab_size:,}, dim {cfg.dim:,}, n_layers {cfg.n_layers:,}"


def check_fits_memory(cfg: ModelConfig, config_file: str | Path, bytes_per_weight: int) -> None:
    """Refuse a config whose weights, counted from the config alone (cost/params.py), would need more
    memory than this machine has (its RAM, os.sysconf), saying how much (a floor: the weights at
    bytes_per_weight), before a model of it is built or a tensor read."""
    weights = num_weights(cfg)
    need, ram = weights * bytes_per_weight, ram_bytes()
    if ram is not None and need > ram:
        raise UserError(f"{config_file} describes {weights:,} weights ({_shape_words(cfg)}), which need "
                        f"{human(need, 'B', 1024)} of memory; this machine has {human(ram, 'B', 1024)}: "
                        "check those sizes, or load it on a machine with more memory")


def layers_held(keys) -> int:
    """How many layers a weights file holds: one more than the highest layer number in its tensor
    names, the first number among each name's dotted parts (blocks.3.attn.wq.weight,
    model.layers.3.mlp.up_proj.weight, transformer.h.3.attn.c_attn.weight: 4); 0 when none has one.

    >>> layers_held(["embed.weight", "blocks.0.attn.wq.weight", "blocks.1.ffn.w_up.weight"])
    2
    """
    numbers = [next((int(p) for p in key.split(".") if p.isdigit()), -1) for key in keys]
    return max(numbers, default=-1) + 1


def check_layers_held(cfg: ModelConfig, config_file: str | Path, keys, weights_file: str | Path) -> None:
    """Refuse a config of more layers than its weights file holds (from the header's names), before a
    model of it is built: building 100,000 layers takes minutes and gigabytes even on the meta device.
    Any other disagreement is left to the exact check of every name and shape, which says more."""
    held = layers_held(keys)
    if cfg.n_layers > held:
        raise UserError(f"{config_file} says n_layers {cfg.n_layers:,}, but {weights_file} holds the weights of "
                        f"{held:,} layers: they do not belong together; restore the config.json saved with these weights")
    experts = experts_held(keys)
    if experts is not None and cfg.n_experts > experts:
        raise UserError(f"{config_file} says n_experts {cfg.n_experts:,}, but {weights_file} holds the weights of "
                        f"{experts:,} experts: they do not belong together; restore the config.json saved with these weights")


def experts_held(keys) -> int | None:
    """How many experts a weights file holds per layer, from names with an expert index after
    `experts.` (ours, and Mixtral's/Qwen3-MoE's/OLMoE's per-expert names); None when no name has one
    (a dense model, or experts stored as one fused tensor, whose shape check says more).

    >>> experts_held(["blocks.0.ffn.experts.0.w_up.weight", "blocks.0.ffn.experts.7.w_up.weight"])
    8
    """
    found = [int(m.group(1)) for m in map(_EXPERT.search, keys) if m]
    return max(found) + 1 if found else None


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def check_adapter_file(want: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], file: str | Path,
                       config_file: str | Path, r: int) -> None:
    """The adapter tensors a file holds (`shapes`, from its header, under adapter_state's keys) against
    those its config's rank r and targets would put on the base model (`want`, convert/lora.py
    adapter_shapes): a UserError naming both files before any adapter is allocated."""
    missing, unexpected = sorted(want.keys() - shapes.keys()), sorted(shapes.keys() - want.keys())
    if missing or unexpected:
        raise UserError(f"{file} does not match {config_file} and its base model: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}: restore the files saved together")
    wrong = sorted(k for k in want if shapes[k] != want[k])
    if wrong:
        k = wrong[0]
        rank = ""
        if len(shapes[k]) == 2:  # A is (r, in), B (out, r)
            rank = f" (the file holds rank-{shapes[k][0] if k.endswith('.lora_A') else shapes[k][1]} adapters)"
        raise UserError(f"{file} does not match {config_file} (r {r:,}) and its base model: {k} is {list(shapes[k])}, "
                        f"r {r:,} on this base implies {list(want[k])}{rank}: restore the files saved together")
