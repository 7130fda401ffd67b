"""Chat templates against transformers' apply_chat_template, the sandbox, the limits, and the
configs a Hugging Face folder keeps beside tokenizer.json (docs/chat.md#templates)."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glassformer.errors import UserError
from glassformer.text.chat_template import (CHAT_TOKENS, CHATML_TEMPLATE, TemplateError, check_messages, render,
                                            render_spans, token_mask)
from glassformer.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# ----------------------------------------------------------------------------- three template styles

# Each reply's content and its end-of-turn token in a {% generation %} block: what a model is trained to write.
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# As Qwen2 and SmolLM2 write it: a default system prompt when the conversation has none.
CHATML_QWEN = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Mistral's [INST]: the system prompt joins the first user turn; roles must alternate.
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = none %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{% if loop.first and system is not none %}{{ '[INST] ' + system + '\n\n' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}{% endif %}"
    "{% endfor %}"
)
STYLES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML_QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
}
SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", *CHAT_TOKENS,
            "<s>", "</s>", "<unk>", "[INST]", "[/INST]")
TEXT = ("The king and queen walk to the castle. Ça va? Straße, naïve café — 東京, Москва, 🙂👍🏽!\n"
        "You are a helpful assistant. What say you, my lord? I say: to be, or not to be.\n") * 30


def without_blocks(template: str) -> str:
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def chat_tokenizer_json() -> str:
    """A tiny byte-level BPE with the special tokens of all three styles, as tokenizer.json text."""
    from tokenizers import AddedToken

    tok = Tokenizer.train([TEXT], vocab_size=400)
    tok.tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok.to_str()


def ours(tok_json: str, style: str) -> Tokenizer:
    template, special = STYLES[style]
    tok = Tokenizer.from_str(tok_json)
    tok.chat_template, tok.special_tokens = template, dict(special)
    return tok


def theirs(tok_json: str, style: str, template: str | None = None):
    from tokenizers import Tokenizer as HFTokenizer

    default, special = STYLES[style]
    return transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok_json),
                                                chat_template=template or default, **special)


@pytest.fixture(scope="module")
def tok_json() -> str:
    return chat_tokenizer_json()


@pytest.fixture(scope="module")
def pairs(tok_json):
    return {style: (ours(tok_json, style), theirs(tok_json, style)) for style in STYLES}


CONTENT = st.text(alphabet=st.sampled_from("abcdefgh ijk\n\t,.?!'\"{}<>|é東京🙂ßЖ"), max_size=24)


@st.composite
def conversations(draw):
    """Optional system prompt, then user/assistant turns alternating, ending on either."""
    messages = [{"role": "system", "content": draw(CONTENT)}] if draw(st.booleans()) else []
    for i in range(draw(st.integers(1, 6))):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(CONTENT)})
    return messages


# ----------------------------------------------------------------------------- the same ids and masks as transformers


@pytest.mark.parametrize("style", list(STYLES))
def test_ids_and_masks_equal_transformers(style, pairs):
    tok, hf = pairs[style]

    @settings(max_examples=25, deadline=None)
    @given(conversations(), st.booleans())
    def check(messages, prompt):
        ids, mask = tok.apply_chat_template(messages, add_generation_prompt=prompt, return_assistant_mask=True)
        ref = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"])
        assert mask == list(ref["assistant_masks"])
        assert tok.apply_chat_template(messages, add_generation_prompt=prompt) == ids
        assert tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == \
            hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        replies = [m for m in messages if m["role"] == "assistant"]
        assert (sum(mask) > 0) == bool(replies)  # every reply holds at least its end-of-turn token

    check()


@pytest.mark.parametrize("style", list(STYLES))
def test_prefix_masks_equal_the_block_masks(style, pairs):
    tok, _ = pairs[style]
    plain = without_blocks(tok.chat_template)

    @settings(max_examples=25, deadline=None)
    @given(conversations(), st.booleans())
    def check(messages, prompt):
        blocks = tok.apply_chat_template(messages, add_generation_prompt=prompt, return_assistant_mask=True)
        prefixes = tok.apply_chat_template(messages, add_generation_prompt=prompt, return_assistant_mask=True,
                                           template=plain)
        assert prefixes == blocks

    check()


def test_default_chatml_template_masks_each_reply_and_its_end(tok_json):
    tok = Tokenizer.from_str(tok_json)
    tok.chat_template = CHATML_TEMPLATE
    messages = [{"role": "user", "content": "to be"}, {"role": "assistant", "content": "or not"}]
    ids, mask = tok.apply_chat_template(messages, return_assistant_mask=True)
    assert tok.decode(i for i, m in zip(ids, mask) if m) == "or not<|im_end|>"
    assert tok.decode(ids).endswith("<|im_end|>\n") and mask[-1] == 0
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok_json).tk,
                                              chat_template=CHATML_TEMPLATE)
    ref = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert (ids, mask) == (list(ref["input_ids"]), list(ref["assistant_masks"]))


def test_globals_filters_and_extra_variables_render_as_transformers(pairs):
    template = (
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|{{ greeting }}|{{ eos_token }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}|{{ dict(a=1) | tojson }}"
    )
    messages = [{"role": "user", "content": "<b>&'\"é東京"}, {"role": "assistant", "content": "x"}]
    tok, hf = pairs["chatml"]
    got = tok.apply_chat_template(messages, template=template, tokenize=False, greeting="hi")
    assert got == hf.apply_chat_template(messages, chat_template=template, tokenize=False, greeting="hi")
    assert got.startswith(json.dumps(messages, ensure_ascii=False) + "|")  # no HTML escaping, Unicode kept
    assert "|hi|<|im_end|>|1|" in got
    assert render("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)


# Downloaded-style templates that lean on what the limits touch (loops, `+`, `~`, filters, macros,
# namespaces, tojson, string methods, slices, % and format): they must render exactly as transformers does.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\n\n# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools><|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
FEATURES = (
    "{%- set ns = namespace(system='', turns=0) -%}"
    "{%- macro turn(role, text) -%}<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ text | trim }}<|eot_id|>{%- endmacro -%}"
    "{%- for m in messages if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content ~ '\n' -%}{%- endfor -%}"
    "{{ bos_token }}{%- if ns.system -%}{{ turn('system', ns.system) }}{%- endif -%}"
    "{%- for m in messages | rejectattr('role', 'equalto', 'system') -%}{%- set ns.turns = ns.turns + 1 -%}"
    "{%- set words = m.content.split() -%}"
    "{{ turn(m.role, m.content) }}[{{ loop.index }}/{{ loop.length }} {{ words | length }} words{{ ', first ' ~ words[0][:3] if words }}]"
    "{%- endfor -%}"
    "{%- if tools -%}{% set listing %}{{ tools | tojson(indent=2) }}{% endset %}{{ listing | indent(2) }}"
    "{{ '%d tool(s): %s' % (tools | length, tools | map(attribute='name') | join(', ')) }}{%- endif -%}"
    "{{ '\n{} turns, {:>4}|{:.1f}'.format(ns.turns, 'ok', 2.25) }}{{ (messages | last).content | replace(' ', '_') | upper }}"
    "{%- if add_generation_prompt -%}{{ turn('assistant', '')[:-9] }}{%- endif -%}"
)
TOOLS = [{"name": "weather", "description": "The weather in a city, now.\nSays \"sunny\" or not.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "time", "description": "The time in a zone (東京).", "parameters": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("template", [GEMMA, QWEN_TOOLS, FEATURES], ids=["gemma", "qwen-tools", "features"])
def test_downloaded_style_templates_render_as_transformers(template, pairs):
    tok, hf = pairs["llama3"]
    conversations = [
        [{"role": "user", "content": "  Good morrow, my lord.  "}, {"role": "assistant", "content": "What news?\n\nNone."},
         {"role": "user", "content": "The king — 東京 🙂 'quoted' \"double\" \\ back"}],
        [{"role": "system", "content": "Speak as the fool."}, {"role": "user", "content": "Who goes there?"},
         {"role": "assistant", "content": "A friend."}, {"role": "tool", "content": "{\"temp\": 20}"},
         {"role": "tool", "content": "sunny"}, {"role": "user", "content": TEXT[:500]}],
    ]
    for messages in conversations:
        for tools in (None, TOOLS):
            try:
                expected = hf.apply_chat_template(messages, chat_template=template, tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 -- this template refuses this conversation: so must ours
                with pytest.raises(TemplateError, match=str(e).split("\n")[0][:40].replace("(", r"\(")):
                    tok.apply_chat_template(messages, template=template, tools=tools, tokenize=False,
                                            add_generation_prompt=True)
                continue
            assert tok.apply_chat_template(messages, template=template, tools=tools, tokenize=False,
                                           add_generation_prompt=True) == expected


# ----------------------------------------------------------------------------- errors: one line each


def test_raise_exception_gives_the_templates_message(pairs):
    tok, _ = pairs["mistral"]
    with pytest.raises(TemplateError, match=r"^chat template: Conversation roles must alternate user/assistant"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ messages.append(1) }}",  # the immutable sandbox: no mutating methods
])
def test_sandbox_refusals_are_one_line(template):
    with pytest.raises(TemplateError, match="refused by the sandbox") as e:
        render(template, [{"role": "user", "content": "hi"}])
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)


def test_limits_on_time_and_output():
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=r"ran past the 2 s limit"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", [])
    assert time.monotonic() - t0 < 6
    with pytest.raises(TemplateError, match=r"more than 1 MB"):
        render("{% for i in range(100000) %}{{ 'to be or not to be, that is the question' }}{% endfor %}", [])
    with pytest.raises(TemplateError, match=r"more than 1 MB"):
        render("{{ 'x' * 100000000 }}", [])
    with pytest.raises(TemplateError, match=r"syntax error at line 1"):
        render("{% for m in messages %}", [])
    assert render("{{ 'ab' * 3 }}", []) == "ababab"  # small products still work


def test_check_messages_names_the_message():
    check_messages([{"role": "user", "content": ""}])
    with pytest.raises(UserError, match=r"^data.jsonl:3: message 1 has role 'bot'"):
        check_messages([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], where="data.jsonl:3")
    with pytest.raises(UserError, match=r"message 0 \(user\) needs string content"):
        check_messages([{"role": "user", "content": 3}])


def test_token_mask_marks_tokens_overlapping_a_span():
    assert token_mask([(0, 2), (2, 4), (4, 6), (6, 8)], [(1, 3), (6, 6)]) == [1, 1, 0, 0]
    text, spans = render_spans("a{% generation %}bc{% endgeneration %}d{% generation %}e{% endgeneration %}", [])
    assert text == "abcde" and spans == [(1, 3), (4, 5)]


def test_no_template_names_the_flag(tok_json):
    with pytest.raises(UserError, match="--template"):
        Tokenizer.from_str(tok_json).apply_chat_template([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- tokenizer configs in folders


def write_hf_tokenizer(folder, tok_json: str, config: dict, generation: dict | None = None, jinja: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


def test_named_templates_default_and_template_name(tok_json, tmp_path):
    config = {"chat_template": [{"name": "default", "template": CHATML_QWEN}, {"name": "llama", "template": LLAMA3}],
              "bos_token": {"content": "<|begin_of_text|>", "special": True}, "eos_token": "<|im_end|>",
              "model_max_length": 4096}
    folder = write_hf_tokenizer(tmp_path / "hf", tok_json, config)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == CHATML_QWEN and set(tok.chat_templates) == {"default", "llama"}
    assert tok.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    assert Tokenizer.from_folder(folder, template_name="llama").chat_template == LLAMA3
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, template="llama") == \
        Tokenizer.from_folder(folder, template_name="llama").apply_chat_template(messages)
    with pytest.raises(UserError, match=r"no chat template named 'tools' \(this tokenizer has: default, llama\)"):
        Tokenizer.from_folder(folder, template_name="tools")
    # Saved and read back: every template, the special tokens and the rest of the config.
    tok.save_folder(tmp_path / "again")
    back = Tokenizer.from_folder(tmp_path / "again")
    assert back.chat_templates == tok.chat_templates and back.special_tokens == tok.special_tokens
    assert json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "again")
    for name in ("default", "llama"):  # transformers finds both templates, by name, in what we wrote
        ref = hf.apply_chat_template(messages, chat_template=name, add_generation_prompt=True, return_dict=True)
        assert list(ref["input_ids"]) == back.apply_chat_template(messages, template=name, add_generation_prompt=True)


def test_jinja_file_wins_and_eos_ids(tok_json, tmp_path):
    ids = Tokenizer.from_str(tok_json)
    eot, im_end, end = ids.tk.token_to_id("<|eot_id|>"), ids.tk.token_to_id("<|im_end|>"), ids.tk.token_to_id("<|endoftext|>")
    folder = write_hf_tokenizer(tmp_path / "a", tok_json, {"chat_template": "ignored", "eos_token": "<|eot_id|>"},
                                generation={"eos_token_id": [eot, im_end], "temperature": 0.6}, jinja=LLAMA3)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == LLAMA3 and tok.eos_ids == [eot, im_end]
    assert Tokenizer.from_folder(write_hf_tokenizer(tmp_path / "b", tok_json, {}, generation={"eos_token_id": eot})).eos_ids == [eot]
    assert Tokenizer.from_folder(write_hf_tokenizer(tmp_path / "c", tok_json, {"eos_token": "<|eot_id|>"})).eos_ids == [eot, end]
    with pytest.raises(UserError, match="eos_token_id must be an id or a list of ids"):
        Tokenizer.from_folder(write_hf_tokenizer(tmp_path / "d", tok_json, {}, generation={"eos_token_id": "x"}))
    with pytest.raises(UserError, match="chat_template must be a string or a list"):
        Tokenizer.from_folder(write_hf_tokenizer(tmp_path / "e", tok_json, {"chat_template": [{"name": 1}]}))


def test_add_chat_tokens_and_a_checkpoint_keeps_the_template(tmp_path):
    from glassformer.checkpoint.folders import save_model
    from glassformer.checkpoint.loading import load

    from ..support import tiny_model

    tok = Tokenizer.train([TEXT], vocab_size=300)
    before = tok.vocab_size
    assert tok.add_chat_tokens() == list(CHAT_TOKENS) and tok.add_chat_tokens() == []
    start, end = (tok.tk.token_to_id(t) for t in CHAT_TOKENS)
    assert (start, end) == (before, before + 1) and tok.vocab_size == before + 2 and {start, end} <= tok.special_ids
    assert tok.encode("<|im_start|>user") [0] == start and tok.eos_ids == [end, tok.eot_id]
    tok.chat_template = CHATML_TEMPLATE
    model = tiny_model(vocab_size=tok.vocab_size)
    save_model(tmp_path / "ckpt", model, tok)
    assert (tmp_path / "ckpt" / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    _, loaded = load(tmp_path / "ckpt")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "to be"}]
    assert loaded.chat_template == CHATML_TEMPLATE and loaded.eos_ids == tok.eos_ids
    assert loaded.apply_chat_template(messages, return_assistant_mask=True) == tok.apply_chat_template(messages, return_assistant_mask=True)
