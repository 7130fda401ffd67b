"""`glassformer train`: train or fine-tune; one process, or many under torchrun."""

from __future__ import annotations

import argparse
import dataclasses

HELP = "train or fine-tune a model on a prepared data folder (torchrun for many processes)"


def add_arguments(p) -> None:
    from ..config import TrainConfig, field_docs
    from .options import device_type, seed_type

    docs = field_docs(TrainConfig)
    checked = {"device": device_type(auto=True), "seed": seed_type(),  # refused as the command line is read
               "checkpoint_format": _checkpoint_format}
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
        kind = checked.get(f.name) or {"int": int, "float": float}.get(str(f.type), str)
        shown = "" if default in ("", None) else f" (default: {default})"
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=f.name.split("_")[-1].upper(),
                       help=doc + shown)


def _checkpoint_format(text: str) -> str:
    """An argparse type for --checkpoint-format: one of config.CHECKPOINT_FORMATS."""
    from ..config import CHECKPOINT_FORMATS

    if text not in CHECKPOINT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint format: choose safetensors (one file, the "
                                         "default) or dcp (each process its shards, torch.distributed.checkpoint)")
    return text


def read_config_file(path: str) -> dict:
    """The training settings in a JSON or TOML file (its "train" table, if it has one), each checked
    to be of its field's kind (check_config_values)."""
    import json
    from pathlib import Path

    from ..errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path} " + ("is a folder: give a JSON or TOML file" if p.is_dir() else "does not exist"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--config {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}): "
                        "give a JSON or TOML file of training settings") from None
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
    d = d.get("train", d) if isinstance(d, dict) else d
    if not isinstance(d, dict):
        raise UserError(f"--config {path} must hold an object of training settings (e.g. {{\"max_steps\": 100}}), "
                        f"not a {type(d).__name__}")
    return check_config_values({k.replace("-", "_"): v for k, v in d.items()}, path)


def check_config_values(settings: dict, path: str) -> dict:
    """settings, if each known one is of its TrainConfig field's kind (and --seed and --device as their
    flags take them); unknown names are left to TrainConfig.from_dict, which lists the known ones."""
    import argparse

    from ..config import TrainConfig
    from ..errors import UserError
    from .options import device_type, seed_type

    kinds = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string",
             "str | None": "a string", "list[str]": "a list of strings"}
    checked = {"device": device_type(auto=True), "seed": seed_type()}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in settings:
            continue
        value, kind = settings[f.name], str(f.type)
        if not _of_kind(value, kind):
            raise UserError(f"--config {path}: {f.name} {value!r} must be {kinds.get(kind, kind)}")
        if f.name in checked:
            try:
                checked[f.name](str(value))
            except argparse.ArgumentTypeError as e:
                raise UserError(f"--config {path}: {f.name} {e}") from None
    return settings


def _of_kind(value, kind: str) -> bool:
    """Whether a value read from JSON or TOML fits a TrainConfig field's annotation."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON's true is no number
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "list[str]":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    return isinstance(value, str) or (value is None and "None" in kind)


def _saved_settings(file) -> dict:
    """The settings a run saved with its checkpoint (train_state.json's "config"), or one line naming the file."""
    from ..checkpoint.checks import DAMAGED, json_object
    from ..errors import UserError
    from ..files import read_json

    saved = json_object(read_json(file), file).get("config", {})
    if not isinstance(saved, dict):
        raise UserError(f'{file}: "config" must be an object of the run\'s settings: {DAMAGED}')
    return saved


def resolve_config(args) -> "TrainConfig":  # noqa: F821
    """defaults < the resumed run's saved settings < --config FILE < flags given."""
    from ..checkpoint.folders import newest_checkpoint
    from ..config import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    from_file = read_config_file(args.config) if getattr(args, "config", None) else {}
    settings = {**from_file, **given}
    if settings.get("resume"):
        ckpt = newest_checkpoint(settings.get("out", TrainConfig.out))
        if ckpt is not None:
            saved = _saved_settings(ckpt / "train_state.json")
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
