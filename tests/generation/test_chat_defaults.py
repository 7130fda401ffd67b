"""`glassformer chat` with its defaults on a model of short context: the reply leaves the message room."""

import io
import sys

from glassformer.cli import main
from glassformer.commands.chat import REPLY_TOKENS, reply_tokens

from .test_chat import setup  # noqa: F401  (a fixture: the tiny preset, 128 tokens of context)


def test_the_default_reply_is_at_most_half_the_context():
    assert reply_tokens(128) == 64 and reply_tokens(4096) == REPLY_TOKENS and reply_tokens(1) == 1
    assert reply_tokens(128, 100) == 100  # --max-new-tokens given: as given


def test_chat_with_its_defaults_answers_on_a_128_token_model(monkeypatch, capsys, setup):  # noqa: F811
    import glassformer.commands.generate as gen

    assert setup[0].config.max_seq_len == 128  # the context the defaults used to fill on their own
    monkeypatch.setattr(gen, "_load_model", lambda args: setup)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Now is\n"))
    assert main(["chat", "--checkpoint", "unused", "--greedy"]) == 0
    got = capsys.readouterr()
    assert "exceed the context" not in got.err and got.out.endswith("\n\n")
