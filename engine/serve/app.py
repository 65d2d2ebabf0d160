"""The OpenAI-compatible FastAPI app, over any ``Backend`` (one process, or Ray Serve replicas).

``POST /v1/completions`` and ``/v1/chat/completions`` (``stream: true`` as server-sent events), ``GET
/v1/models``, ``/health`` and ``/metrics`` (Prometheus). A request's ``cache_salt`` field, else its
``X-Cache-Salt`` header, selects its cache namespace: different salts never share a block. Every answer
reports reuse as ``usage.prompt_tokens_details.cached_tokens``. Bad input gets an OpenAI error object with a
4xx status and changes nothing; a client that goes away mid-request has its row stopped at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine.hybrid.hints import message_ends
from engine.serve.backend import Backend
from engine.serve.detokenize import IncrementalText
from engine.serve.images import DEFAULT_MAX_IMAGE_BYTES, decode_image
from engine.serve.metrics import ServeMetrics
from engine.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Finished,
    GenerateCall,
    ImagePart,
    error_body,
    new_id,
    now,
    usage,
)
from engine.serve.response_logprobs import chat_logprobs, completion_logprobs
from engine.serve.stop_strings import cut, visible
from prefixcache.core.config import DEFAULT_NAMESPACE

R = TypeVar("R", bound=pydantic.BaseModel)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SALT_HEADER = "x-cache-salt"
REPLICA_HEADER = "x-prefixcache-replica"


def salt_namespace(salt: str | None) -> str:
    """The cache namespace of a cache salt: unsalted requests share ``default``; a salt never maps onto it."""
    return DEFAULT_NAMESPACE if salt is None else f"salt:{salt}"


def create_app(
    backend: Backend,
    *,
    default_max_tokens: int = 256,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_queued_requests: int | None = None,
    debug: bool = False,
) -> FastAPI:
    """The app over ``backend``; its lifespan starts and stops the backend (uvicorn and Ray Serve run it).

    ``default_max_tokens`` caps a chat completion that names no limit (completions default to 16, as OpenAI);
    ``max_image_bytes``: the largest encoded image a chat message may carry; ``max_queued_requests``: requests
    in flight (running and waiting) past which a new one gets 429 with ``Retry-After`` (None: no limit);
    ``debug``: serve ``GET /debug/cache`` (each replica's pool, pins and ``check_integrity()``), for soak tests.
    ``app.state.serving.draining = True`` (``run_local`` sets it on SIGTERM) answers new requests 503 and
    ``/health`` "draining".
    """
    metrics = ServeMetrics(backend.figures)
    serving = _Serving(backend, metrics, default_max_tokens, max_image_bytes, max_queued_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="prefixcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.metrics = metrics
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = None if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            error_body(str(exc.detail), type="invalid_request_error", code=code), status_code=exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), type="invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc!r}", type="server_error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if serving.draining:
            detail = f"{serving.in_flight} request(s) finishing; no new ones are taken"
            return JSONResponse({"status": "draining", "detail": detail}, status_code=503)
        missing = await backend.ready()
        if missing is not None:
            return JSONResponse({"status": "starting", "detail": missing}, status_code=503)
        return JSONResponse({"status": "ok"})

    if debug:

        @app.get("/debug/cache")
        async def debug_cache() -> JSONResponse:
            return JSONResponse({"in_flight": serving.in_flight, "replicas": await backend.debug()})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": backend.info.model_id, "object": "model", "created": now(), "owned_by": "prefixcache"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        await backend.refresh()
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.answer(request, CompletionRequest, _CompletionFormat())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.answer(request, ChatRequest, _ChatFormat())

    return app


# ---- response shapes ---------------------------------------------------------------------------------------------
class _CompletionFormat:
    announce_role = False  # a stream's first chunk goes out only with text
    endpoint = "completions"
    prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, index: int, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        return self.choice(index, text, finish)


class _ChatFormat:
    announce_role = True  # a stream's first chunk says the role at once
    endpoint = "chat"
    prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, index: int, text: str, finish: str | None, logprobs: Any = None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def delta(self, index: int, text: str, finish: str | None, first: bool) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}


_Format = _CompletionFormat | _ChatFormat


def _finish_reason(f: Finished) -> str:
    return "length" if f.finish_reason == "length" else "stop"


class _Detokenizer:
    """Text deltas of a growing token list (``IncrementalText``: only the new ids are decoded): holds back an
    incomplete UTF-8 character at the end and, with ``stops``, the tail that could still become a stop string (the
    text ends before a stop string). ``flush`` renders the end from one whole decode, as a non-streamed reply."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.text = IncrementalText(lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
        self.emitted = ""

    @property
    def ids(self) -> list[int]:
        return self.text.ids

    def push(self, ids: list[int]) -> str:
        """Add ``ids``; returns the text to stream now ("" while it is held back)."""
        if not self.text.push(ids):
            return ""
        return self._emit(visible(self.text.text, self.stops) if self.stops else self.text.text)

    def flush(self) -> str:
        """The rest of the reply's text (the ids are all in)."""
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(cut(text, self.stops) if self.stops else text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


# ---- the request path --------------------------------------------------------------------------------------------
class _Serving:
    def __init__(
        self,
        backend: Backend,
        metrics: ServeMetrics,
        default_max_tokens: int,
        max_image_bytes: int,
        max_queued_requests: int | None = None,
    ) -> None:
        self.backend = backend
        self.max_image_bytes = max_image_bytes
        self.max_queued_requests = max_queued_requests
        self.info = backend.info
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.in_flight = 0  # requests admitted and not yet answered (streams: until their last event)
        self.draining = False

    def _admit(self) -> None:
        """Raise APIError 503 (draining) or 429 (``max_queued_requests`` in flight) for a new request."""
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            raise APIError(503, "the server is shutting down; retry on another replica", retry_after=1)
        limit = self.max_queued_requests
        if limit is not None and self.in_flight >= limit:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(
                429,
                f"{self.in_flight} requests are in flight, this server's limit (--max-queued-requests {limit}); "
                "retry later",
                code="queue_full",
                retry_after=1,
            )

    def _enter(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def _done(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)

    async def answer(self, request: Request, kind: type[CompletionRequest | ChatRequest], fmt: _Format) -> Response:
        started = time.monotonic()
        try:
            body = _parse(kind, await request.body())
            calls = self._calls(body, request)
            self._admit()
        except APIError as exc:
            self.metrics.requests.labels(fmt.endpoint, str(exc.status)).inc()
            raise
        rid = new_id(fmt.prefix)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            self.metrics.requests.labels(fmt.endpoint, "200").inc()
            events = self._sse(calls[0], rid, fmt, include_usage, started)  # in flight once it starts
            return StreamingResponse(events, media_type="text/event-stream")
        self._enter()
        try:
            results = await _unless_disconnected(request, asyncio.gather(*(self._run(call, started) for call in calls)))
        except APIError as exc:
            self.metrics.requests.labels(fmt.endpoint, str(exc.status)).inc()
            if exc.status == 499:
                self.metrics.aborted.inc()
            raise
        finally:
            self._done()
        self.metrics.requests.labels(fmt.endpoint, "200").inc()
        choices = [
            fmt.choice(i, self._text(call, ids), _finish_reason(f), self._logprobs(call, ids, f, body))
            for i, (call, (ids, f)) in enumerate(zip(calls, results))
        ]
        total = [
            sum(getattr(f, k) for _, f in results) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")
        ]
        payload = {
            "id": rid,
            "object": fmt.object,
            "created": now(),
            "model": self.info.model_id,
            "choices": choices,
            "usage": usage(*total),
        }
        replicas = sorted({f.replica for _, f in results if f.replica is not None})
        headers = {REPLICA_HEADER: ",".join(replicas)} if replicas else None
        return JSONResponse(payload, headers=headers)

    # ---- validation: body -> calls -------------------------------------------------------------------------
    def _calls(self, body: CompletionRequest | ChatRequest, request: Request) -> list[GenerateCall]:
        body.check_supported(self.backend.runs_engine())
        if body.model != self.info.model_id:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist; this server serves `{self.info.model_id}`",
                param="model",
                code="model_not_found",
            )
        salt = body.cache_salt if body.cache_salt is not None else request.headers.get(SALT_HEADER)
        if salt == "":
            raise APIError(400, f"the {SALT_HEADER} header is empty", param="cache_salt")
        namespace = salt_namespace(salt)
        hints: tuple[int, ...] = ()
        media = None
        if isinstance(body, ChatRequest):
            chat, media = self._chat_tokens(body)
            prompts, param, limit, default = [chat], "messages", body.token_limit, self.default_max_tokens
            if self.info.hybrid:  # where chats part: a hybrid model keeps its recurrent state there
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                hints = message_ends(self.info.tokenizer, messages, chat)
        else:
            prompts = [self._prompt_tokens(p, i, body.prompts_count()) for i, p in enumerate(body.prompts())]
            param, limit, default = "prompt", body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS
        temperature = self.info.default_temperature if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        top_k = 0 if body.top_k is None or body.top_k < 0 else body.top_k
        stop_ids = tuple(body.stop_token_ids or ())
        stops = body.stop_strings()
        bad = next((t for t in stop_ids if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop_token_ids holds {bad}, not an id of the vocabulary", param="stop_token_ids")
        prompt_lp = sample_lp = None
        if isinstance(body, CompletionRequest):
            sample_lp = body.logprobs
            if body.echo:
                prompt_lp = body.logprobs or 0
        elif body.logprobs:
            sample_lp = body.top_logprobs or 0
        calls = []
        for tokens in prompts:
            max_tokens = self._max_tokens(len(tokens), limit, default, param)
            need, pool = len(tokens) + max(max_tokens, 1) - 1, self.info.pool_tokens
            if pool is not None and media is None and need > pool:  # the engine's requests hold their KV in the pool
                raise APIError(
                    400,
                    f"this request needs the KV of {need} tokens ({len(tokens)} in the prompt, {max_tokens} to "
                    f"generate) and the server's KV pool holds {pool}: it can never run. Shorten the prompt or lower "
                    "max_tokens (or start the server with a larger --max-cached-tokens)",
                    param=param,
                    code="kv_pool_exceeded",
                )
            if max_tokens == 0 and len(tokens) < 2:
                raise APIError(400, "echo with max_tokens 0 scores a prompt of 2 tokens or more", param=param)
            calls.append(
                GenerateCall(
                    new_id("call"),
                    tuple(tokens),
                    namespace,
                    max_tokens,
                    temperature,
                    top_p,
                    top_k,
                    body.seed,
                    stop_ids,
                    body.ignore_eos,
                    prompt_lp,
                    sample_lp if max_tokens else None,
                    stops,
                    hints,
                    media,
                )
            )
        return calls

    def _prompt_tokens(self, prompt: str | list[int], index: int, count: int) -> list[int]:
        param = "prompt" if count == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            tokens = list(self.info.tokenizer(prompt).input_ids)
        else:
            tokens = list(prompt)
            bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise APIError(
                    400,
                    f"{param}[{bad}] is token id {tokens[bad]}; ids must be in [0, {self.info.vocab_size})",
                    param=param,
                )
        if not tokens:
            raise APIError(400, f"{param} is empty", param=param)
        return tokens

    def _chat_tokens(self, body: ChatRequest) -> tuple[list[int], dict[str, Any] | None]:
        """The chat's prompt tokens and, when its messages hold images, the processor's tensors beside them."""
        tok = self.info.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise APIError(400, f"model `{self.info.model_id}` has no chat template; use /v1/completions")
        if any(m.images() for m in body.messages):
            return self._image_chat(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejects these messages: {exc}", param="messages") from None
        tokens = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(tokens), None

    def _image_chat(self, body: ChatRequest) -> tuple[list[int], dict[str, Any]]:
        """A chat with image parts: decoded (``engine.serve.images``), rendered by the chat template with an image
        placeholder per part, and run through the model's processor."""
        processor = self.info.processor
        if processor is None:
            raise APIError(400, f"model `{self.info.model_id}` takes no images", param="messages")
        images: list[Any] = []
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(body.messages):
            if not isinstance(m.content, list):
                messages.append({"role": m.role, "content": m.text()})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(m.content):
                if isinstance(part, ImagePart):
                    where = f"messages[{i}].content[{j}].image_url"
                    images.append(decode_image(part.image_url.url, where, self.max_image_bytes))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part.text})
            messages.append({"role": m.role, "content": parts})
        try:
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out = processor(text=[text], images=images, return_tensors="pt")
        except Exception as exc:  # the template or the processor rejects the conversation
            raise APIError(400, f"the model's processor rejects these messages: {exc}", param="messages") from None
        tokens = [int(t) for t in out["input_ids"][0]]
        media = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        return tokens, media

    def _max_tokens(self, n: int, limit: int | None, default: int, param: str) -> int:
        ctx = self.info.context_length
        if ctx is not None and (n > ctx or (n == ctx and limit != 0)):
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens; the prompt has {n}, leaving no room to "
                "generate. Shorten the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        if limit is None:
            return default if ctx is None else min(default, ctx - n)
        if ctx is not None and n + limit > ctx:
            raise APIError(
                400,
                f"This model's maximum context length is {ctx} tokens; you asked for {n + limit} ({n} in the "
                f"prompt, {limit} to generate). Shorten the prompt or lower max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return limit

    # ---- running ---------------------------------------------------------------------------------------------
    async def _run(self, call: GenerateCall, started: float) -> tuple[list[int], Finished]:
        """Run one call to its end; returns its generated ids and its Finished."""
        ids: list[int] = []
        async with aclosing(self.backend.stream(call)) as items:
            async for item in items:
                if isinstance(item, Finished):
                    self._count(item)
                    return ids, item
                if not ids:
                    self.metrics.ttft.observe(time.monotonic() - started)
                ids += item
        raise APIError(500, "the backend ended a call without finishing it", type="server_error")

    def _text(self, call: GenerateCall, ids: list[int]) -> str:
        """A choice's text: the generated text, after the prompt's when the call echoes it."""
        decode = self.info.tokenizer.decode
        text: str = decode(ids, skip_special_tokens=True)
        if call.stop:
            text = cut(text, call.stop)
        if call.prompt_logprobs is not None:
            text = decode(list(call.prompt), skip_special_tokens=True) + text
        return text

    def _logprobs(self, call: GenerateCall, ids: list[int], f: Finished, body: Any) -> dict[str, Any] | None:
        """The choice's ``logprobs`` object, or None when not asked for."""
        if call.prompt_logprobs is None and call.logprobs is None:
            return None
        tok = self.info.tokenizer
        if isinstance(body, ChatRequest):
            return chat_logprobs(tok, ids, f.sample_logprobs)
        return completion_logprobs(tok, list(call.prompt) if call.prompt_logprobs is not None else [], f, ids)

    def _count(self, f: Finished) -> None:
        self.metrics.prompt_tokens.inc(f.prompt_tokens)
        self.metrics.cached_tokens.inc(f.cached_tokens)
        self.metrics.completion_tokens.inc(f.completion_tokens)

    async def _sse(
        self, call: GenerateCall, rid: str, fmt: _Format, include_usage: bool, started: float
    ) -> AsyncIterator[str]:
        """Server-sent events of one call: text deltas, the finish reason, usage if asked, ``[DONE]`` (the last
        chunks in one write). Every chunk's fixed head (id, object, created, model) is serialised once."""
        base = {"id": rid, "object": fmt.chunk_object, "created": now(), "model": self.info.model_id}
        head = "data: " + json.dumps(base)[:-1] + ', "choices": '

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            tail = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
            return f"{head}{json.dumps(choices)}{tail}}}\n\n"

        detok = _Detokenizer(self.info.tokenizer, call.stop)
        first = True
        complete = False
        self._enter()
        try:
            async with aclosing(self.backend.stream(call)) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        self._count(item)
                        last: list[str] = []
                        tail = detok.flush()
                        if tail or (first and fmt.announce_role):
                            last.append(event([fmt.delta(0, tail, None, first)]))
                        last.append(event([fmt.delta(0, "", _finish_reason(item), False)]))
                        if include_usage:
                            u = usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                            last.append(event([], usage=u))
                        last.append("data: [DONE]\n\n")
                        complete = True
                        yield "".join(last)
                        return
                    if not detok.ids:
                        self.metrics.ttft.observe(time.monotonic() - started)
                    delta = detok.push(item)
                    if delta or (first and fmt.announce_role):
                        yield event([fmt.delta(0, delta, None, first)])
                        first = False
        except Exception as exc:  # after the 200 went out, an error can only travel in the stream
            complete = True
            yield f"data: {json.dumps(error_body(f'generation failed: {exc!r}', type='server_error'))}\n\n"
        finally:  # also when the client went away (the generator is closed): the call was cancelled with it
            self._done()
            if not complete:
                self.metrics.aborted.inc()
        yield "data: [DONE]\n\n"


def _parse(kind: type[R], raw: bytes) -> R:
    """The request body as ``kind``, or APIError(400) naming the first bad field."""
    try:
        return kind.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}") from None
        field = str(first["loc"][0]) if first["loc"] else None  # the top-level field, as OpenAI's param
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:4]]
        raise APIError(400, "invalid request: " + "; ".join(parts), param=field) from None


T = TypeVar("T")


async def _unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its rows stop) and raise APIError(499)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "client closed the request", code="client_closed_request")
