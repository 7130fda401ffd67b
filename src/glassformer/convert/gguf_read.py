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
from .gguf import CONFIG_KEY, FAMILY_ARCH, MOE_ARCH, TOKENIZER_FILES_KEY, gguf_rules

DAMAGED = "it is truncated, damaged or not a GGUF file: convert or download it again"


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _open(path: Path):
    """A GGUFReader on the file, or one line naming it. The reader maps the file and reads its header
    alone: each tensor becomes a view of the mapped bytes, sized from the header's dimensions, and
    one that would pass the file's end is refused there (a truncated file), so nothing is allocated
    for what the header claims."""
    import gguf

    if not path.is_file():
        raise UserError(f"{path} is not a file: give a .gguf file")
    if path.stat().st_size == 0:
        raise UserError(f"{path} is empty (0 bytes): {DAMAGED}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # ValueError, struct and numpy errors on a cut or foreign file
        raise UserError(f"{path} is not a readable GGUF file ({_first_line(e)}): {DAMAGED}") from None


def _own_config(own, path: Path) -> ModelConfig:
    """The ModelConfig in the file's glassformer.config key (JSON of ModelConfig fields), checked."""
    from ..checkpoint.checks import json_object

    where = f"{path}'s {CONFIG_KEY} key"
    try:
        fields = json.loads(own) if isinstance(own, str) else own
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON ({e}): {DAMAGED}") from None
    try:
        return ModelConfig.from_dict(json_object(fields, where))
    except (ValueError, TypeError) as e:
        raise UserError(f"{where}: {_first_line(e)}: {DAMAGED}") from None


def _config(reader, arch: str, tensors: dict, path: Path) -> ModelConfig:
    """The file's config (its glassformer.config, else llama.cpp's keys), checked against its
    tensors' layers and the machine's memory before a tensor is read."""
    from ..checkpoint.checks import check_fits_memory, layers_held

    own = _field(reader, CONFIG_KEY)
    where = f"{path}'s {CONFIG_KEY} key" if own else str(path)
    if own:
        cfg = _own_config(own, path)
    else:
        if "token_embd.weight" not in tensors:
            raise UserError(f"{path}: no token_embd.weight tensor: {DAMAGED}")
        try:
            cfg = _config_from_keys(reader, arch, tensors)
        except (ValueError, TypeError) as e:  # a key of the wrong kind, or values ModelConfig refuses
            raise UserError(f"{path}: its {arch}.* keys do not make a model ({_first_line(e)}): {DAMAGED}") from None
    held = layers_held(tensors)  # building a model of n_layers 100,000 takes minutes, even on the meta device
    if cfg.n_layers > held:
        raise UserError(f"{where} says n_layers {cfg.n_layers:,}, but the file holds the tensors of {held:,} layers: "
                        f"{DAMAGED}")
    check_fits_memory(cfg, where, _dtype(reader).itemsize)
    return cfg


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(config, our state dict, tokenizer files by name) of a GGUF file."""
    path = Path(path)
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    graphs = [*FAMILY_ARCH.values(), *(a for a in MOE_ARCH.values() if a != "llama")]  # Mixtral's is the llama graph
    family_graph = arch in graphs
    if arch not in ("llama", "qwen2", "gpt2") and not family_graph:
        raise UserError(f"{path}: architecture {arch!r}; glassformer reads llama, qwen2 and gpt2 GGUF files "
                        f"({', '.join(graphs)} ones that it wrote itself)")
    if family_graph and not _field(reader, CONFIG_KEY):
        # llama.cpp's keys leave out what these graphs hard-code (Gemma's layer pattern, SmolLM3's NoPE step):
        # only a file that carries its own config says the whole model.
        raise UserError(f"{path}: a {arch} GGUF file without glassformer's {CONFIG_KEY} key; glassformer reads {arch} "
                        "files that it wrote itself (convert the Hugging Face folder with --from-hf instead)")
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(reader, arch, tensors, path)
    dtype = _dtype(reader)
    state: dict[str, torch.Tensor] = {}
    rules = gguf_rules(cfg, arch)
    missing = [r.gguf for r in rules if r.gguf not in tensors]
    if missing:
        raise UserError(f"{path}: missing tensors {missing[:3]} that its config implies")
    for rule in rules:
        try:
            ours = rule.to_ours(_tensor(tensors[rule.gguf]), cfg, arch)
        except (RuntimeError, ValueError) as e:  # a shape its config cannot take apart
            raise UserError(f"{path}: tensor {rule.gguf} {[int(d) for d in tensors[rule.gguf].shape]} does not fit its config "
                            f"({_first_line(e)}): {DAMAGED}") from None
        for k, v in ours.items():
            state[k] = v.to(dtype).contiguous()
    return cfg, state, _tokenizer_files(reader, path)


def _side_files(own, path: Path) -> dict[str, str]:
    """The glassformer.tokenizer_files key: {name: text} of the files gguf.py put beside tokenizer.json.
    Only those names are taken (checkpoint/folders.py's side files, and templates in their folder),
    so a file cannot write outside the checkpoint it makes (../x, /abs/x)."""
    from ..checkpoint.folders import TOKENIZER_SIDE_DIR, TOKENIZER_SIDE_FILES

    where = f"{path}'s {TOKENIZER_FILES_KEY} key"
    try:
        files = json.loads(own) if isinstance(own, str) else own
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON ({e}): {DAMAGED}") from None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise UserError(f"{where} is not a JSON object of file names and texts: {DAMAGED}")
    for name in files:
        folder, _, file = name.rpartition("/")
        ours = name in TOKENIZER_SIDE_FILES or (folder == TOKENIZER_SIDE_DIR and file.endswith(".jinja")
                                                and file != ".jinja" and "\\" not in file)
        if not ours:
            raise UserError(f"{where} names {name!r}, not a tokenizer file glassformer writes beside tokenizer.json "
                            f"({', '.join(TOKENIZER_SIDE_FILES)}, {TOKENIZER_SIDE_DIR}/*.jinja): {DAMAGED}")
    return files


def _tokenizer_files(reader, path: Path) -> dict:
    """tokenizer.json (exact) and the files beside it, rebuilt from the keys where the file lacks ours."""
    text = _field(reader, "tokenizer.huggingface.json")
    if text is None:
        return {}
    files = {"tokenizer.json": text}
    own = _field(reader, TOKENIZER_FILES_KEY)
    if own:
        return {**files, **_side_files(own, path)}
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
