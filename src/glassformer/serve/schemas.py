"""Request bodies of the OpenAI-compatible API, checked strictly, and OpenAI's error objects.

Every body is parsed here with pydantic in strict mode (no "1" for 1, no true for 1, no unknown
field), so a client's mistake becomes a 400 naming the field, never a silent default. Fields the
server accepts only at their default (n, frequency_penalty, ...) are checked by `check_defaults`.
Untrusted input is bounded: messages, characters, stop strings (docs/serve.md#limits).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

MAX_MESSAGES = 512
MAX_CHARS = 1 << 20  # characters of one request's prompt or messages together
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64  # prompts of one completions request
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes

Number = float  # strict mode: an int or a float, never a string or a bool


class ApiError(Exception):
    """An error the client gets as OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object.

    >>> error_body("n must be 1", param="n")
    {'error': {'message': 'n must be 1', 'type': 'invalid_request_error', 'param': 'n', 'code': None}}
    """
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: the request is wrong in a way its sender can fix."""
    return ApiError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """What completions and chat share: the model, the length, the sampling rules, the stream."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=0)
    temperature: Number = Field(1.0, ge=0, le=2)
    top_p: Number = Field(1.0, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # the project's extensions (vLLM's names); top_k -1 or 0 is vLLM's "off"
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number = Field(0.0, ge=0, le=1)
    repetition_penalty: Number = Field(1.0, gt=0)
    # this request's multiple of the server's --steer vectors (0: unsteered; glassformer's own extension)
    steer: Number | None = Field(None, ge=-1e4, le=1e4)
    # accepted at their defaults only (check_defaults)
    n: StrictInt | None = 1
    frequency_penalty: Number | None = 0
    presence_penalty: Number | None = 0
    logit_bias: dict[StrictStr, Number] | None = None
    user: StrictStr | None = None  # a caller's label; never logged


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS_COMPLETIONS)
    best_of: StrictInt | None = 1
    suffix: StrictStr | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS_CHAT)


class TokenizeRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    add_special_tokens: StrictBool = False
    messages: list[Message] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ----------------------------------------------------------------------------- parsing


def parse(kind: type[BaseModel], body: bytes) -> BaseModel:
    """The body as a `kind`, or a 400 naming the first field that is wrong."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def validation_error(errors: list[dict]) -> ApiError:
    """pydantic's (or FastAPI's) error list as one 400: the first problem named, with its field.

    >>> validation_error([{"loc": ("body", "temperature"), "msg": "Input should be a valid number"}]).message
    'temperature: Input should be a valid number'
    """
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return bad(f"the body is not valid JSON: {first.get('msg')}")
    path = _field_path(loc)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return bad(f"{path + ': ' if path else ''}{first.get('msg')}{more}", param=path or None)


def _field_path(loc: list[str]) -> str:
    """'messages[0].content' from ['messages', '0', 'content']; a union's branch names dropped."""
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "list", "function-after", "TextPart"):
            break  # pydantic names the union branch it tried next: the field itself ends here
        else:
            out += f".{part}" if out else part
    return out


def check_defaults(req: _Sampling) -> None:
    """Fields accepted only at their defaults: another value is a 400 naming the field."""
    if req.n not in (None, 1):
        raise bad("n must be 1: this server makes one choice per prompt (send the request again for more)", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad(f"{name} must be 0 (unsupported); repetition_penalty is this server's penalty", name)
    if req.logit_bias:
        raise bad("logit_bias is not supported: leave it out or send {}", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise bad("best_of must be 1 (unsupported)", "best_of")
        if req.suffix:
            raise bad("suffix is not supported (this model only continues text)", "suffix")


def stops_of(req: _Sampling) -> list[str]:
    """The stop strings as a list, bounded in number and length."""
    stops = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if len(stops) > MAX_STOPS:
        raise bad(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"stop: each stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    return [s for s in stops if s]


def sampling_of(req: _Sampling) -> dict:
    """Request's sampling arguments (generation.batching.Request) from the body."""
    return dict(temperature=float(req.temperature), top_p=None if req.top_p >= 1 else float(req.top_p),
                top_k=None if req.top_k in (None, -1, 0) else int(req.top_k),
                min_p=None if req.min_p <= 0 else float(req.min_p),
                repetition_penalty=float(req.repetition_penalty), seed=req.seed,
                steer=None if req.steer is None else float(req.steer))


def message_dicts(messages: list[Message]) -> list[dict]:
    """The messages as the chat template reads them: {"role", "content"} with string content.
    'developer' is OpenAI's newer name for 'system'; a list of text parts is joined."""
    out, chars = [], 0
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":
            raise bad(f"messages[{i}].content: a {m.role} message needs content", f"messages[{i}].content")
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        chars += len(text)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    if chars > MAX_CHARS:
        raise bad(f"messages: at most {MAX_CHARS} characters together, got {chars}", "messages")
    return out
