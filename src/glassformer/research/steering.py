"""Steering vectors (contrastive activation addition): the mean difference of the residual stream
entering block L between texts that show a behaviour and texts that do not, added back into that
stream while the model runs (Rimsky et al., 2024, "Steering Llama 2 via Contrastive Activation
Addition"; Turner et al., 2023, "Activation Addition").

Both the reading and the adding are forward pre-hooks on the model's own block `blocks[L]`: the
stream entering block L is exactly that block's first argument, whatever the norm placement. So the
one forward stays one, and steering works wherever the model runs: with the KV cache, batched rows,
a compiled step (its key names the hooks), the serve engine. The vector is added at every position,
prompt and new tokens alike, as llama.cpp adds a control vector. docs/research.md#steering-vectors.

File format (`.safetensors`): one float32 tensor `direction` (D,), and metadata `format`
("glassformer-steering"), `layer`, `dim`, `n_layers`, `reduce`, `positive`, `negative` (text
counts) and `config` (the model's config as JSON, for convert --control-vector's model hint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from .tokens import encode_texts

FORMAT = "glassformer-steering"
REDUCE = ("last", "mean")  # which positions of a text stand for it: its last token (CAA), or all of them


@dataclass
class SteeringVector:
    """A direction (D,) to add to the residual stream entering block `layer`, times `scale`."""

    direction: torch.Tensor  # (D,) float32
    layer: int
    n_layers: int  # of the model it was made on
    scale: float = 1.0
    meta: dict = field(default_factory=dict)  # reduce, positive, negative, config, ...

    @property
    def dim(self) -> int:
        return int(self.direction.shape[0])

    def scaled(self, scale: float) -> "SteeringVector":
        return SteeringVector(self.direction, self.layer, self.n_layers, float(scale), dict(self.meta))


# ----------------------------------------------------------------------------- reading the stream


def check_layer(layer: int, n_layers: int, flag: str = "--layer") -> None:
    if not 0 <= layer < n_layers:
        raise UserError(f"{flag} {layer}: this model has {n_layers} blocks, so the stream entering block "
                        f"0..{n_layers - 1}")


@torch.no_grad()
def stream_entering(model, rows: list[list[int]], layer: int, reduce: str = "last", batch: int = 16) -> torch.Tensor:
    """Each text's residual stream entering block `layer`, (n, D) in float32: at its last token
    (reduce='last') or averaged over its tokens ('mean'). Texts run right-padded in batches of
    `batch`: a causal model's positions never read the padding after them."""
    check_layer(layer, model.config.n_layers)
    if reduce not in REDUCE:
        raise UserError(f"reduce must be one of {', '.join(REDUCE)}, got {reduce!r}")
    caught: list[torch.Tensor] = []
    hook = model.blocks[layer].register_forward_pre_hook(lambda mod, args: caught.append(args[0]))
    device = next(model.parameters()).device
    out = []
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, len(rows), batch):
            part = rows[lo:lo + batch]
            n = torch.tensor([len(r) for r in part], device=device)  # (b,)
            T = int(n.max())
            ids = torch.tensor([r + [0] * (T - len(r)) for r in part], device=device)  # (b, T)
            caught.clear()
            model(ids, logits_at=n - 1)  # (the head runs on one position per row)
            x = caught[0].float()  # (b, T, D)
            if reduce == "last":
                out.append(x[torch.arange(len(part), device=device), n - 1])  # (b, D)
            else:
                keep = (torch.arange(T, device=device)[None] < n[:, None]).float()  # (b, T)
                out.append((x * keep[..., None]).sum(1) / n[:, None].float())  # (b, D)
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(out).cpu()  # (n, D)


def contrastive(model, tokenizer, positive: list[str], negative: list[str], layer: int,
                reduce: str = "last") -> SteeringVector:
    """mean(stream | positive) − mean(stream | negative) entering block `layer`."""
    S = model.config.max_seq_len
    check_layer(layer, model.config.n_layers)
    pos = stream_entering(model, encode_texts(tokenizer, positive, "--positive", S), layer, reduce)  # (P, D)
    neg = stream_entering(model, encode_texts(tokenizer, negative, "--negative", S), layer, reduce)  # (N, D)
    direction = (pos.double().mean(0) - neg.double().mean(0)).float()  # (D,)
    # The stream's typical length there, so a scale can be read against it (|v|/|x|).
    stream_norm = float(torch.cat([pos, neg]).norm(dim=-1).mean())
    meta = {"reduce": reduce, "positive": len(positive), "negative": len(negative), "stream_norm": stream_norm,
            "config": json.dumps(model.config.to_dict())}
    return SteeringVector(direction, layer, model.config.n_layers, 1.0, meta)


# ----------------------------------------------------------------------------- files


def save_vector(path: str | Path, vec: SteeringVector) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "layer": str(vec.layer), "dim": str(vec.dim), "n_layers": str(vec.n_layers),
            **{k: str(v) for k, v in vec.meta.items()}}
    tmp = path.with_name(path.name + ".tmp")
    save_file({"direction": vec.direction.float().contiguous()}, str(tmp), metadata=meta)
    tmp.replace(path)  # a reader never sees half a file
    return path


def parse_spec(spec: str) -> tuple[str, float]:
    """'VEC[:SCALE]' -> (path, scale). A path that itself holds ':' is taken whole when it exists.

    >>> parse_spec("happy.safetensors:-2.5"), parse_spec("happy.safetensors")
    (('happy.safetensors', -2.5), ('happy.safetensors', 1.0))
    """
    if Path(spec).exists() or ":" not in spec:
        return spec, 1.0
    path, _, scale = spec.rpartition(":")
    try:
        value = float(scale)
    except ValueError:
        raise UserError(f"--steer {spec}: the scale after ':' must be a number, got {scale!r} (VEC[:SCALE])") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise UserError(f"--steer {spec}: the scale must be a finite number")
    return path, value


def load_vector(spec: str) -> SteeringVector:
    """A vector file, 'VEC[:SCALE]', checked to be one steer wrote (not yet against a model: fits)."""
    from safetensors import SafetensorError, safe_open

    path, scale = parse_spec(spec)
    if not Path(path).is_file():
        raise UserError(f"steering vector {path} does not exist (make one with `glassformer steer ... --out VEC`)")
    try:
        with safe_open(path, "pt") as f:
            meta = dict(f.metadata() or {})
            names = list(f.keys())
            direction = f.get_tensor("direction") if "direction" in names else None
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"steering vector {path} is not a safetensors file: {str(e).splitlines()[0]}") from None
    if meta.get("format") != FORMAT or direction is None or direction.dim() != 1:
        raise UserError(f"{path} is not a steering vector (no 1-D 'direction' tensor with format {FORMAT}): "
                        "make one with `glassformer steer`")
    try:
        layer, n_layers = int(meta.pop("layer")), int(meta.pop("n_layers"))
    except (KeyError, ValueError):
        raise UserError(f"steering vector {path} names no layer: make it again with `glassformer steer`") from None
    meta.pop("format", None)
    meta.pop("dim", None)
    return SteeringVector(direction.float(), layer, n_layers, scale, {**meta, "path": str(path)})


def fits(vec: SteeringVector, cfg) -> None:
    """Refuse a vector made for another model: its width or its layer out of this model's range, both
    shapes named."""
    if vec.dim != cfg.dim or not 0 <= vec.layer < cfg.n_layers:
        where = vec.meta.get("path", "the steering vector")
        raise UserError(f"{where} was made for width {vec.dim} at the stream entering block {vec.layer} "
                        f"(of {vec.n_layers} blocks); this model has width {cfg.dim} and {cfg.n_layers} blocks "
                        f"(0..{cfg.n_layers - 1}): make the vector on this model")


# ----------------------------------------------------------------------------- steering


class Steering:
    """The forward pre-hooks that add the vectors to the stream entering their blocks. `row_scales`,
    when set to a tensor of at least B numbers, multiplies row b's addition by row_scales[b] (the serve
    engine's per-request `steer`, which it fills before each forward); None adds the same to every
    row. The model keeps the latest as `model.steering`, where the engine finds it."""

    def __init__(self, model, vectors: list[SteeringVector]):
        for v in vectors:
            fits(v, model.config)
        self.model, self.vectors = model, list(vectors)
        self.row_scales: torch.Tensor | None = None
        self._handles = []
        self._cast: dict[tuple, torch.Tensor] = {}
        by_layer: dict[int, torch.Tensor] = {}
        for v in vectors:  # several vectors at one layer add up, as llama.cpp sums control vectors
            by_layer[v.layer] = by_layer.get(v.layer, 0) + v.direction.double() * v.scale
        self.by_layer = {i: d.float() for i, d in by_layer.items()}  # layer -> (D,)
        for i in self.by_layer:
            self._handles.append(model.blocks[i].register_forward_pre_hook(self._hook(i)))
        model.steering = self

    def _add(self, i: int, x: torch.Tensor) -> torch.Tensor:
        key = (i, x.dtype, x.device)
        d = self._cast.get(key)
        if d is None:
            d = self._cast[key] = self.by_layer[i].to(device=x.device, dtype=x.dtype)  # (D,)
        if self.row_scales is None or self.row_scales.shape[0] < x.shape[0]:  # (an engine's buffer, a wider batch)
            return x + d
        s = self.row_scales[: x.shape[0]].to(device=x.device, dtype=x.dtype)  # (B,)
        return x + s[:, None, None] * d

    def _hook(self, i: int):
        def add(module, args):
            return (self._add(i, args[0]),) + tuple(args[1:])

        return add

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if getattr(self.model, "steering", None) is self:
            del self.model.steering

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def steer(model, vectors: SteeringVector | list[SteeringVector]) -> Steering:
    """Steer `model` from now on (until .remove(), or as a `with` block): the vectors, checked to
    fit it, added to the stream entering their blocks in every forward."""
    return Steering(model, [vectors] if isinstance(vectors, SteeringVector) else list(vectors))
