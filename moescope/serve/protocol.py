"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` -> a validated ``Params``.

Bodies are parsed with pydantic in strict mode (a string where a number belongs is an error, not a guess) and
then checked against the served model: its name, its context length (prompt tokens + ``max_tokens`` must fit
``max_seq_len``, or the engine would have to cut the prompt). Every failure is an ``APIError`` 4xx naming the
field. Fields OpenAI defines that change the result but the runtime does not implement (``logprobs``,
``echo``, ``top_p`` ...) are refused when set to anything but their neutral value, never silently ignored;
other unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from moescope.runtime import tokenizer
from moescope.serve import chat
from moescope.serve.openai_errors import APIError
from moescope.serve.ids import tenant as tenant_label

MAX_BODY_BYTES = 1 << 20
MAX_STOP = 4  # as OpenAI
MIN_TEMPERATURE = 0.01  # as vLLM's SamplingParams: 0 < temperature < 0.01 runs at 0.01 (softmax overflows below)
SEED_RANGE = (-(2**63), 2**63 - 1)  # OpenAI's int64; torch.Generator.manual_seed takes [-2**63, 2**64)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# OpenAI fields whose effect the runtime does not implement: accepted only at their neutral values.
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "top_p": (None, 1, 1.0), "frequency_penalty": (None, 0, 0.0),
               "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, []), "response_format": (None, {"type": "text"})}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    min_tokens: int | None = None  # vLLM's extra sampling parameters
    ignore_eos: bool | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class Message(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class ChatBody(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class Params:
    """A validated request: what the engine runs and how to answer."""

    kind: Literal["completion", "chat"]
    prompt: str
    prompt_tokens: int  # including BOS: the count usage and the trace store report
    max_tokens: int
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    tenant: str | None
    stream: bool
    include_usage: bool
    model: str = ""  # the name the client asked for (one of the served names): echoed in the answer
    prompt_ids: tuple[int, ...] | None = None  # a token-id prompt, used as given (``prompt`` is its decoded text)
    min_tokens: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class ModelLimits:
    name: str  # the model's own name (the trace store's)
    max_seq_len: int
    served: tuple[str, ...] = ()  # --served-model-name: the names clients use (default: ``name``)
    vocab_size: int = tokenizer.PAD + 1

    @property
    def names(self) -> tuple[str, ...]:
        return self.served or (self.name,)


def _loc(loc: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    # pydantic names union branches in the location ("prompt.str"); the field is what the client wrote
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "list"))))
    param = _loc(loc) or None
    return APIError(400, f"{param + ': ' if param else ''}{err['msg']}", param=param, code="invalid_type"
                    if "type" in err["type"] else err["type"])


def decode_json(body: bytes) -> dict:
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return obj


def check_model(model: str | None, limits: ModelLimits) -> None:
    if model is not None and model not in limits.names:
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in limits.names)} (GET /v1/models)", type="not_found_error",
                       param="model", code="model_not_found")


def check_token_ids(ids: list[int], limits: ModelLimits, param: str) -> list[int]:
    """Token ids in the vocabulary, else a 400 naming the first one outside it."""
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise APIError(400, f"{param}[{i}]: token id {t} is outside the vocabulary (0-{limits.vocab_size - 1})",
                           param=param, code="invalid_value")
    return ids


def _check_common(req: _Sampling, limits: ModelLimits) -> None:
    check_model(req.model, limits)
    if req.n not in (None, 1):
        raise APIError(400, "n: only n=1 is supported", param="n", code="unsupported_value")
    for name, neutral in UNSUPPORTED.items():
        value = (req.model_extra or {}).get(name)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError(400, f"{name} is not supported by this server (the reference runtime does not implement "
                           "it); leave it unset", param=name, code="unsupported_parameter")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise APIError(400, "temperature must be between 0 and 2", param="temperature", code="invalid_value")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed must be a 64-bit signed integer ({SEED_RANGE[0]} to {SEED_RANGE[1]})",
                       param="seed", code="invalid_value")


def _temperature(value: float | None) -> float:
    """OpenAI's default 1; 0 is greedy; (0, MIN_TEMPERATURE) runs at MIN_TEMPERATURE, as vLLM does."""
    if value is None:
        return 1.0
    return 0.0 if value == 0 else max(float(value), MIN_TEMPERATURE)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} stop strings", param="stop", code="invalid_value")
    return tuple(s for s in stops if s)


def _max_tokens(value: int | None, default: int, n_prompt: int, limits: ModelLimits, prompt_param: str) -> int:
    room = limits.max_seq_len - max(n_prompt, 2)  # the engine keeps >= 2 positions for the prompt (BOS + 1)
    if room < 1:
        raise APIError(400, f"the prompt is {n_prompt} tokens (bytes + BOS): it cannot fit this model's context of "
                       f"{limits.max_seq_len} tokens with room for an answer", param=prompt_param,
                       code="context_length_exceeded")
    if value is None:
        return min(default, room)
    if value <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {value}", param="max_tokens", code="invalid_value")
    if value > room:
        raise APIError(400, f"this model's maximum context length is {limits.max_seq_len} tokens; the prompt is "
                       f"{n_prompt} tokens and max_tokens asks for {value} (at most {room} here)",
                       param="max_tokens", code="context_length_exceeded")
    return value


def _min_tokens(value: int | None, max_tokens: int) -> int:
    if value is None:
        return 0
    if not 0 <= value <= max_tokens:
        raise APIError(400, f"min_tokens must be between 0 and max_tokens ({max_tokens}), got {value}",
                       param="min_tokens", code="invalid_value")
    return value


def _params(kind, req: _Sampling, prompt: str | list[int], max_tokens: int | None, default: int | None,
            limits: ModelLimits, prompt_param: str) -> Params:
    ids = None
    if isinstance(prompt, list):  # token ids, used as given
        if not prompt:
            raise APIError(400, "prompt: a token-id prompt needs at least one id", param=prompt_param,
                           code="invalid_value")
        ids = tuple(check_token_ids(prompt, limits, prompt_param))
        prompt = tokenizer.decode(prompt)
    n_prompt = len(tokenizer.encode(prompt)) if ids is None else len(ids)
    default = limits.max_seq_len if default is None else default
    max_tokens = _max_tokens(max_tokens, default, n_prompt, limits, prompt_param)
    return Params(kind=kind, prompt=prompt, prompt_tokens=n_prompt, max_tokens=max_tokens,
                  temperature=_temperature(req.temperature), seed=req.seed,
                  stop=_stops(req.stop), tenant=tenant_label(req.user), stream=bool(req.stream),
                  include_usage=bool(req.stream_options and req.stream_options.include_usage), model=req.model,
                  prompt_ids=ids, min_tokens=_min_tokens(req.min_tokens, max_tokens),
                  ignore_eos=bool(req.ignore_eos))


def _validated(cls: type[_Sampling], obj: Any, limits: ModelLimits):
    try:
        req = cls.model_validate(obj)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    _check_common(req, limits)
    return req


def parse_completion(obj: Any, limits: ModelLimits) -> Params:
    """A ``/v1/completions`` body. Raises APIError."""
    req = _validated(CompletionBody, obj, limits)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a batch: strings or id lists
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (a list must hold exactly one string or one list "
                           "of token ids)", param="prompt", code="unsupported_value")
        prompt = prompt[0]
    return _params("completion", req, prompt, req.max_tokens, DEFAULT_COMPLETION_TOKENS, limits, "prompt")


def parse_chat(obj: Any, limits: ModelLimits) -> Params:
    """A ``/v1/chat/completions`` body (rendered with ``chat.render``). Raises APIError."""
    req = _validated(ChatBody, obj, limits)
    rendered = _rendered(req.messages)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens",
                       code="invalid_value")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _params("chat", req, chat.render(rendered), max_tokens, None, limits, "messages")


def _rendered(messages: list[Message]) -> list[tuple[str, str]]:
    """Chat messages -> (role, text) for ``chat.render``. Raises APIError."""
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages", code="invalid_value")
    rendered = []
    for i, m in enumerate(messages):
        if m.role not in chat.ROLE_NAMES:
            raise APIError(400, f"messages[{i}].role {m.role!r} is not supported (system, developer, user, "
                           "assistant)", param=f"messages[{i}].role", code="unsupported_value")
        if isinstance(m.content, list):
            bad = [p.type for p in m.content if p.type != "text" or p.text is None]
            if bad:
                raise APIError(400, f"messages[{i}].content: only text parts are supported, got {bad[0]!r}",
                               param=f"messages[{i}].content", code="unsupported_value")
            text = "".join(p.text for p in m.content)
        else:
            text = m.content or ""
        rendered.append((m.role, text))
    return rendered


class TokenizeBody(_Strict):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_tokenize(obj: Any, limits: ModelLimits) -> tuple[list[int], bool]:
    """A ``/tokenize`` body -> (token ids, whether to return their labels). Raises APIError."""
    try:
        req = TokenizeBody.model_validate(obj)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give prompt or messages (one of them)", param="prompt", code="invalid_value")
    text = req.prompt if req.prompt is not None else chat.render(_rendered(req.messages))
    return tokenizer.encode(text, bos=req.add_special_tokens), req.return_token_strs


def parse_detokenize(obj: Any, limits: ModelLimits) -> list[int]:
    """A ``/detokenize`` body -> token ids in the vocabulary. Raises APIError."""
    try:
        req = DetokenizeBody.model_validate(obj)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    check_model(req.model, limits)
    return check_token_ids(req.tokens, limits, "tokens")
