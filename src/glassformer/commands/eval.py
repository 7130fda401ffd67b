"""`glassformer eval`: held-out loss, perplexity and bits per byte of any text under a checkpoint;
with --tasks, lm-evaluation-harness tasks (glassformer.harness.tasks)."""

from __future__ import annotations

from .options import HARNESS_SEED_LIMIT, add_base_argument, add_device_argument, add_quantize_argument, seed_type

HELP = "held-out loss, perplexity and bits per byte of a text file or a prepared folder's validation split"
HARNESS_HELP = "with --tasks"


def add_task_arguments(p) -> None:
    """The flags of the --tasks branch (glassformer.harness.tasks)."""
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help=f"{HARNESS_HELP}: a folder of task YAML files (repeatable)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help=f"{HARNESS_HELP}: at most N documents a task")
    p.add_argument("--num-fewshot", type=int, default=None, metavar="K", help=f"{HARNESS_HELP}: K examples before each question")
    p.add_argument("--seed", type=seed_type(HARNESS_SEED_LIMIT), default=None, metavar="S",
                   help=f"{HARNESS_HELP}: every seed the harness uses (default: its own 0/1234)")
    p.add_argument("--output-path", default=None, metavar="DIR", help=f"{HARNESS_HELP}: write the harness's results to DIR/results.json")


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="checkpoint folder, training run folder (its latest checkpoint), Hugging Face folder or Hub name org/name[@revision]")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", metavar="PATH",
                      help="a UTF-8 text file, or a prepared data folder (its val.bin is scored; in a conversation "
                           "folder, the tokens its mask trains, with \"scored\" in the result)")
    what.add_argument("--tasks", metavar="TASK[,TASK...]",
                      help="lm-evaluation-harness tasks (names or YAML files) instead of --data: the harness's table, "
                           "then a JSON line with acc beside chance (docs/eval.md; pip install 'glassformer[harness]')")
    add_task_arguments(p)
    add_device_argument(p, "auto", auto=True)
    p.add_argument("--batch-size", type=int, default=8, help="windows scored per forward pass")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = the faster of one and all, measured)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json to encode a text file with (default: the checkpoint's)")
    add_quantize_argument(p, "score")
    add_base_argument(p)


def run(args) -> int:
    import json
    from pathlib import Path

    import torch

    from ..checkpoint.loading import load
    from ..train.cpu_memory import keep_freed_memory
    from ..errors import UserError
    from ..train.evaluate import score, summary
    from ..train.setup import resolve_device
    from .options import apply_quantize, quantize_method

    quantize_method(args)  # before the weights are read
    if args.tasks:
        check_harness(args)
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        from ..train.metrics import pick_threads

        pick_threads(torch.get_num_threads())
    model, tokenizer = load(args.checkpoint, device=device, base=args.base)
    model = apply_quantize(model.float().eval(), args)
    if args.tasks:
        return run_tasks(args, model, tokenizer)
    data, chat = Path(args.data), {}  # chat: how a conversation folder is scored
    if data.is_dir():
        ids, n_bytes, chat = folder_ids(data, model)
    elif data.is_file():
        ids, n_bytes = text_ids(args, data, tokenizer, model)
    else:
        raise UserError(f"--data {data} does not exist: give a text file or a prepared data folder")
    if len(ids) < 2:
        raise UserError(f"{data} holds {len(ids)} token(s): at least 2 are needed to score anything")
    with keep_freed_memory(device.type == "cpu"), torch.no_grad():  # each batch reuses the last one's memory
        nats, n = score(model, ids, model.config.max_seq_len, device, batch_size=args.batch_size,
                        mask=chat.get("mask"), block=chat.get("block"))
    result = summary(nats, n, n_bytes)
    if chat:
        result["scored"] = chat["scored"]
    print(f"{data}: {n:,} tokens scored in windows of {model.config.max_seq_len}, {n_bytes:,} bytes"
          + (f" ({chat['scored']} tokens of whole conversations)" if chat else ""))
    print(json.dumps(result))
    return 0


def conversation_scoring(data, meta: dict, n_tokens: int, model_context: int) -> dict:
    """For a conversation folder: its val mask, window block and what is scored ("assistant" or
    "all"); {} for plain data."""
    from ..errors import UserError
    from ..text.data import chat_block, load_mask

    block = chat_block(meta)
    if block is None:
        return {}
    if model_context < block - 1:
        raise UserError(f"{data} packs conversations into {block - 1} tokens but the model's context is "
                        f"{model_context}: prepare it with --context {model_context}")
    return {"mask": load_mask(data, "val", n_tokens).array, "block": block, "scored": meta["chat"]["train_on"]}


def folder_ids(data, model):
    """(val.bin's ids, its bytes, conversation scoring or {}) of a prepared folder."""
    import numpy as np

    from ..errors import UserError
    from ..text.data import check_ids, check_split_length, load_split, read_meta

    meta = read_meta(data)
    if meta["vocab_size"] != model.config.vocab_size:
        raise UserError(f"{data} was tokenized with {meta['vocab_size']} token ids but the model has "
                        f"{model.config.vocab_size}: use the data folder the model was trained on, or a text file")
    if "val_bytes" not in meta:
        raise UserError(f"{data / 'meta.json'} has no val_bytes, which bits per byte divide by: prepare the folder again")
    tokens = load_split(data, "val", meta)  # val.bin, or the val shards
    check_split_length(tokens, meta, "val")
    check_ids(tokens, meta["vocab_size"])  # before any window is scored
    ids = np.asarray(tokens.array[:len(tokens)])
    n_bytes = int(meta["val_bytes"])  # in a conversation folder, the scored tokens' bytes
    return ids, n_bytes, conversation_scoring(data, meta, len(ids), model.config.max_seq_len)


def text_ids(args, data, tokenizer, model):
    """(ids, UTF-8 bytes) of a text file under the checkpoint's tokenizer (or --tokenizer)."""
    import numpy as np

    from ..errors import UserError

    if args.tokenizer:
        from ..text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_file(args.tokenizer)
    if tokenizer is None:
        raise UserError(f"{args.checkpoint} has no tokenizer.json: pass --tokenizer PATH")
    try:
        text = data.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{data} is not UTF-8 text ({e})") from None
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if len(ids) and int(ids.max()) >= model.config.vocab_size:
        raise UserError(f"the tokenizer makes ids up to {int(ids.max())} but the model has only "
                        f"{model.config.vocab_size}: use the checkpoint's own tokenizer")
    return ids, len(text.encode("utf-8"))


def check_harness(args) -> None:
    """Before any weights are read: lm-eval installed, and a tokenizer to give it text."""
    import importlib.util

    from ..errors import UserError

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("--tasks needs the lm-evaluation-harness: pip install 'glassformer[harness]'")
    if args.tokenizer:
        raise UserError("--tokenizer goes with --data: --tasks uses the checkpoint's own tokenizer")


def run_tasks(args, model, tokenizer) -> int:
    from ..harness.tasks import run_tasks as run

    return run(args, model, tokenizer)
