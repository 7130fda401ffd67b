"""The chat templates the issue-45 families ship render in glassformer's sandbox as transformers renders
them: a Qwen3-style thinking template (namespace, a reversed loop, string methods, enable_thinking,
reasoning_content, tool calls) and a Gemma 3-style one (system folded into the first user turn,
content as a string or a list of parts, raise_exception). Both written here in the features the
families' own templates use; the reference is transformers' render_jinja_template."""

from __future__ import annotations

import pytest

from glassformer.text.chat_template import TemplateError, render

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string"
    " and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
QWEN3_CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nThey greet me.\n</think>\n\nHello!"},
     {"role": "user", "content": "And the weather in Paris — 東京?"},
     {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
      "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "20 C"},
     {"role": "assistant", "content": "<think>\nThe tool said so.\n</think>\n\nSunny, 20 C."}],
]
GEMMA3_CHATS = [
    [{"role": "user", "content": "  Good morrow.  "}],
    [{"role": "system", "content": "Speak as the fool."}, {"role": "user", "content": "Who goes there?"},
     {"role": "assistant", "content": "A friend."},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]}],
]


def _hf(template, messages, **kw):
    return render_jinja_template([messages], chat_template=template, **kw)[0][0]


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("chat", range(len(QWEN3_CHATS)))
def test_qwen3_thinking_template(chat, tools, thinking):
    messages = QWEN3_CHATS[chat]
    extra = {} if thinking is None else {"enable_thinking": thinking}
    got = render(QWEN3, messages, add_generation_prompt=True, tools=tools, **extra)
    assert got == _hf(QWEN3, messages, add_generation_prompt=True, tools=tools, **extra)
    assert got.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking is False else ""))
    if chat == 1:  # the reasoning of turns before the last question is dropped, the last turn's kept
        assert "They greet me" not in got and "<think>\nThe tool said so.\n</think>" in got


@pytest.mark.parametrize("chat", range(len(GEMMA3_CHATS)))
def test_gemma3_template(chat):
    messages = GEMMA3_CHATS[chat]
    special = {"bos_token": "<bos>", "eos_token": "<eos>"}
    got = render(GEMMA3, messages, add_generation_prompt=True, special=special)
    assert got == _hf(GEMMA3, messages, add_generation_prompt=True, **special)
    assert got.endswith("<start_of_turn>model\n")


def test_gemma3_template_refuses_by_its_own_message():
    with pytest.raises(TemplateError, match="^chat template: Conversation roles must alternate"):
        render(GEMMA3, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], special={"bos_token": "<bos>"})
