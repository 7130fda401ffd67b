"""Chat: a conversation kept in one generation session, and `chat` / `chat_stream`.

Each turn renders the whole conversation with the tokenizer's chat template, keeps the cached
keys of its longest common prefix with what the session holds and prefills only the rest; a reply
ends at any of `tokenizer.eos_ids`. What happens when a turn no longer fits, and why the prefix is
found by comparing ids rather than remembered per message: docs/chat.md#chatting.
"""

from __future__ import annotations

from typing import Callable, Iterator

from ..errors import UserError
from .session import Session, cache_length
from .streaming import TextStream

__all__ = ["ChatSession", "chat", "chat_stream", "CONTEXT_POLICIES"]

CONTEXT_POLICIES = ("drop", "error")
CHAT_CACHE = 8192  # the longest cache a chat allocates by default: a 128k-context model's whole cache is gigabytes
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "greedy", "seed")


def _template_or_error(tokenizer, template: str | None) -> str:
    """The template to render with: the one given, else the tokenizer's; none at all is an error."""
    found = template if template is not None else getattr(tokenizer, "chat_template", None)
    if not found:
        raise UserError("this tokenizer has no chat template: give one with --template FILE "
                        "(a Jinja chat template, as tokenizer_config.json holds it)")
    return found


def _render(tokenizer, template: str, messages: list[dict]) -> list[int]:
    """The conversation's ids, ending with the generation prompt (the assistant's turn opened)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, template=template)


def _eos_ids(tokenizer) -> list[int]:
    ids = list(getattr(tokenizer, "eos_ids", None) or [])
    eot = getattr(tokenizer, "eot_id", None)
    return ids or ([] if eot is None else [eot])


class ChatSession:
    """A conversation (`messages`) and the session that caches it. `say(text)` adds a user turn and
    streams the reply (which joins `messages` when it ends, also when the caller stops early);
    policy 'drop' drops the oldest non-system turns when a turn would not fit, 'error' refuses."""

    def __init__(self, model, tokenizer, *, system: str | None = None, template: str | None = None,
                 max_new_tokens: int = 128, context_policy: str = "drop", max_len: int | None = None,
                 notify: Callable[[str], None] | None = None, **sampling):
        if context_policy not in CONTEXT_POLICIES:
            raise UserError(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        unknown = sorted(set(sampling) - set(SAMPLING))
        if unknown:
            raise TypeError(f"unknown sampling argument {unknown[0]!r}; expected one of {', '.join(SAMPLING)}")
        self.template = _template_or_error(tokenizer, template)
        self.model, self.tok, self.policy, self.sampling = model, tokenizer, context_policy, sampling
        self.max_new_tokens, self.notify = int(max_new_tokens), notify or (lambda line: None)
        S = model.config.max_seq_len
        self.session = Session(model, 1, max_len=min(S, CHAT_CACHE) if max_len is None else max_len)
        self.eos = _eos_ids(tokenizer)
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    # ---- the conversation ----------------------------------------------------------------
    def reset(self) -> None:
        """Forget every turn but the system prompt (the cache keeps what still matches it)."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (the turns stay; the next turn re-prefills from the change)."""
        self.system = text
        rest = [m for m in self.messages if m["role"] != "system"]
        self.messages = ([] if text is None else [{"role": "system", "content": text}]) + rest

    def render(self, messages: list[dict]) -> list[int]:
        return _render(self.tok, self.template, messages)

    def _fit(self, messages: list[dict]) -> list[int]:
        """The prompt's ids, after dropping the oldest non-system turns while prompt and reply
        would outgrow the cache (policy 'drop'), or an error (policy 'error')."""
        ids, dropped, room = self.render(messages), 0, self.session.max_len - self.max_new_tokens
        while len(ids) > room:
            turns = [i for i, m in enumerate(messages) if m["role"] != "system"]
            if self.policy == "error" or len(turns) <= 1:
                hint = "use --context-policy drop, /reset, or fewer new tokens" if self.policy == "error" else \
                    "shorten the message or ask for fewer new tokens"
                raise UserError(f"the conversation ({len(ids)} tokens) + {self.max_new_tokens} new tokens exceed the "
                                f"context of {self.session.max_len} tokens: {hint}")
            gone = turns[:2] if messages[turns[1]]["role"] == "assistant" else turns[:1]  # a user turn and its reply
            messages[:] = [m for i, m in enumerate(messages) if i not in gone]
            dropped += len(gone)
            ids = self.render(messages)
        if dropped:
            self.notify(f"context full: dropped the {dropped} oldest message(s) and prefilled the rest again")
        return ids

    def say(self, text: str) -> Iterator[str]:
        """Add the user's message and stream the reply's text."""
        return self.respond([*self.messages, {"role": "user", "content": text}])

    def respond(self, messages: list[dict]) -> Iterator[str]:
        """Stream the assistant's reply to `messages` (the whole conversation so far); checks run now."""
        messages = [dict(m) for m in messages]
        ids = self._fit(messages)  # may drop turns from `messages`, or refuse (then nothing changed)
        self.messages = messages
        self.session.replace(ids)
        steps = self.session.send(None, max_new_tokens=self.max_new_tokens, stop=self.eos or None, **self.sampling)
        self.sampling.pop("seed", None)  # seeded once: later turns go on drawing from the same generator
        return self._stream(steps)

    def _stream(self, steps) -> Iterator[str]:
        text, reply, eos = TextStream(self.tok), [], set(self.eos)
        try:
            for t in steps:
                if t in eos:
                    break
                reply.append(t)
                piece = text.push(t)
                if piece:
                    yield piece
            tail = text.flush()
            if tail:
                yield tail
        finally:  # the reply joins the conversation however it ended (eos, the limit, Ctrl-C, a close)
            self.messages.append({"role": "assistant", "content": self.tok.decode(reply)})


def chat_stream(model, tokenizer, messages: list[dict], *, max_new_tokens: int = 128, template: str | None = None,
                **sampling) -> Iterator[str]:
    """The assistant's reply to `messages` ({"role", "content"} dicts), streamed as text pieces.
    Sampling arguments as `generate`'s; the reply ends at any of tokenizer.eos_ids."""
    ids = _render(tokenizer, _template_or_error(tokenizer, template), list(messages))
    conversation = ChatSession(model, tokenizer, template=template, max_new_tokens=max_new_tokens,
                               context_policy="error", max_len=cache_length(model, [ids], max_new_tokens), **sampling)
    return conversation.respond(list(messages))


def chat(model, tokenizer, messages: list[dict], **kwargs) -> str:
    """The assistant's whole reply to `messages` as one string (see chat_stream)."""
    return "".join(chat_stream(model, tokenizer, messages, **kwargs))
