"""`glassformer <verb>`: one module per verb under glassformer/commands/.

Each verb module defines HELP (one line), add_arguments(parser) and run(args) -> int, and
imports anything heavy inside run(), so `glassformer --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from . import __version__
from .errors import UserError

# The order `glassformer --help` lists them in.
VERBS = ["prepare", "tokenize", "train", "eval", "generate", "chat", "serve", "convert", "trace", "explain", "worked", "view", "cost",
         "demo", "steer", "probe", "patch", "attribute", "sae"]


def _verb_modules():
    for verb in VERBS:
        name = f"glassformer.commands.{verb.replace('-', '_')}"
        if importlib.util.find_spec(name) is not None:
            yield verb, importlib.import_module(name)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help only where it tells something: not when the
    help already names the default, nor for an unset (None), off (False) or empty default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], "") or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's own error form: one `error: ...` line on stderr and exit status 2 (the
    usage is one `--help` away), as every other bad input gets. Its verbs' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="glassformer",
        description="A decoder-only transformer you can train, run, price and see inside.",
    )
    parser.add_argument("--version", action="version", version=f"glassformer {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>")
    for verb, mod in _verb_modules():
        p = sub.add_parser(verb, help=mod.HELP, description=mod.HELP,
                           formatter_class=_Help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback on errors")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


class _ArgumentParserError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:
        if getattr(args, "debug", False):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def console() -> None:
    sys.exit(main())
