"""The one way to build a model from a (config, state dict): native checkpoints, Hugging Face
folders and resumed training runs all come through `model_from_state`."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..convert.quantize import quantize_stored
from ..errors import UserError
from ..model import Transformer, rope_inv_freq


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() with a tied LM head stored once (as embed.weight), contiguous, detached."""
    sd = model.state_dict()
    if getattr(model.config, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)
    return {k: v.detach().contiguous() for k, v in sd.items()}


def _check_state(model: Transformer, state: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor the (meta) model has, no other, each of the shape its config implies."""
    want = model.state_dict()
    missing = sorted(k for k in want.keys() - state.keys() if not (k == "lm_head.weight" and model.config.tie_embeddings))
    unexpected = sorted(state.keys() - want.keys())
    if missing or unexpected:
        raise UserError(f"{where} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    wrong = [f"{k} is {list(state[k].shape)}, the config implies {list(want[k].shape)}"
             for k in sorted(state) if state[k].shape != want[k].shape]
    if wrong:
        raise UserError(f"{where} does not match its config: {'; '.join(wrong[:3])}")


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, where: str = "the state dict") -> Transformer:
    """A Transformer in eval mode holding exactly `state` (a tied head may be absent), on device,
    cast to dtype (None keeps the stored dtype). Built on the meta device and the tensors
    assigned, so no second copy of the weights is made; `where` names the source in errors."""
    with torch.device("meta"):
        model = Transformer(cfg)
        if cfg.quantization is not None:  # the stored structure first, then its tensors
            quantize_stored(model, cfg.quantization, where)
    _check_state(model, state, where)
    model.load_state_dict(state, strict=True, assign=True)  # a tied head is filled by the model's load hook
    if cfg.pos == "rope":  # non-persistent buffers: recomputed, never stored
        model.rope_inv_freq = rope_inv_freq(cfg)
        if cfg.rope_local_theta is not None:
            model.rope_local_inv_freq = rope_inv_freq(cfg, local=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()
