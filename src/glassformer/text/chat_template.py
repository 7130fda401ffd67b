"""Chat templates: a conversation -> the text a model was trained on, rendered as transformers
renders it, in jinja2's immutable sandbox, under limits of time and size that hold in any thread
(template_limits: what is bounded, and why there rather than in a signal timer or a process).

Templates are untrusted input (they come with downloaded models). Assistant spans come from
`{% generation %}` blocks, or, for templates without them, from rendering growing prefixes of
the conversation: docs/chat.md#templates.
    >>> render(CHATML_TEMPLATE, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..errors import UserError
from .template_limits import OUTPUT_LIMIT, TIME_LIMIT_S, PastLimit, bound, current, limits  # noqa: F401 (the limits' one source)

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
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(UserError):
    """A chat template that raised, was refused by the sandbox, or ran past the limits (one line)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class _Raised(Exception):
    """raise_exception(message) called by a template: its message is the user's error."""


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
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict:  # the common containers first: a conversation is mostly these
        return {_plain(k): _plain(v) for k, v in value.items()}
    if kind is list:
        return [_plain(v) for v in value]
    for base, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # a subclass (an enum, say) back to its base type, without its methods
            return plain(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


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
            render = current()
            if render is not None and render.tracker is not None:
                blocks, spans = render.tracker
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    return Generation


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

    from .template_limits import sandbox_class

    env = sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=lambda *a, **k: dict(*a, **k), namespace=_namespace_class())
    return env


def _raise_exception(message):
    raise _Raised(message)


def _strftime_now(fmt):
    from datetime import datetime

    bound(len(fmt) * 256 if isinstance(fmt, str) else 0, "strftime_now")  # C's strftime stops at 256 x the format
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None
    except (RecursionError, MemoryError):
        raise TemplateError("chat template nests too deeply to compile") from None


# ----------------------------------------------------------------------------- rendering


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
    produced = 0
    try:
        with limits((blocks, spans)) as render:
            for block in compiled.generate(**context):
                blocks.append(block)
                produced += len(block)
                if produced > OUTPUT_LIMIT:
                    raise PastLimit(f"chat template rendered more than {OUTPUT_LIMIT >> 20} MB")
                render.check_time()
    except _Raised as e:
        raise TemplateError(f"chat template: {e}") from None
    except PastLimit as e:
        raise TemplateError(str(e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateError(f"chat template refused by the sandbox: {e}") from None
    except RecursionError:
        raise TemplateError("chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateError("chat template ran out of memory") from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError, AssertionError) as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
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
