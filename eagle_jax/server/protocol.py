"""The OpenAI request and response bodies: requests checked by pydantic (strict types,
unknown fields refused) into ``SamplingParams``, errors as OpenAI's error JSON naming the
field, and the completion, chat-completion and chunk bodies.

Supported: ``/v1/completions`` (``prompt``: text or token ids) and
``/v1/chat/completions``; ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k`` (an extension, as in vLLM; -1 or 0 is off),
``seed``, ``stop``, ``n`` (1 only), ``stream``, ``stream_options.include_usage`` and
``user`` (accepted, unused). Anything else (logprobs, penalties, tools, ...) is refused
with a 400 that names it, rather than silently ignored.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from eagle_jax.serving.requests import Completion
from eagle_jax.spec.sampling import SamplingParams

# OpenAI's defaults where the request leaves a field out.
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP = 4  # stop sequences per request, as OpenAI allows


class APIError(Exception):
    """An error the client gets as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "0.5" is not a temperature and true is not a max_tokens; forbid: a misspelt
    # or unsupported field is an error, not a silent default.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop sequences, got {len(stop)}", param="stop")
        if any(not s for s in stop):
            raise APIError(400, "stop: a stop sequence is a non-empty string", param="stop")
        if self.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {self.n} (send one request per completion)", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream=true", param="stream_options")
        # No seed: a fresh one, as OpenAI samples differently each time; a seed repeats.
        seed = self.seed if self.seed is not None else secrets.randbelow(2**32)
        return SamplingParams(temperature=float(self.temperature), top_k=max(self.top_k, 0), top_p=float(self.top_p),
                              seed=seed, max_new_tokens=max_tokens, stop_strings=tuple(stop))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(None, ge=1)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def parse(model: type[_Strict], body: bytes) -> Any:
    """The request ``body`` as ``model``, or an ``APIError`` (400) naming the field."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise _validation_error(e) from e


def _validation_error(e: pydantic.ValidationError) -> APIError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {err['msg']}")
    if err["type"] == "model_type" and not err["loc"]:
        return APIError(400, "the request body must be a JSON object")
    param = _field_path(err["loc"])
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{param}: unknown or unsupported parameter", param=param)
    if err["type"] == "missing":
        return APIError(400, f"{param}: this field is required", param=param)
    return APIError(400, f"{param}: {err['msg']} (got {err['input']!r})"[:500], param=param)


# The tags pydantic puts in an error's location for the branch of a union it tried
# (prompt: str | list[int]; stop: str | list[str]): not part of the field's path.
_UNION_TAGS = {"str", "int", "float", "bool", "list[str]", "list[int]"}


def _field_path(loc: tuple) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _UNION_TAGS:
            out += ("." if out else "") + str(part)
    return out


# -- responses


def extension(c: Completion) -> dict[str, Any]:
    """The ``eagle_jax`` field every response carries: token ids, accept lengths and the
    steps each shape took for this request."""
    m = c.metrics
    return {
        "token_ids": c.token_ids,
        "accept_lengths": m.accept_lengths,
        "mean_accept_length": round(m.mean_accept_length, 4),
        "steps_by_shape": dict(m.steps_by_shape),
        "spec_steps": m.spec_steps,
        "plain_steps": m.plain_steps,
    }


def usage(prompt_tokens: int, c: Completion) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.token_ids),
            "total_tokens": prompt_tokens + len(c.token_ids)}


def completion_body(rid: str, model: str, prompt_tokens: int, c: Completion, *, chat: bool) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                  "finish_reason": c.finish_reason}
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, c), "eagle_jax": extension(c)}


def chunk_body(rid: str, model: str, created: int, *, chat: bool, text: str | None = None, role: bool = False,
               finish: Completion | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta, the chat's opening role delta, or the final one
    with the finish reason and the ``eagle_jax`` extension."""
    reason = None if finish is None else finish.finish_reason
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if finish is not None:
        body["eagle_jax"] = extension(finish)
    return body


def usage_chunk(rid: str, model: str, created: int, prompt_tokens: int, c: Completion, *, chat: bool) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, c)}
