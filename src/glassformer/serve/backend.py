"""What the OpenAI-compatible routes serve (`Backend`: the engine, the tokenizer, the model's name
and limits) and how a request's prompt becomes token ids: a text, ids, or messages through the
model's chat template, checked against the vocabulary and the context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import UserError
from ..generation.batching import Engine
from ..text.chat_template import check_messages
from .schemas import MAX_CHARS, MAX_PROMPTS, TokenizeRequest, error_body as schema_error_body, message_dicts
from .schemas import ApiError, bad

ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}  # every other status: invalid_request_error
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

log = logging.getLogger(__name__)


def openai_error(status: int, message: str) -> dict:
    """The app's error body (serve.http's error_body): OpenAI's error object for a status."""
    return schema_error_body(message, ERROR_TYPES.get(status, "invalid_request_error"))


class TurnTakingEngine(Engine):
    """An Engine whose every step holds `turns`, a lock another user of the same model holds while
    it runs it (the explorer: a trace sets the model's mode and attention kernel for its forward, so
    no step may run meanwhile)."""

    def __init__(self, model, turns, **sizes):
        super().__init__(model, **sizes)
        self.turns = turns

    def step(self) -> bool:
        with self.turns:
            return super().step()


@dataclass
class Backend:
    """What the routes serve: the engine, the tokenizer, the model's name and limits.
    status is 'loading' until `ready()`, then 'ok', 'stopping' once the server stops, and 'down' if
    the engine's process exited unasked. With a `supervisor` (serve.supervisor) watching the engine,
    it is 'restarting' while a dead engine is replaced, and 'down' only once that gives up;
    `health()` also says when an 'ok' engine is stalled."""

    model_id: str
    engine: object = None
    tokenizer: object = None
    max_model_len: int = 0
    vocab_size: int = 0
    template: str | None = None  # the chat template (None: the tokenizer's own)
    eos: tuple[int, ...] = ()
    status: str = "loading"
    created: int = field(default_factory=lambda: int(time.time()))
    supervisor: object = None  # serve.supervisor.Supervisor, once one watches the engine

    def ready(self, engine, model, tokenizer, template: str | None = None) -> "Backend":
        """Serve `model` through `engine` (started) from now on."""
        self.engine, self.tokenizer, self.template = engine, tokenizer, template
        self.max_model_len, self.vocab_size = int(model.config.max_seq_len), int(model.config.vocab_size)
        eos = list(getattr(tokenizer, "eos_ids", None) or [])
        eot = getattr(tokenizer, "eot_id", None)
        self.eos = tuple(eos or ([] if eot is None else [eot]))
        self.serve_with(engine)
        self.status = "ok"
        return self

    def serve_with(self, engine) -> "Backend":
        """Send requests to `engine` (started and loaded) from now on: at `ready()`, and in place of a dead
        one (a supervisor's restart; not once the server is stopping)."""
        self.engine = engine
        if hasattr(engine, "on_exit"):  # an engine in its own process (serve.worker): told when it exits unasked
            engine.on_exit = self._engine_gone
        if self.status == "restarting":
            self.status = "ok"
        return self

    def _engine_gone(self, reason: str) -> None:
        """Unsupervised, a dead engine takes the server down (503 from now on); a supervisor sees it itself."""
        if self.supervisor is None and self.status == "ok":
            log.error("%s: the server answers 503 from now on", reason)
            self.status = "down"

    def health(self) -> tuple[int, dict]:
        """GET /health's status code and body: 200 {"status": "ok"}, else 503 with the status, or 503
        {"status": "stalled", ...} with the supervisor's figures while the engine is stalled."""
        if self.status != "ok":
            return 503, {"status": self.status}
        stall = None if self.supervisor is None else self.supervisor.stall()
        if stall is not None:
            return 503, {"status": "stalled", **stall}
        return 200, {"status": "ok"}

    def check_engine(self) -> None:
        """503 (retry shortly) for work that would wait behind a stalled engine, rather than queue it."""
        stall = None if self.supervisor is None else self.supervisor.stall()
        if stall is not None:
            raise ApiError(503, f"the engine has finished no step for {stall['stalled_s']:g} s with "
                           f"{stall['requests']} requests in hand (stalled); retry shortly", type="server_error")

    def check(self, model: str | None) -> None:
        """503 unless serving; 404 for a model this server does not serve."""
        if self.status != "ok":
            raise ApiError(503, f"the server is {self.status}; retry shortly", type="server_error")
        if model is not None and model != self.model_id:
            raise ApiError(404, f"the model {model!r} does not exist: this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


# ----------------------------------------------------------------------------- prompts to ids


def check_ids(backend: Backend, ids: list[int], param: str) -> None:
    V = backend.vocab_size
    wrong = next((t for t in ids if not 0 <= t < V), None)
    if wrong is not None:
        raise bad(f"{param}: token id {wrong} is outside the vocabulary 0..{V - 1}", param)


def encode(backend: Backend, text: str, param: str) -> list[int]:
    if len(text) > MAX_CHARS:
        raise bad(f"{param}: at most {MAX_CHARS} characters, got {len(text)}", param)
    return backend.tokenizer.encode(text)


def chat_ids(backend: Backend, messages, add_generation_prompt: bool = True) -> list[int]:
    """The conversation rendered with the model's chat template, as ids."""
    msgs = message_dicts(messages)
    tok = backend.tokenizer
    if backend.template is None and not getattr(tok, "chat_template", None):
        raise bad("this model has no chat template: use /v1/completions with a prompt", "messages")
    try:
        check_messages(msgs, "messages")
        return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, template=backend.template)
    except UserError as e:
        raise bad(str(e), "messages") from None


def tokenize(backend: Backend, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise bad("give either prompt (a text) or messages (a conversation)", "prompt")
    if req.messages is not None:
        return chat_ids(backend, req.messages, req.add_generation_prompt)
    ids = encode(backend, req.prompt, "prompt")
    bos = (getattr(backend.tokenizer, "special_tokens", None) or {}).get("bos_token")
    bos_id = backend.tokenizer.tk.token_to_id(bos) if bos and req.add_special_tokens else None
    return ([bos_id] if bos_id is not None else []) + ids


def completion_prompts(backend: Backend, prompt) -> list[list[int]]:
    """The prompts of a completions request as id lists: a text, texts, ids, or lists of ids."""
    if isinstance(prompt, str):
        rows = [encode(backend, prompt, "prompt")]
    elif prompt and all(isinstance(p, str) for p in prompt):
        rows = [encode(backend, p, "prompt") for p in prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        rows = [list(prompt)]
    else:
        rows = [list(p) for p in prompt]
    if not rows or len(rows) > MAX_PROMPTS:
        raise bad(f"prompt: give 1 to {MAX_PROMPTS} prompts", "prompt")
    for ids in rows:
        if not ids:
            raise bad("prompt: a prompt is empty (it encodes to no tokens): give some text", "prompt")
        check_ids(backend, ids, "prompt")
    return rows


def check_context(backend: Backend, ids: list[int], max_tokens: int) -> None:
    S = backend.max_model_len
    if len(ids) + max_tokens > S:
        raise bad(f"this model's maximum context length is {S} tokens, but the prompt has {len(ids)} and max_tokens "
                  f"asks for {max_tokens} more: shorten the prompt or lower max_tokens",
                  "max_tokens", "context_length_exceeded")


