"""The OpenAI-compatible wire format: request models (pydantic, strict types), error objects, response bodies.

Unknown fields are ignored (as vLLM does); known fields of the wrong type, and features this server does not
implement (``n > 1``, ``stop``, ``logprobs``, ``echo``, ``seed``, tools), are a 400 with an OpenAI-style error
object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the client caused (or the server hit), sent as an OpenAI error object with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """Fields both endpoints take. Strict: ``"5"`` is not an int; ints are accepted where floats are."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: Any = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    def check_supported(self) -> None:
        """Raise APIError(400) for a feature this server does not implement (rather than ignore it)."""
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported; send one request per completion", param="n")
        if self.stop:
            raise APIError(400, "stop sequences are not supported", param="stop")
        if self.seed is not None:
            raise APIError(400, "seed is not supported (batched sampling shares one RNG)", param="seed")
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt is an empty list", param="prompt")
        if self.stream and self.prompts_count() > 1:
            raise APIError(400, "stream: true takes one prompt, got a list of prompts", param="prompt")

    def prompts_count(self) -> int:
        p = self.prompt
        return len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per choice."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return list(p)
        return [p]  # type: ignore[list-item]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined)."""
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p.text for p in c)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    response_format: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format is not supported", param="response_format")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- between the app and a backend (one process or a Ray replica) ----------------------------------------------
@dataclass(frozen=True)
class GenerateCall:
    """One prompt to complete, as the app hands it to a backend (in Ray, the argument the router reads).

    ``namespace`` is the tenant's namespace (from the cache salt), not yet joined with the model fingerprint.
    ``temperature`` 0 means greedy. Calls batch together when their ``sampling`` agrees.
    """

    request_id: str
    prompt: tuple[int, ...]
    namespace: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def sampling(self) -> tuple[float, float]:
        return (self.temperature, self.top_p if self.temperature > 0 else 1.0)


@dataclass(frozen=True)
class Finished:
    """The last item of a call's stream: why it stopped and its token counts (``cached_tokens`` as served)."""

    finish_reason: str  # "stop" (EOS), "length" (max_tokens), "cancelled" (client went away)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object, reuse reported as ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
