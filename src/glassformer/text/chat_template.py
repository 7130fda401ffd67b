"""Chat templates: a conversation -> the text a model was trained on, rendered as transformers
renders it, in jinja2's immutable sandbox, under limits of time and output size.

Templates are untrusted input (they come with downloaded models). Assistant spans come from
`{% generation %}` blocks, or, for templates without them, from rendering growing prefixes of
the conversation: docs/chat.md#templates.
    >>> render(CHATML_TEMPLATE, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from contextlib import contextmanager
from functools import lru_cache

from ..errors import UserError

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant", "tool")
# The reply (content and its end-of-turn token) is what an assistant-only loss trains; the newline
# after <|im_end|> is never generated (a reply stops at <|im_end|>), so it stays outside the block.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TIME_LIMIT_S = 2.0
OUTPUT_LIMIT = 1 << 20  # characters of rendered text
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(UserError):
    """A chat template that raised, was refused by the sandbox, or ran past the limits (one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class _Raised(Exception):
    """raise_exception(message) called by a template: its message is the user's error."""


class _PastLimit(Exception):
    pass


def has_generation_blocks(template: str) -> bool:
    return bool(_GENERATION_TAG.search(template))


def check_messages(messages, where: str = "") -> None:
    """A list of {"role": one of ROLES, "content": str} dicts, or a UserError naming the message."""
    at = f"{where}: " if where else ""
    if not isinstance(messages, list):
        raise UserError(f"{at}messages must be a list of {{\"role\": ..., \"content\": ...}} objects, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{at}message {i} must be an object with \"role\" and \"content\", got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise UserError(f"{at}message {i} has role {m.get('role')!r}: use one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise UserError(f"{at}message {i} ({m['role']}) needs string content, got {type(m.get('content')).__name__}")


# ----------------------------------------------------------------------------- the sandbox


def _plain(value):
    """What a template may see: plain JSON types rebuilt, so no caller object's methods reach it."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # a subclass (an enum, say) back to its base type, without its methods
            return plain(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class _Limits:
    """The current render's deadline and output budget (per thread: renders may run concurrently)."""

    local = threading.local()

    @classmethod
    def check(cls, produced: int = 0) -> None:
        deadline = getattr(cls.local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise _PastLimit(f"chat template ran past the {TIME_LIMIT_S:g} s limit")
        if produced > OUTPUT_LIMIT:
            raise _PastLimit(f"chat template rendered more than {OUTPUT_LIMIT >> 20} MB")


def _generation_extension():
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: records where the block's text lands in the output."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracker = getattr(_Limits.local, "tracker", None)
            if tracker is not None:
                blocks, spans = tracker
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    return Generation


def _sandbox_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        # Checked on every attribute, item and call, so a loop that writes nothing still meets the deadline.
        def getattr(self, obj, attribute):
            _Limits.check()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _Limits.check()
            return super().getitem(obj, argument)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            _Limits.check()
            return super().call(__context, __obj, *args, **kwargs)

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            # 'x' * 10**9 would allocate before the output check could see it.
            if operator == "*" and isinstance(left, (str, list)) and isinstance(right, int) and len(left) * right > OUTPUT_LIMIT:
                raise _PastLimit(f"chat template built a string or list of more than {OUTPUT_LIMIT >> 20} MB")
            if operator == "**" and isinstance(right, int) and right > 64:
                raise _PastLimit("chat template raised a number to a power above 64")
            return super().call_binop(context, operator, left, right)

    return Sandbox


def _namespace_class():
    import jinja2

    class Namespace(jinja2.utils.Namespace):
        # {% set ns._x = ... %} would store what attribute access on it then reaches: refused, as transformers does.
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    return Namespace


@lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols

    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       range=_checked_range, dict=lambda *a, **k: dict(*a, **k), namespace=_namespace_class())
    return env


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers defines it: jinja's own tojson escapes HTML characters, which templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _checked_range(*args):
    from jinja2.sandbox import safe_range

    for i, v in enumerate(safe_range(*args)):
        if i % 1024 == 0:
            _Limits.check()
        yield v


@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


# ----------------------------------------------------------------------------- rendering


@contextmanager
def _cpu_alarm(seconds: float):
    """SIGPROF after `seconds` of CPU time (main thread only), for loops that touch nothing the
    sandbox sees; the previous handler and timer are put back (pytest-timeout and profilers use them)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise _PastLimit(f"chat template ran past the {TIME_LIMIT_S:g} s limit")

    old_handler = signal.signal(signal.SIGPROF, fire)
    old_timer = signal.setitimer(signal.ITIMER_PROF, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old_handler)
        if old_timer[0] > 0:
            signal.setitimer(signal.ITIMER_PROF, max(old_timer[0] - (time.monotonic() - t0), 1e-3), old_timer[1])


def render_spans(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                 special: dict | None = None, **template_kwargs) -> tuple[str, list[tuple[int, int]]]:
    """(text, [(start, end) of each {% generation %} block's text]) -- transformers' render, limited."""
    import jinja2

    compiled = _compile(template)
    context = _plain({**(special or {}), **template_kwargs})
    context.update(messages=_plain(messages), add_generation_prompt=bool(add_generation_prompt))
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    _Limits.local.deadline, _Limits.local.tracker = time.monotonic() + TIME_LIMIT_S, (blocks, spans)
    produced = 0
    try:
        with _cpu_alarm(TIME_LIMIT_S):
            for block in compiled.generate(**context):
                blocks.append(block)
                produced += len(block)
                _Limits.check(produced)
    except _Raised as e:
        raise TemplateError(f"chat template: {e}") from None
    except _PastLimit as e:
        raise TemplateError(str(e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"chat template refused by the sandbox: {e}") from None
    except RecursionError:
        raise TemplateError("chat template recursed too deeply") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _Limits.local.deadline = _Limits.local.tracker = None
    return "".join(blocks), spans


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
           special: dict | None = None, **template_kwargs) -> str:
    """The text `template` makes of `messages` (special: bos_token/eos_token/... as the template sees them)."""
    return render_spans(template, messages, add_generation_prompt=add_generation_prompt,
                        special=special, **template_kwargs)[0]


def prefix_spans(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                 special: dict | None = None, stop: tuple[str, ...] = (), **template_kwargs) -> tuple[str, list[tuple[int, int]]]:
    """Assistant spans for a template without {% generation %} blocks: message i's span is what
    rendering messages[:i+1] adds to messages[:i] with the generation prompt, cut after the last
    `stop` string in it (the end-of-turn token; what follows it is never generated)."""
    def text(msgs, prompt):
        return render(template, msgs, add_generation_prompt=prompt, special=special, **template_kwargs)

    full = text(messages, add_generation_prompt)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before, after = text(messages[:i], True), text(messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise TemplateError("this chat template renders earlier turns differently as the conversation grows, so its "
                                "assistant tokens cannot be found by prefixes: add {% generation %} blocks to it")
        start, end = len(before), len(after)
        cut = max((after.rfind(s, start, end) + len(s) for s in stop if s and after.rfind(s, start, end) >= 0), default=end)
        spans.append((start, cut))
    return full, spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 on each token whose characters overlap a span, as transformers marks assistant tokens.
    >>> token_mask([(0, 2), (2, 4), (4, 6)], [(3, 4)])
    [0, 1, 0]
    """
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask
