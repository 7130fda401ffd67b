"""GGUF back to glassformer: `glassformer convert --from-gguf FILE.gguf --out CKPT`.

For the llama, qwen2 and gpt2 files that gguf.py writes, in f32, f16, bf16 or q8_0 (q8_0
blocks dequantized to float32): the same rules read backwards, so a round trip gives the same
logits. The config comes from the file's `glassformer.config` key where it has one, else from
llama.cpp's own keys; the tokenizer from `tokenizer.huggingface.json`, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError
from .gguf import CONFIG_KEY, TOKENIZER_FILES_KEY, gguf_rules


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value.item() if hasattr(value, "item") else value


def _f32(value) -> float:
    """A float32 key as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    import numpy as np

    return float(np.format_float_scientific(np.float32(value), unique=True))


def _config_from_keys(reader, arch: str, tensors: dict) -> ModelConfig:
    """A ModelConfig from llama.cpp's keys alone (a GGUF file written by another tool)."""
    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise UserError(f"the GGUF file has no {arch}.{key}: it is incomplete")
        return value

    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists dimensions innermost first: (D, V)
    common = dict(vocab_size=vocab, dim=int(need("embedding_length")), n_layers=int(need("block_count")),
                  n_heads=int(need("attention.head_count")), ffn_dim=int(need("feed_forward_length")),
                  max_seq_len=int(need("context_length")), tie_embeddings="output.weight" not in tensors)
    if arch == "gpt2":
        return ModelConfig(**common, norm="layer", ffn="gelu_tanh", pos="learned", bias=True,
                           norm_eps=_f32(need("attention.layer_norm_epsilon")))
    if "rope_freqs.weight" in tensors:
        raise UserError("this GGUF file scales RoPE with a rope_freqs tensor but has no glassformer.config "
                        "to say how: glassformer reads the rope_freqs of the files it writes only")
    scaling = None
    if _field(reader, f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    return ModelConfig(**common, n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", common["n_heads"])),
                       head_dim=int(_field(reader, f"{arch}.attention.key_length", common["dim"] // common["n_heads"])),
                       rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)), rope_scaling=scaling,
                       norm_eps=_f32(need("attention.layer_norm_rms_epsilon")), qkv_bias=arch == "qwen2")


def _dtype(reader) -> torch.dtype:
    """The checkpoint's dtype: the file's (q8_0's dequantized blocks are float32)."""
    from gguf import LlamaFileType as F

    kind = _field(reader, "general.file_type", F.ALL_F32)
    return {F.MOSTLY_F16: torch.float16, F.MOSTLY_BF16: torch.bfloat16}.get(kind, torch.float32)


def _tensor(t) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in numpy order: (out, in) for a projection."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists (in, out); numpy and torch (out, in)
    if t.tensor_type in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    if t.tensor_type == Q.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    if t.tensor_type == Q.Q8_0:
        return torch.from_numpy(quants.dequantize(np.array(t.data), Q.Q8_0)).reshape(shape)
    raise UserError(f"tensor {t.name} is {t.tensor_type.name}; glassformer reads f32, f16, bf16 and q8_0 GGUF files")


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, our state dict, tokenizer files by name) of a GGUF file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} is not a file: give a .gguf file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/struct errors on a foreign file
        raise UserError(f"{path} is not a readable GGUF file: {e}") from None
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "gpt2"):
        raise UserError(f"{path}: architecture {arch!r}; glassformer reads llama, qwen2 and gpt2 GGUF files")
    tensors = {t.name: t for t in reader.tensors}
    own = _field(reader, CONFIG_KEY)
    cfg = ModelConfig.from_dict(json.loads(own)) if own else _config_from_keys(reader, arch, tensors)
    dtype = _dtype(reader)
    state: dict[str, torch.Tensor] = {}
    rules = gguf_rules(cfg, arch)
    missing = [r.gguf for r in rules if r.gguf not in tensors]
    if missing:
        raise UserError(f"{path}: missing tensors {missing[:3]} that its config implies")
    for rule in rules:
        for k, v in rule.to_ours(_tensor(tensors[rule.gguf]), cfg, arch).items():
            state[k] = v.to(dtype).contiguous()
    return cfg, state, _tokenizer_files(reader)


def _tokenizer_files(reader) -> dict:
    """tokenizer.json (exact) and the files beside it, rebuilt from the keys where the file lacks ours."""
    text = _field(reader, "tokenizer.huggingface.json")
    if text is None:
        return {}
    files = {"tokenizer.json": text}
    own = _field(reader, TOKENIZER_FILES_KEY)
    if own:
        return {**files, **json.loads(own)}
    config = {}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    for name in ("bos", "eos"):
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None and tokens is not None:
            config[f"{name}_token"] = tokens.contents(int(i))
    if config:
        files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    return files


def gguf_to_checkpoint(path: str | Path, out: str | Path) -> tuple[torch.nn.Module, Path]:
    """Write the GGUF file `path` as a glassformer checkpoint folder `out` (atomically): (model, out)."""
    from ..checkpoint.builder import model_from_state
    from ..checkpoint.folders import write_state_files
    from ..files import atomic_folder

    cfg, state, files = read_gguf(path)
    model = model_from_state(cfg, state, dtype=next(iter(state.values())).dtype, where=str(path))

    def write(tmp: Path) -> None:
        write_state_files(tmp, cfg, state)
        for name, text in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(text, encoding="utf-8")

    return model, atomic_folder(out, write)
