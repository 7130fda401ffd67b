"""`glassformer cost`: weights, FLOPs, memory, KV cache and training time of a model."""

from __future__ import annotations

HELP = "what a model costs: weights, FLOPs, memory, KV cache and training time, from its config"


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a named preset (see ModelConfig presets), e.g. llama3-8b")
    src.add_argument("--config", metavar="FILE", help="a JSON file of ModelConfig fields (or a checkpoint's config.json)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint, run or Hugging Face folder, or a Hub name org/name[@revision] (only its config is read)")
    p.add_argument("--batch", type=int, default=1, help="B: rows per batch")
    p.add_argument("--seq", type=int, default=None, help="T: tokens per row (default: the model's context)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="number format (default: bf16 on a GPU, fp32 on the cpu)")
    p.add_argument("--hardware", choices=["h100", "h200", "a100", "cpu"], default="h100",
                   help="peak FLOP/s, memory and bandwidth to price against ('cpu' measures this machine)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation: the fraction of peak reached")
    p.add_argument("--tokens", type=float, default=None, help="training tokens (default: 20 per weight, Chinchilla)")
    p.add_argument("--steps", type=int, default=None, help="training steps of B×T tokens (instead of --tokens)")
    p.add_argument("--memory", default=None, help="memory size for the largest batch, e.g. 80GB or 24GiB (default: the hardware's)")
    p.add_argument("--attention", choices=["naive", "sdpa", "tiled"], default=None,
                   help="kernel the activation estimate assumes (default: the config's)")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "none"], default="adamw", help="optimizer state to hold")
    p.add_argument("--no-master-weights", action="store_true",
                   help="bf16/fp16: train in the dtype alone (no fp32 master copy; moments in the dtype)")
    p.add_argument("--lora-r", type=int, default=None, metavar="R",
                   help="also price LoRA fine-tuning at rank R: trainable weights, optimizer state, memory (docs/cost.md#lora)")
    p.add_argument("--lora-targets", default=None, metavar="LIST",
                   help="with --lora-r: the adapted products, comma-separated (default: wq,wk,wv,wo,w_gate,w_up,w_down)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="activations as `train --activation-checkpointing` holds them: each block's input, one block recomputed at a time")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw FLOPs and memory against T to this PNG")


def load_config(args):
    """The ModelConfig that --preset, --config or --checkpoint names."""
    from pathlib import Path

    from ..config import ModelConfig
    from ..errors import UserError
    from ..files import read_json

    if args.preset:
        return ModelConfig.from_preset(args.preset)
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist: give a JSON file of ModelConfig fields")
        return _config_from_json(read_json(path, ": give a JSON file of ModelConfig fields"), path)
    from ..checkpoint.folders import read_config, resolve

    folder = resolve(args.checkpoint, weights=False)  # a run's latest checkpoint; a Hub name's config alone
    data = read_config(folder)
    if "peft_type" in data:  # a PEFT adapter folder: the model is its base's (cost --lora-r prices the adapter)
        from ..convert.peft import read_peft

        folder = resolve(read_peft(folder).base, weights=False)
        data = read_config(folder)
    return _config_from_json(data, folder / "config.json")  # a bad field is said with the file that holds it


def _config_from_json(data: dict, where):
    """The ModelConfig in a glassformer config.json, a Hugging Face one, or a dict of ModelConfig fields."""
    from ..checkpoint.checks import model_config
    from ..config import ModelConfig
    from ..convert.keymap import config_from_hf
    from ..errors import UserError

    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a JSON object of ModelConfig fields")
    if data.get("format") == "glassformer":
        return model_config(data, where)  # as load() reads it: the file and the field named
    try:
        if "model_type" in data:  # a Hugging Face config.json; an unsupported model_type is refused by name
            return config_from_hf(data)
        return ModelConfig.from_dict(data)
    except (ValueError, TypeError) as e:  # ModelConfig's own checks, said with the file they read
        raise UserError(f"{where}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def run(args) -> int:
    import json

    from ..cost import estimate, format_table
    from ..errors import UserError

    cfg = load_config(args)
    if args.batch < 1:
        raise UserError(f"--batch must be at least 1, got {args.batch}")
    if args.seq is not None and not 1 <= args.seq <= cfg.max_seq_len:
        raise UserError(f"--seq must be in 1..{cfg.max_seq_len} (the model's context), got {args.seq}")
    if (args.tokens is not None and args.tokens < 1) or (args.steps is not None and args.steps < 1):
        raise UserError("--tokens and --steps must be at least 1")
    if args.lora_targets is not None and args.lora_r is None:
        raise UserError("--lora-targets goes with --lora-r R")
    targets = None if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    report = estimate(
        cfg, batch=args.batch, seq=args.seq, dtype=args.dtype, hardware=args.hardware, mfu=args.mfu,
        tokens=None if args.tokens is None else int(args.tokens), steps=args.steps, memory=args.memory,
        attention=args.attention, optimizer=args.optimizer,
        master_weights=False if args.no_master_weights else None, lora_r=args.lora_r, lora_targets=targets,
        activation_checkpointing=args.activation_checkpointing,
    )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'glassformer[plot]'") from None
        from ..cost.plot import plot_costs

        plot_costs(cfg, args.plot, batch=args.batch, dtype=report["inputs"]["dtype"],
                   memory=report["inputs"]["memory_bytes"], optimizer=args.optimizer)
    if args.json:
        print(json.dumps(report))
    else:
        name = args.preset or args.config or args.checkpoint
        print(f"{name}: {cfg.n_layers} layers, D={cfg.dim}, N={cfg.n_heads}, K={cfg.n_kv_heads}, H={cfg.head_dim}, "
              f"F={cfg.ffn_dim} ({cfg.ffn}), V={cfg.vocab_size}")
        print(format_table(report))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0
