"""LoRA fine-tuning (`train --init-from CKPT --lora-r R`): the --init-from model frozen, rank-R
adapters on its products trained, and the run's checkpoints holding the adapter alone, with the
base's path and sha256 (checkpoint/adapters.py; docs/lora.md#training)."""

from __future__ import annotations

from ..config import TrainConfig
from ..convert.lora import LoraConfig, apply_lora, base_sha256, count_adapter_weights, lora_modules, merge_lora
from ..errors import UserError

_DEFAULTS = TrainConfig()


def lora_config(cfg: TrainConfig) -> LoraConfig | None:
    """The run's LoraConfig from --lora-*, or None without --lora-r (then no other --lora-* flag may be set)."""
    if not cfg.lora_r:
        stray = [f"--{name.replace('_', '-')}" for name in ("lora_alpha", "lora_dropout", "lora_targets")
                 if getattr(cfg, name) != getattr(_DEFAULTS, name)]
        if stray:
            verb = "goes" if len(stray) == 1 else "go"
            raise UserError(f"{' and '.join(stray)} {verb} with --lora-r R: add --lora-r 8 (say) to train LoRA adapters")
        return None
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    return LoraConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, targets=targets)


def check_flags(cfg: TrainConfig) -> None:
    """The --lora-* flags checked before anything is written: a UserError saying what to change."""
    if lora_config(cfg) is not None and not cfg.init_from and not cfg.resume:
        raise UserError("--lora-r trains adapters on a trained model: give it with --init-from CKPT")


def prepare_model(cfg: TrainConfig, model, grown: dict | None):
    """The --init-from model as the run trains it: with fresh adapters (or the adapters it has, when
    it is an adapter run and --lora-* agrees with them) under --lora-r; merged into plain weights
    without it, so every weight trains. model.lora_base is the base the run's checkpoints name."""
    from ..checkpoint.adapters import base_record

    lcfg = lora_config(cfg)
    if lcfg is None:
        return merge_lora(model) if lora_modules(model) else model
    if not cfg.init_from:
        raise UserError("--lora-r trains adapters on a trained model: give it with --init-from CKPT")
    if grown:
        raise UserError(f"--init-from {cfg.init_from} has a smaller vocabulary than the data's tokenizer, and LoRA "
                        "keeps the base as it is: prepare the data with that checkpoint's tokenizer")
    if lora_modules(model):  # an adapter run: train its adapter further, on the same base
        if model.lora_config != lcfg:
            raise UserError(f"--init-from {cfg.init_from} is an adapter with {model.lora_config.to_dict()}, but "
                            f"--lora-* asks for {lcfg.to_dict()}: give the same settings, or leave out --lora-r "
                            "to train its merged weights")
        base = model.lora_base
        model.lora_base = base_record(base["path"], cfg.out, base["sha256"])
        return model
    sha = base_sha256(model)
    apply_lora(model, lcfg)
    model.lora_base = base_record(cfg.init_from, cfg.out, sha)
    return model


def resumed_adapter(cfg: TrainConfig, folder):
    """A LoRA run's checkpoint as it resumes: its base (or --base) with the adapter put on, in training mode."""
    import torch

    from ..checkpoint.adapters import base_record
    from ..checkpoint.loading import load

    model, _ = load(folder, base=cfg.base, dtype=torch.get_default_dtype())
    model.lora_base = base_record(model.lora_base["path"], cfg.out, model.lora_base["sha256"])
    return model.train()


def adapter_writer(model, state: dict, tokenizer):
    """What writes a LoRA run's checkpoint files (the adapter's tensors of the gathered `state`, its
    config and base), for checkpoint.training.save_training; None for a plain run."""
    if not lora_modules(model):
        return None
    from ..checkpoint.adapters import write_adapter_files

    return lambda folder: write_adapter_files(folder, model, model.lora_base, tokenizer, state=state)


def describe(model) -> str | None:
    """The line a LoRA run prints about what it trains, or None for a plain run."""
    if not lora_modules(model):
        return None
    c, n = model.lora_config, count_adapter_weights(model)
    total = sum(p.numel() for p in model.parameters())
    return (f"LoRA r={c.r}, alpha={c.alpha:g} on {','.join(c.targets)}: {n:,} trainable weights "
            f"({100 * n / total:.2f}% of {total:,}); the base stays frozen")
