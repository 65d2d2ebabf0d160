"""The OpenAI-compatible wire format: request models (pydantic, strict types), error objects, response bodies.

Unknown fields are ignored (as vLLM does); known fields of the wrong type, and features this server does not
implement (``n > 1``, tools, non-zero penalties, ``logit_bias``), are a 400 with an OpenAI-style error object
``{"error": {"message", "type", "param", "code"}}``. Beside OpenAI's fields the server takes vLLM's ``top_k``,
``stop_token_ids`` and ``ignore_eos``. Those, ``stop`` strings, ``seed``, ``logprobs`` and ``echo`` need the
engine: a model served by the batched-generate fallback refuses them (``engine=False`` below).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
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
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as a Retry-After header (429, 503)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


MAX_LOGPROBS = 5  # OpenAI's limit on alternatives per position (completions' logprobs, chat's top_logprobs)


class _Request(BaseModel):
    """Fields both endpoints take. Strict: ``"5"`` is not an int; ints are accepted where floats are."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # OpenAI's range; only 0 is served
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # only none (or {}) is served

    def check_supported(self, engine: bool) -> None:
        """Raise APIError(400) for a feature this server does not implement (rather than ignore it); ``engine``:
        whether the backend runs the engine (else it refuses what only the engine does)."""
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported; send one request per completion", param="n")
        if any(not s for s in self.stop_strings()):
            raise APIError(400, "stop holds an empty string", param="stop")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (0 or null only)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported (null or {} only)", param="logit_bias")
        if not engine:
            for name in ("seed", "top_k", "stop_token_ids"):
                if getattr(self, name) is not None:
                    raise APIError(
                        400, f"{name} is not supported for this model (it runs without the engine)", param=name
                    )
            if self.ignore_eos:
                raise APIError(
                    400, "ignore_eos is not supported for this model (it runs without the engine)", param="ignore_eos"
                )
            if self.stop_strings():
                raise APIError(
                    400, "stop strings are not supported for this model (it runs without the engine)", param="stop"
                )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: true)", param="max_tokens")

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (a string is one stop string; null or [] none)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _check_logprobs(self, wanted: bool, engine: bool, param: str) -> None:
        if not wanted:
            return
        if not engine:
            raise APIError(400, "logprobs are not supported for this model (it runs without the engine)", param=param)
        if self.stream:
            raise APIError(400, "logprobs with stream: true are not supported; ask without streaming", param=param)


class CompletionRequest(_Request):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self, engine: bool) -> None:
        super().check_supported(engine)
        self._check_logprobs(self.logprobs is not None, engine, "logprobs")
        if self.echo and not engine:
            raise APIError(400, "echo is not supported for this model (it runs without the engine)", param="echo")
        if self.echo and self.stream:
            raise APIError(400, "echo with stream: true is not supported", param="echo")
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


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    """An image in a chat message: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined; images left out)."""
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "".join(p.text for p in c if isinstance(p, TextPart))

    def images(self) -> list[ImagePart]:
        c = self.content
        return [p for p in c if isinstance(p, ImagePart)] if isinstance(c, list) else []


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    response_format: Any = None

    def check_supported(self, engine: bool) -> None:
        super().check_supported(engine)
        self._check_logprobs(self.logprobs, engine, "logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
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
    max_tokens: int  # 0: score the prompt only (echo)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # log-probs of every prompt token, with this many alternatives
    logprobs: int | None = None  # log-probs of every generated token, with this many alternatives
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first of them (the engine stops there)
    hints: tuple[int, ...] = ()  # hybrid models: prompt positions where chats part (its messages' ends)
    media: Mapping[str, Any] | None = None  # images: the processor's tensors beside the ids (pixel_values, ...)

    @property
    def sampling(self) -> tuple[float, float]:
        return (self.temperature, self.top_p if self.temperature > 0 else 1.0)


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens 1.. (token 0 has none) and their alternatives (id -> log-prob)."""

    logprobs: tuple[float, ...]
    top: tuple[dict[int, float], ...]


@dataclass(frozen=True)
class Finished:
    """The last item of a call's stream: why it stopped and its token counts (``cached_tokens`` as served)."""

    finish_reason: str  # "stop" (EOS), "length" (max_tokens), "cancelled" (client went away)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    sample_logprobs: tuple[tuple[float, dict[int, float]], ...] = ()  # per generated token, when asked


StreamItem = list[int] | Finished  # what a backend's stream yields: new token ids, then one Finished


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
