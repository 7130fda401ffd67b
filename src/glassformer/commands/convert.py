"""`glassformer convert`: Hugging Face folders and GGUF files in and out, and MHA -> GQA/MQA."""

from __future__ import annotations

HELP = ("convert checkpoints: from/to Hugging Face folders and GGUF files (llama.cpp, Ollama), "
        "pool key/value heads (GQA/MQA), or store int8 weights")


def add_arguments(p) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-hf", metavar="SRC",
                      help="Hugging Face folder or Hub name org/name[@revision] (llama, mistral, qwen2, gpt2) "
                           "to convert into a glassformer checkpoint")
    mode.add_argument("--to-hf", metavar="SRC",
                      help="glassformer checkpoint or run folder to write as a Hugging Face folder")
    mode.add_argument("--kv-heads", type=int, metavar="K",
                      help="pool the key/value heads of --checkpoint into K heads (K=1: MQA)")
    mode.add_argument("--to-gguf", metavar="SRC",
                      help="checkpoint or run folder to write as one GGUF file for llama.cpp and Ollama "
                           "(--out FILE.gguf, with FILE.Modelfile beside it; --dtype f32/f16/bf16/q8_0)")
    mode.add_argument("--from-gguf", metavar="FILE",
                      help="GGUF file (f32, f16, bf16 or q8_0, as --to-gguf writes them) to convert into a glassformer checkpoint")
    mode.add_argument("--merge-lora", metavar="RUN",
                      help="LoRA adapter run or checkpoint to fold into its base: a plain checkpoint, W + (alpha/r)·B·A "
                           "(docs/lora.md)")
    mode.add_argument("--quantize", metavar="TYPE",
                      help="store the weights of --checkpoint as TYPE (int8: per output channel; docs/quantize.md)")
    mode.add_argument("--control-vector", metavar="VEC[:SCALE]",
                      help="steering vector (from `glassformer steer`) to write, times SCALE, as llama.cpp's "
                           "control-vector GGUF (--out F.gguf; llama-cli --control-vector F.gguf): docs/research.md#steering-vectors")
    p.add_argument("--family", metavar="MODEL_TYPE",
                   help="with --to-hf: write this Hugging Face family (e.g. phi3, whose fused projections hold what "
                        "llama's hold) instead of the first that holds the model; refused by name if it cannot "
                        "(docs/convert.md#families)")
    p.add_argument("--peft", action="store_true",
                   help="with --to-hf on a LoRA adapter run: write DIR/base/ and the adapter in PEFT's layout (docs/lora.md#peft)")
    p.add_argument("--base", metavar="CKPT",
                   help="with --merge-lora or --to-hf on an adapter run: its base checkpoint, when it has moved")
    p.add_argument("--checkpoint", metavar="SRC", help="the checkpoint that --kv-heads or --quantize converts")
    p.add_argument("--out", required=True, metavar="DST", help="folder to write (must not exist yet)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "f32", "f16", "q8_0"],
                   default=None, help="cast the weights to this dtype (q8_0: --to-gguf only); unset keeps the dtype the source stores")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pickled pytorch_model.bin files (with torch.load(weights_only=True)); "
                        "with a Hub name, fetch them too")


def _check_out(out, *sources) -> None:
    from pathlib import Path

    from ..errors import UserError

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists; choose a new folder or remove it first")
    for src in sources:
        if src is not None and Path(src).resolve() == out.resolve():
            raise UserError("--out must differ from the source folder")


def _tokenizer_file(folder):
    from pathlib import Path

    path = Path(folder) / "tokenizer.json"
    return path if path.is_file() else None


def _stored_dtype(folder):
    """The dtype a glassformer checkpoint stores its weights in (load() hands them back as float32)."""
    from pathlib import Path

    import torch

    from ..checkpoint.checks import open_safetensors

    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return None
    names = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    with open_safetensors(path) as f:  # a damaged file: one line naming it, before load() is reached
        kinds = {f.get_slice(k).get_dtype() for k in f.keys()}
    return names.get(kinds.pop()) if len(kinds) == 1 else None


def _float_model(folder, dtype=None, base=None):
    """load(folder), refusing int8 weights: HF export and head pooling need the float weights."""
    from ..checkpoint.loading import load
    from ..errors import UserError

    model, tok = load(folder, dtype=dtype, base=base)
    if model.config.quantization is not None:
        raise UserError(f"{folder} stores quantized weights ({model.config.quantization['method']}); "
                        "convert its float checkpoint instead")
    return model, tok


def _quantize(args, src, dtype) -> int:
    """--quantize TYPE --checkpoint SRC: the same checkpoint with its projections stored quantized."""
    from ..checkpoint.folders import resolve, save_model
    from ..checkpoint.loading import load
    from ..convert.quantize import check_method, quantize
    from ..errors import UserError

    check_method(args.quantize)  # before anything is read or written
    if dtype is not None:
        raise UserError("--dtype does not go with --quantize: the scales and the embedding stay float32")
    _check_out(args.out, src)
    folder = resolve(src)
    model, _ = load(folder)  # float32: the scales are taken from full-precision weights
    model = quantize(model, args.quantize)
    save_model(args.out, model, _tokenizer_file(folder))
    print(f"wrote {args.out}: glassformer checkpoint with {args.quantize} weights "
          f"({model.config.quantization['method']}, {model.config.quantization['granularity']})")
    return 0


def _merge_lora(args, dtype) -> int:
    """--merge-lora RUN --out CKPT [--base CKPT]: the adapter folded into its base, a plain checkpoint
    (convert.lora.merge_lora; an int8 base is refused before anything is written)."""
    import torch

    from ..checkpoint.folders import save_model
    from ..checkpoint.loading import load
    from ..convert.lora import lora_modules, merge_lora
    from ..errors import UserError

    if args.checkpoint is not None or args.peft:
        raise UserError("--merge-lora RUN takes no --checkpoint or --peft")
    _check_out(args.out, args.merge_lora)
    model, tok = load(args.merge_lora, base=args.base)  # fp32; an int8 base stays int8, and merge_lora refuses it
    if not lora_modules(model):
        raise UserError(f"{args.merge_lora} has no LoRA adapter to merge: give a run trained with --lora-r")
    model = merge_lora(model).to(dtype or torch.float32)
    save_model(args.out, model, tok)
    print(f"wrote {args.out}: glassformer checkpoint, the LoRA adapter merged ({model.num_params():,} weights)")
    return 0


def _gguf(args) -> int:
    """--to-gguf SRC --out FILE.gguf (+ FILE.Modelfile), or --from-gguf FILE --out CKPT (docs/convert.md#gguf)."""
    from ..errors import UserError

    if args.checkpoint is not None or args.peft or args.allow_pickle or getattr(args, "base", None) is not None:
        raise UserError("--to-gguf and --from-gguf take no --checkpoint, --base, --peft or --allow-pickle")
    if args.from_gguf is not None:
        from ..convert.gguf_read import gguf_to_checkpoint

        if args.dtype is not None:
            raise UserError("--from-gguf keeps the file's dtype (q8_0 becomes float32): drop --dtype")
        _check_out(args.out, args.from_gguf)
        model, out = gguf_to_checkpoint(args.from_gguf, args.out)
        print(f"wrote {out}: glassformer checkpoint, {model.num_params():,} weights, "
              f"{str(next(model.parameters()).dtype).replace('torch.', '')}")
        return 0
    from ..convert.modelfile import export_with_modelfile

    return export_with_modelfile(args.to_gguf, args.out, args.dtype)


def _control_vector(args) -> int:
    """--control-vector VEC[:SCALE] --out F.gguf: the vector as llama.cpp's control-vector file."""
    from ..convert.control_vector import direction_index, model_hint, write_control_vector
    from ..errors import UserError
    from ..research.steering import load_vector

    extra = [flag for flag, on in (("--checkpoint", args.checkpoint), ("--base", args.base), ("--peft", args.peft),
                                   ("--dtype", args.dtype), ("--allow-pickle", args.allow_pickle)) if on]
    if extra:
        raise UserError(f"--control-vector takes no {', '.join(extra)}: the file holds one float32 vector")
    if not str(args.out).endswith(".gguf"):
        raise UserError(f"--control-vector writes one GGUF file: give --out a name ending in .gguf, got {args.out}")
    vec = load_vector(args.control_vector)
    out = write_control_vector(vec, args.out)
    print(f"wrote {out}: llama.cpp control vector direction.{direction_index(vec.layer, vec.n_layers)} (the stream "
          f"entering block {vec.layer}), width {vec.dim}, scale {vec.scale:g}, for a {model_hint(vec)} model; "
          f"run it with llama-cli --control-vector {out}")
    return 0


def _to_hf(args, src, dtype):
    """--to-hf: the model and what was written (a family's folder, or its base and a PEFT adapter)."""
    from ..checkpoint.folders import resolve
    from ..convert.families import family_for
    from ..convert.hf import save_hf
    from ..convert.peft import save_peft
    from ..errors import UserError

    folder = resolve(src)
    model, tok = _float_model(folder, dtype=dtype or _stored_dtype(folder), base=args.base)
    family = family_for(model.config, args.family)  # refuses, by name, what no family (or the one named) can hold
    if not args.peft and getattr(model, "lora_config", None) is not None:
        raise UserError(f"{src} is a LoRA adapter run: add --peft to write its base and the adapter in PEFT's "
                        "layout, or merge it first (convert --merge-lora RUN --out CKPT)")
    eot = getattr(tok, "eot_id", None)
    if args.peft:  # save_peft refuses a model without an adapter
        save_peft(model, args.out, _tokenizer_file(folder), dtype=dtype, eot_id=eot)
    else:
        save_hf(model, args.out, _tokenizer_file(folder), dtype=dtype, eot_id=eot, family=family.name)
    return model, f"Hugging Face {family.name} folder" + (" and its LoRA adapter in PEFT's layout" if args.peft else "")


def run(args) -> int:
    import torch

    from ..checkpoint.folders import resolve, save_model
    from ..checkpoint.hub import find
    from ..convert.heads import convert_kv_heads
    from ..convert.hf import load_hf, parse_dtype
    from ..errors import UserError

    if args.control_vector is not None:
        return _control_vector(args)
    if args.to_gguf is not None or args.from_gguf is not None:
        return _gguf(args)
    if args.base is not None and args.merge_lora is None and args.to_hf is None:
        raise UserError("--base goes with --merge-lora RUN or --to-hf RUN (an adapter run whose base has moved)")
    if args.dtype == "q8_0":
        raise UserError("--dtype q8_0 is a GGUF type: use it with --to-gguf (or --quantize int8 for a checkpoint)")
    dtype = parse_dtype({"f32": "float32", "f16": "float16"}.get(args.dtype, args.dtype))
    if args.merge_lora is not None:
        return _merge_lora(args, dtype)
    on_checkpoint = args.kv_heads is not None or args.quantize is not None
    if not on_checkpoint and args.checkpoint is not None:
        raise UserError("--checkpoint goes with --kv-heads or --quantize; use --from-hf SRC or --to-hf SRC on their own")
    src = args.from_hf or args.to_hf or args.checkpoint
    if on_checkpoint and src is None:
        raise UserError(f"{'--kv-heads K' if args.kv_heads is not None else '--quantize TYPE'} needs --checkpoint SRC")
    if args.family is not None and args.to_hf is None:
        raise UserError("--family goes with --to-hf SRC")
    if args.peft and args.to_hf is None:
        raise UserError("--peft goes with --to-hf RUN (a LoRA adapter run)")
    if args.quantize is not None:
        return _quantize(args, src, dtype)
    _check_out(args.out, src)

    if args.from_hf is not None:
        src = find(src, allow_pickle=args.allow_pickle)  # a Hub name: its snapshot in the Hugging Face cache
        model, _ = load_hf(src, dtype=dtype, allow_pickle=args.allow_pickle)
        # tokenizer.json travels as a file: the exact bytes the model was trained with.
        save_model(args.out, model, _tokenizer_file(src))
        what = "glassformer checkpoint"
    elif args.to_hf is not None:
        model, what = _to_hf(args, src, dtype)
    else:
        folder = resolve(src)
        model, _ = _float_model(folder)  # float32: the means are taken at full precision
        model = convert_kv_heads(model, args.kv_heads)
        model = model.to(dtype or _stored_dtype(folder) or torch.float32)
        save_model(args.out, model, _tokenizer_file(folder))
        what = f"glassformer checkpoint with {args.kv_heads} key/value heads"
    p = next(model.parameters())
    print(f"wrote {args.out}: {what}, {model.num_params():,} weights, {str(dtype or p.dtype).replace('torch.', '')}")
    return 0
