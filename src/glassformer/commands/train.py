"""`glassformer train`: train or fine-tune; one process, or many under torchrun."""

from __future__ import annotations

import argparse
import dataclasses

HELP = "train or fine-tune a model on a prepared data folder (torchrun for many processes)"


def add_arguments(p) -> None:
    from ..config import TrainConfig, field_docs

    docs = field_docs(TrainConfig)
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="JSON or TOML file of training settings (flags given here override it)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = docs.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        default = f.default
        # Defaults are SUPPRESSed so run() can tell flags given from flags left alone (for
        # --config and --resume), and so shown in the help text by hand.
        if f.type in ("bool", bool):
            if default:
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"{doc} (default: on)")
            else:
                p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=doc)
            continue
        if str(f.type).startswith("list"):  # repeatable: each use adds one
            p.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar=f.name.upper(), help=doc)
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        shown = "" if default in ("", None) else f" (default: {default})"
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=f.name.split("_")[-1].upper(),
                       help=doc + shown)


def read_config_file(path: str) -> dict:
    import json
    from pathlib import Path

    from ..errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path} does not exist")
    text = p.read_text()
    if p.suffix == ".toml":
        import tomllib

        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"--config {path} is not valid TOML ({e})") from None
    else:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--config {path} is not valid JSON ({e}); use a .json or .toml file") from None
    return {k.replace("-", "_"): v for k, v in d.get("train", d).items()}


def resolve_config(args) -> "TrainConfig":  # noqa: F821
    """defaults < the resumed run's saved settings < --config FILE < flags given."""
    import json

    from ..checkpoint.folders import newest_checkpoint
    from ..config import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    from_file = read_config_file(args.config) if getattr(args, "config", None) else {}
    settings = {**from_file, **given}
    if settings.get("resume"):
        ckpt = newest_checkpoint(settings.get("out", TrainConfig.out))
        if ckpt is not None:
            saved = json.loads((ckpt / "train_state.json").read_text()).get("config", {})
            settings = {**{k: v for k, v in saved.items() if k in names}, **settings}
            return TrainConfig.from_saved(settings)
    return TrainConfig.from_dict(settings)


def run(args) -> int:
    from ..errors import UserError
    from ..train.loop import train

    if getattr(args, "lora_r", 1) < 1:  # 0, the default, means no LoRA; given, it must be a rank
        raise UserError(f"--lora-r {args.lora_r}: a LoRA rank is at least 1 (leave --lora-r out to train every weight)")
    cfg = resolve_config(args)
    if not cfg.data:
        raise UserError("--data is required: a folder made by `glassformer prepare --out DIR`")
    result = train(cfg)
    return {None: 0, "SIGINT": 130, "SIGTERM": 143}.get(result["stopped"], 1)
