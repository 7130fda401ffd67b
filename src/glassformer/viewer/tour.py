"""The guided walk's numbers that a trace does not hold (static/tour.js draws the walk).

A trace holds every activation of the sentence; the walk also shows a few weights (the columns
of W_Q and W_up that the walkthrough prints beside the products they make), a reference model's
KV cache beside this one's, and, for the walkthrough's one-head toy model, the figures of its
four-head variants (MHA, and GQA / MQA by averaging W_K and W_V), which its own trace cannot hold.
"""

from __future__ import annotations

import functools

import torch

from ..convert.lora import merged_weight
from ..worked.figures import figures, llama3_8b_kv_cache
from ..worked.model import SENTENCE

COLUMNS = 4  # weight columns shown per matrix
ENTRIES = 8  # entries shown per column (the page's vector cap)


def _plain(t: torch.Tensor) -> list[float]:
    return [round(float(x), 6) + 0.0 for x in t.tolist()]


def _weight(module) -> torch.Tensor | None:
    """The matrix a projection multiplies by, [out, in]: an int8 one's dequantized, a LoRA one's merged
    (what the forward computes with), or None for a module with no single matrix."""
    if hasattr(module, "lora_A") and hasattr(module, "base"):
        base = _weight(module.base)
        return None if base is None else merged_weight(base.float(), module.lora_A, module.lora_B, module.scale)
    if hasattr(module, "dequantized"):
        return module.dequantized()
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def _columns(weight: torch.Tensor, n: int) -> dict:
    """The first n columns of a weight in math layout ([in, out], x @ W), each cut to ENTRIES."""
    w = weight.detach().float().T  # nn.Linear stores [out, in]
    return {"shape": list(w.shape), "columns": {str(j): _plain(w[:ENTRIES, j]) for j in range(min(n, w.shape[1]))}}


@torch.no_grad()
def tour_part(model, walkthrough: bool = False) -> dict:
    """The walk's extra numbers for `model`: {"weights": {"W_Q": ..., "W_up": ...}, "kv_reference",
    and "multi_head" when `model` is the walkthrough's one-head model}. A block without a part (a mixture of
    experts has no single W_up) leaves its entry out."""
    block = model.blocks[0]
    weights = {}
    for name, module, n in (("W_Q", getattr(block.attn, "wq", None), min(COLUMNS, model.config.head_dim)),
                            ("W_up", getattr(block.ffn, "w_up", None), 1)):
        w = None if module is None else _weight(module)
        if w is not None:
            weights[name] = _columns(w, n)
    out = {"weights": weights, "kv_reference": {"name": "Llama 3 8B", **llama3_8b_kv_cache()}}
    if walkthrough:
        out["multi_head"] = _walkthrough_heads()
    return out


@functools.cache
def _walkthrough_heads() -> dict:
    """The walkthrough's four-head figures, recomputed once from its variant models."""
    return {"sentence": SENTENCE, **figures()["multi_head"]}
