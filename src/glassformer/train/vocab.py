"""Growing a model's vocabulary for `train --init-from` when the data's tokenizer has more ids
(chat tokens added by `prepare --chat --tokenizer CKPT`): new rows of the embedding, and of an
untied head, are the mean of the old rows, so a new token starts as an average token rather
than as noise (docs/chat.md#fine-tuning-on-conversations)."""

from __future__ import annotations

import dataclasses

import torch

GROWN = ("embed.weight", "lm_head.weight")  # the matrices with one row per token id


def grow_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight (V, D) with rows - V more rows, each the mean of the old ones."""
    extra = weight.float().mean(dim=0, keepdim=True).to(weight.dtype).expand(rows - weight.shape[0], -1)
    return torch.cat([weight, extra], dim=0)


def grow_vocab(model, vocab_size: int):
    """(a copy of model with vocab_size token ids, a record of the growth for the run)."""
    from ..checkpoint.builder import model_from_state

    old = model.config.vocab_size
    state = {k: (grow_rows(v, vocab_size) if k in GROWN else v) for k, v in model.state_dict().items()}
    cfg = dataclasses.replace(model.config, vocab_size=vocab_size)
    grown = model_from_state(cfg, state, dtype=torch.float32, where="the grown model").train()
    record = {"from": old, "to": vocab_size, "new_rows": "mean of the old rows",
              "matrices": [k for k in GROWN if k in state]}
    return grown, record
