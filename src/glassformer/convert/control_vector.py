"""A steering vector as llama.cpp's control-vector GGUF (`llama-cli --control-vector F.gguf`).

llama.cpp's format (common/common.cpp, common_control_vector_load_one; src/llama-adapter.cpp): the
file's architecture is "controlvector", with `controlvector.model_hint` (the model's architecture)
and `controlvector.layer_count`; each tensor `direction.{il}` is F32, 1-D, n_embd long, and is added
to the OUTPUT of layer il (il >= 1: llama.cpp keeps no direction for layer 0, and its loader refuses
`direction.0`). Our vector is added to the stream ENTERING block L, which is the output of block
L - 1: so it is written as `direction.{L-1}`, and only L >= 2 has a place in the file.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

ARCH = "controlvector"


def direction_index(layer: int, n_layers: int) -> int:
    """llama.cpp's direction index for our 'stream entering block `layer`', or a UserError.

    >>> direction_index(2, 4), direction_index(3, 4)
    (1, 2)
    """
    if n_layers < 3:
        raise UserError(f"llama.cpp adds control vectors to the output of layers 1 and later (the stream entering "
                        f"our blocks 2 and later), and this {n_layers}-block model has no block 2: no control vector "
                        "can steer it")
    if layer < 2:
        raise UserError(f"the vector steers the stream entering block {layer}; llama.cpp adds control vectors to the "
                        f"output of layers 1..{n_layers - 1} only (the stream entering blocks 2..{n_layers - 1}; "
                        f"never layer 0's output): make the vector with --layer 2 or later")
    return layer - 1


def model_hint(vec) -> str:
    """The architecture llama.cpp runs the model as (the model GGUF's general.architecture): from the
    config the vector records; 'llama' when it records none or the model has no GGUF graph."""
    import json

    from ..config import ModelConfig
    from .gguf import gguf_arch

    text = vec.meta.get("config")
    if not text:
        return "llama"
    try:
        return gguf_arch(ModelConfig.from_dict(json.loads(text)))
    except (UserError, ValueError, TypeError, KeyError):
        return "llama"


def write_control_vector(vec, out: str | Path) -> Path:
    """Write `vec` (research.steering.SteeringVector, its scale baked in) as a control-vector GGUF."""
    import gguf
    import numpy as np

    out = Path(out)
    index = direction_index(vec.layer, vec.n_layers)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new file or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = (vec.direction.double() * vec.scale).float().numpy().astype(np.float32)  # (D,)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    try:
        w.add_string(f"{ARCH}.model_hint", model_hint(vec))
        w.add_uint32(f"{ARCH}.layer_count", 1)
        w.add_tensor(f"direction.{index}", data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    tmp.replace(out)  # a reader never sees half a file
    return out


def read_control_vector(path: str | Path, n_embd: int, n_layer: int, strength: float = 1.0):
    """llama.cpp's loader, in numpy: the float buffer `llama_set_adapter_cvec` takes, (n_layer - 1) ·
    n_embd long, layer 1 at [0] (each direction.{il} at (il - 1)·n_embd, times strength). For tests
    and for reading a file back; refuses what llama.cpp's loader refuses."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(str(path))
    buf = np.zeros(((n_layer - 1) * n_embd,), dtype=np.float32)
    for t in r.tensors:
        head, _, idx = t.name.partition(".")
        if head != "direction" or not idx.isdigit() or int(idx) == 0:
            raise UserError(f"{path}: tensor {t.name!r} is not direction.N with N >= 1")
        data = np.asarray(t.data, dtype=np.float32).reshape(-1)
        if data.shape[0] != n_embd:
            raise UserError(f"{path}: {t.name} has {data.shape[0]} numbers; the model's width is {n_embd}")
        il = int(idx)
        if il < n_layer:
            buf[(il - 1) * n_embd: il * n_embd] += data * strength
    return buf
