"""`glassformer chat`: talk with a checkpoint; each reply streams, the conversation stays cached.

Typed commands: /reset, /system TEXT, /exit. With standard input not a terminal, each line is one
user message (or one of those commands), and standard output holds the replies only, each followed
by an empty line. docs/chat.md#chatting.
"""

from __future__ import annotations

import sys

from .generate import add_sampling_arguments
from .options import add_base_argument, add_device_argument, add_quantize_argument
from .steer import add_steer_argument

HELP = "talk with a checkpoint: each reply streams, the conversation stays in one KV cache"
COMMANDS = "/reset forgets the conversation, /system TEXT sets the system prompt, /exit ends"
REPLY_TOKENS = 128  # a reply's tokens at most, unless the model's context is shorter than twice that


def reply_tokens(max_len: int, asked: int | None = None) -> int:
    """--max-new-tokens, or by default REPLY_TOKENS capped at half the context: a reply as long as the
    whole context leaves no room for the message it answers.

    >>> reply_tokens(128), reply_tokens(2048), reply_tokens(2048, 500)
    (64, 128, 500)
    """
    return asked if asked is not None else max(1, min(REPLY_TOKENS, max_len // 2))


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint folder, training run folder, Hugging Face folder or Hub name org/name[@revision]")
    p.add_argument("--system", default=None, help="the system prompt")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--template", default=None, metavar="FILE",
                       help="a Jinja chat template file (default: the checkpoint's)")
    which.add_argument("--template-name", default=None, metavar="NAME",
                       help="which of the checkpoint's named templates to use (default: 'default')")
    add_sampling_arguments(p, max_new_tokens=None)
    for action in p._actions:  # the reply's room depends on the model's context, read later
        if action.dest == "max_new_tokens":
            action.help = (f"tokens per reply at most (default: {REPLY_TOKENS}, or half the model's context "
                           "when that is less, leaving the other half for the conversation)")
    p.add_argument("--context-policy", choices=["drop", "error"], default="drop",
                   help="when the next turn would not fit: drop the oldest turns (with a notice), or stop with an error")
    p.add_argument("--attention", choices=["naive", "tiled", "sdpa"], default=None,
                   help="attention kernel (default: the checkpoint's)")
    add_device_argument(p)
    add_quantize_argument(p, "chat")
    add_base_argument(p)
    add_steer_argument(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: as stored)")


def _template_file(args) -> str | None:
    """--template FILE's text (None without the flag): read before the model is, so a bad file fails at once."""
    from ..errors import UserError

    if args.template is None:
        return None
    try:
        return open(args.template, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read --template {args.template}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--template {args.template} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                        f"{e.start}): it must be a Jinja chat template, a UTF-8 text file") from None


def _template(args, tok, given: str | None) -> str | None:
    """given (--template FILE's text), or --template-name's template of the checkpoint, or the checkpoint's own."""
    from ..errors import UserError

    if given is not None:
        return given
    if args.template_name is not None:
        named = getattr(tok, "chat_templates", None) or {}
        if args.template_name not in named:
            have = ", ".join(sorted(named)) or "none"
            raise UserError(f"--template-name {args.template_name}: the checkpoint has no such template (it has: {have})")
        return named[args.template_name]
    return None


def _reply(conversation, text: str, out) -> None:
    """Stream the reply to `text`; Ctrl-C ends the reply, not the program."""
    pieces = conversation.say(text)
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        pieces.close()  # the reply so far joins the conversation
        print(" [interrupted]", file=sys.stderr, flush=True)
    out.write("\n")
    out.flush()


def _command(conversation, line: str) -> str | None:
    """Run a /command; returns 'exit', 'done' (it was a command) or None (a user message)."""
    if line == "/exit":
        return "exit"
    if line == "/reset":
        conversation.reset()
        return "done"
    if line.startswith("/system "):
        conversation.set_system(line[len("/system "):])
        return "done"
    return None


def _piped(conversation, lines, out) -> int:
    """Each line one user message (or command); stdout holds each reply and an empty line."""
    for line in lines:
        line = line.rstrip("\r\n")
        what = _command(conversation, line)
        if what == "exit":
            break
        if what is None:
            _reply(conversation, line, out)
            out.write("\n")
            out.flush()
    return 0


def _interactive(conversation, out) -> int:
    from ..errors import UserError

    print(f"chat: {COMMANDS}; Ctrl-C ends a reply, Ctrl-D ends the chat", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        what = _command(conversation, line.strip())
        if what == "exit":
            return 0
        if what == "done":
            print(f"({line.strip().split()[0][1:]} done)", file=sys.stderr)
            continue
        try:
            _reply(conversation, line, out)
        except UserError as e:  # the turn is refused (context policy, template): the chat goes on
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)


def run(args) -> int:
    from ..generation.chat import CHAT_CACHE, ChatSession
    from .generate import _check_args, _load_model

    args.num_samples = 1
    asked, args.max_new_tokens = args.max_new_tokens, (REPLY_TOKENS if args.max_new_tokens is None else args.max_new_tokens)
    _check_args(args)
    given = _template_file(args)
    model, tok = _load_model(args)
    args.max_new_tokens = reply_tokens(min(model.config.max_seq_len, CHAT_CACHE), asked)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty, greedy=args.greedy, seed=args.seed)
    conversation = ChatSession(model, tok, system=args.system, template=_template(args, tok, given),
                               max_new_tokens=args.max_new_tokens, context_policy=args.context_policy,
                               notify=lambda line: print(line, file=sys.stderr, flush=True), **sampling)
    if sys.stdin.isatty():
        return _interactive(conversation, sys.stdout)
    return _piped(conversation, sys.stdin, sys.stdout)
