"""Chat: a conversation in one session (prefix reuse, prefilled tokens), `chat` against `generate`,
eos lists, `glassformer chat`'s piped mode, /reset and /system, the drop policy, the no-template error."""

import io
import json
import sys

import pytest
import torch

import glassformer
from glassformer import ModelConfig, Transformer, generate
from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.generation.chat import ChatSession
from glassformer.generation.session import Session
from glassformer.text.tokenizer import EOT, Tokenizer

from ..support import greedy_by_full_forward, reinit

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York. "
        "Good morrow, my lord. What news? Fare thee well, and speak no more. ") * 20
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer() -> Tokenizer:
    tok = Tokenizer.train([TEXT], vocab_size=300, special_tokens=(EOT, *CHAT_TOKENS))
    tok.chat_template = CHATML
    tok.eos_ids = [tok.tk.token_to_id("<|im_end|>")]
    return tok


@pytest.fixture(scope="module")
def setup():
    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = reinit(Transformer(ModelConfig.from_preset("tiny", vocab_size=tok.vocab_size)), std=0.1).eval()
    return model, tok


class Script:
    """Makes the model say given tokens: each head call (one next-token choice) favours the next id."""

    def __init__(self, model):
        self.queue: list[int] = []
        self.handle = model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if not self.queue:
            return out
        bump = torch.zeros(out.shape[-1], dtype=out.dtype)
        bump[self.queue.pop(0)] = 1e4
        return out + bump

    def say(self, ids):
        self.queue = list(ids)


@pytest.fixture
def script(setup):
    s = Script(setup[0])
    yield s
    s.handle.remove()


def _im_end(tok):
    return tok.tk.token_to_id("<|im_end|>")


@pytest.mark.parametrize("run_ahead", [False, True], ids=["steps", "run-ahead"])
def test_turn_two_prefills_only_the_new_user_turn(setup, script, run_ahead):
    model, tok = setup
    convo = ChatSession(model, tok, greedy=True, max_new_tokens=20)
    convo.session.run_ahead = run_ahead  # a GPU session's path: a step queued past the eos is dropped
    reply1 = tok.encode("Good morrow, my lord.")
    script.say(reply1 + [_im_end(tok)])
    assert "".join(convo.say("Now is the winter")) == "Good morrow, my lord."
    ids1 = tok.apply_chat_template([{"role": "user", "content": "Now is the winter"}], add_generation_prompt=True)
    assert convo.session.prefilled_tokens == len(ids1)
    cached = len(ids1) + len(reply1)  # the prompt and every reply token but the eos, which nothing fed yet
    assert convo.session.cached == [cached]

    script.say(tok.encode("Fare thee well.") + [_im_end(tok)])
    assert "".join(convo.say("What news?")) == "Fare thee well."
    ids2 = convo.render(convo.messages[:3])
    new = [_im_end(tok)] + tok.encode("\n<|im_start|>user\nWhat news?<|im_end|>\n<|im_start|>assistant\n")
    assert ids2[:cached] == ids1 + reply1 and ids2[cached:] == new  # the reply's end, the user's turn, the prompt
    assert convo.session.prefilled_tokens - len(ids1) == len(new)
    assert [m["role"] for m in convo.messages] == ["user", "assistant", "user", "assistant"]


def test_replace_keeps_the_prefix_and_gives_what_a_fresh_prompt_gives(setup):
    model, tok = setup
    a, b = tok.encode("Now is the winter of our discontent"), tok.encode("Now is the summer of York")
    s = Session(model, 1)
    list(s.send(a, max_new_tokens=5, greedy=True))
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert s.replace(b) == common
    before = s.prefilled_tokens
    got = list(s.send(None, max_new_tokens=6, greedy=True))
    assert got == greedy_by_full_forward(model, b, 6)
    assert s.prefilled_tokens - before == len(b) - common


def test_greedy_chat_equals_greedy_generate_up_to_the_first_eos(setup):
    model, tok = setup
    messages = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "What news?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    made = list(generate(model, ids, max_new_tokens=24, greedy=True))
    eos = set(tok.eos_ids)
    upto = next((i for i, t in enumerate(made) if t in eos), len(made))
    assert glassformer.chat(model, tok, messages, max_new_tokens=24, greedy=True) == tok.decode(made[:upto])
    assert "".join(glassformer.chat_stream(model, tok, messages, max_new_tokens=24, greedy=True)) == \
        tok.decode(made[:upto])


@pytest.mark.parametrize("which", [0, 1])
def test_any_id_of_generation_configs_eos_list_ends_the_reply(setup, script, which, tmp_path):
    model, tok = setup
    tok.save_folder(tmp_path)
    eos = [_im_end(tok), tok.eot_id]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    folder_tok = Tokenizer.from_folder(tmp_path)
    folder_tok.chat_template = CHATML
    assert folder_tok.eos_ids == eos
    script.say(tok.encode("Good morrow") + [eos[which]] + tok.encode(" my lord"))
    convo = ChatSession(model, folder_tok, greedy=True, max_new_tokens=20)
    assert "".join(convo.say("Now is")) == "Good morrow"
    assert convo.session.texts[0][-1] == eos[which]


def _cli(monkeypatch, capsys, setup, stdin: str, *flags):
    import glassformer.commands.generate as gen

    monkeypatch.setattr(gen, "_load_model", lambda args: setup)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["chat", "--checkpoint", "unused", "--greedy", "--max-new-tokens", "12", *flags])
    return code, capsys.readouterr()


def test_piped_stdin_writes_each_reply_and_an_empty_line_only(monkeypatch, capsys, setup):
    model, tok = setup
    code, got = _cli(monkeypatch, capsys, setup, "Now is\nWhat news?\n/reset\nWhat news?\n/system Be brief.\n"
                                                 "Good morrow\n/exit\nnever answered\n")
    assert code == 0
    say = lambda messages: glassformer.chat(model, tok, messages, max_new_tokens=12, greedy=True)  # noqa: E731
    u1, u2 = {"role": "user", "content": "Now is"}, {"role": "user", "content": "What news?"}
    r1 = say([u1])
    r2 = say([u1, {"role": "assistant", "content": r1}, u2])
    r3 = say([u2])  # after /reset: a fresh conversation
    r4 = say([{"role": "system", "content": "Be brief."}, u2, {"role": "assistant", "content": r3},
              {"role": "user", "content": "Good morrow"}])
    assert got.out == "".join(r + "\n\n" for r in (r1, r2, r3, r4))
    assert len({r1, r2, r3, r4}) > 1  # the replies depend on the conversation (else the test shows nothing)


def test_the_drop_policy_drops_the_oldest_turns_with_a_notice_and_prefills_again(setup, script):
    model, tok = setup
    notes = []
    convo = ChatSession(model, tok, system="Speak as a king.", max_len=80, max_new_tokens=8, greedy=True,
                        notify=notes.append)
    lines = ["Now is the winter", "What news?", "Good morrow, my lord.", "Fare thee well"]
    for i, line in enumerate(lines):
        script.say(tok.encode(f"reply {i}") + [_im_end(tok)])
        text, before = list(convo.session.texts[0]), convo.session.prefilled_tokens
        list(convo.say(line))
        if notes:
            break
    assert notes and notes[0].startswith("context full: dropped the 2 oldest message(s)")
    assert convo.messages[0] == {"role": "system", "content": "Speak as a king."}
    assert convo.messages[1] == {"role": "user", "content": lines[1]}
    ids = convo.render(convo.messages[:-1])
    assert len(ids) + 8 <= 80
    system = tok.apply_chat_template(convo.messages[:1])
    assert ids[:len(system)] == system  # the system prompt stays cached; the turns after it are prefilled again
    keep = next(i for i, (x, y) in enumerate(zip(text, ids)) if x != y)
    assert convo.session.prefilled_tokens - before == len(ids) - keep
    assert keep == len(system) + len(tok.encode("<|im_start|>user\n"))  # the dropped turn's opening only


def test_the_error_policy_refuses_and_keeps_the_conversation(setup, script):
    model, tok = setup
    convo = ChatSession(model, tok, max_len=40, max_new_tokens=8, greedy=True, context_policy="error")
    script.say(tok.encode("reply") + [_im_end(tok)])
    list(convo.say("Now is the winter"))
    kept = list(convo.messages)
    with pytest.raises(UserError, match="exceed the context of 40 tokens"):
        convo.say("Now is the winter of our discontent made glorious summer by this sun of York")
    assert convo.messages == kept


def test_chat_without_a_template_names_the_template_flag(monkeypatch, capsys, setup):
    model, _ = setup
    bare = Tokenizer.train([TEXT], vocab_size=300, special_tokens=(EOT, *CHAT_TOKENS))
    code, got = _cli(monkeypatch, capsys, (model, bare), "Now is\n")
    assert code == 2 and got.out == ""
    assert got.err.startswith("error: ") and "--template" in got.err and "Traceback" not in got.err


def test_a_template_file_serves_a_checkpoint_without_one(monkeypatch, capsys, setup, tmp_path):
    model, tok = setup
    bare = Tokenizer.train([TEXT], vocab_size=300, special_tokens=(EOT, *CHAT_TOKENS))
    bare.eos_ids = tok.eos_ids
    (tmp_path / "t.jinja").write_text(CHATML)
    code, got = _cli(monkeypatch, capsys, (model, bare), "Now is\n", "--template", str(tmp_path / "t.jinja"))
    assert code == 0
    assert got.out == glassformer.chat(model, tok, [{"role": "user", "content": "Now is"}], max_new_tokens=12,
                                       greedy=True) + "\n\n"


def test_ctrl_c_ends_the_reply_being_written_not_the_chat(setup, script, capsys):
    from glassformer.commands.chat import _reply

    model, tok = setup
    convo = ChatSession(model, tok, greedy=True, max_new_tokens=20)

    class Interrupted(io.StringIO):
        def write(self, s):
            super().write(s)
            if s.strip() and len(self.getvalue()) >= 4:
                raise KeyboardInterrupt  # as Ctrl-C would, mid-reply

    script.say(tok.encode("Good morrow, my lord.") + [_im_end(tok)])
    out = Interrupted()
    _reply(convo, "Now is", out)
    partial = convo.messages[-1]
    assert partial["role"] == "assistant" and out.getvalue() == partial["content"] + "\n"
    assert 4 <= len(partial["content"]) < len("Good morrow, my lord.")
    assert "Good morrow, my lord.".startswith(partial["content"]) and "[interrupted]" in capsys.readouterr().err
    script.say(tok.encode("Fare thee well.") + [_im_end(tok)])
    assert "".join(convo.say("What news?")) == "Fare thee well."  # the chat goes on


def test_template_name_picks_a_named_template_and_an_unknown_name_lists_them(monkeypatch, capsys, setup):
    model, tok = setup
    named = chat_tokenizer()
    named.chat_template = "{{ raise_exception('the default template is not for chat') }}"
    named.chat_templates = {"default": named.chat_template, "chatml": CHATML}
    code, got = _cli(monkeypatch, capsys, (model, named), "Now is\n", "--template-name", "chatml")
    assert code == 0
    assert got.out == glassformer.chat(model, tok, [{"role": "user", "content": "Now is"}], max_new_tokens=12,
                                       greedy=True) + "\n\n"
    code, got = _cli(monkeypatch, capsys, (model, named), "Now is\n", "--template-name", "tools")
    assert code == 2 and got.out == "" and "it has: chatml, default" in got.err
