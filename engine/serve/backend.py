"""What the app talks to: a ``Backend`` runs ``GenerateCall``s. ``LocalBackend`` is one process: a ``Worker`` over
one ``ModelRuntime``, the continuous-batching engine (``EngineLoop``) or, when the engine cannot run the model or was
turned off, a ``Batcher`` of batched contiguous ``generate`` calls (``make_worker`` says which, and why);
``engine.serve.ray_app.RayBackend`` sends calls to Ray Serve replicas."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from engine.models import context_length
from engine.runtime import ModelRuntime
from engine.serve.batcher import Batcher
from engine.serve.engine_loop import EngineLoop
from engine.serve.metrics import replica_figures
from engine.serve.protocol import GenerateCall, StreamItem

T = TypeVar("T")


@dataclass(frozen=True)
class ModelInfo:
    """What the app needs to know of the model without running it."""

    model_id: str
    tokenizer: Any
    context_length: int | None  # None: the config names no limit
    vocab_size: int
    default_temperature: float  # 0.0 (greedy) unless the model's generation config samples
    hybrid: bool = False  # recurrent layers: chat calls carry their messages' ends as snapshot hints
    processor: Any = None  # image-text models: what turns a chat with images into model inputs (None: text only)
    pool_tokens: int | None = None  # the engine's KV pool in tokens: a request needing more never fits (None: no limit)


class Backend(Protocol):
    info: ModelInfo

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        """New token ids as they come, then one ``Finished``; closing it early cancels the call."""
        ...

    async def refresh(self) -> None:
        """Fetch fresh per-replica figures (for /metrics); a no-op where they are local."""
        ...

    async def ready(self) -> str | None:
        """None when every replica is up, else what is still missing (for /health)."""
        ...

    def runs_engine(self) -> bool:
        """Whether calls run on the engine (per-request seeds, log-probs, echo, top_k, stop ids)."""
        ...

    def figures(self) -> Mapping[str, Mapping[str, Any]]:
        """Each replica's figures (cache, queue, batches) as of the last refresh."""
        ...

    async def debug(self) -> dict[str, dict[str, Any]]:
        """Each replica's ``debug_figures`` (for soak tests: ``/debug/cache``)."""
        ...


def model_info(model_id: str, runtime: ModelRuntime) -> ModelInfo:
    """``ModelInfo`` of a loaded model runtime (which holds its tokenizer)."""
    model = runtime.model
    gc = model.generation_config
    temperature = float(gc.temperature or 1.0) if gc.do_sample else 0.0
    return ModelInfo(
        model_id,
        runtime.tokenizer,
        context_length(model.config),
        int(model.config.get_text_config(decoder=True).vocab_size),
        temperature,
        runtime.hybrid is not None,
        runtime.processor,
    )


def debug_figures(runtime: ModelRuntime) -> dict[str, Any]:
    """What a soak test watches in one runtime: ``check_integrity()`` ("ok" or its message), the pool's free,
    cached, pinned (by live requests' paths) and owned (in flight) blocks, and live requests. Run it on the
    worker's thread (``run_exclusive``)."""
    cache = runtime.cache
    try:
        cache.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = str(exc) or "AssertionError"
    return {
        "integrity": integrity,
        "blocks": cache.num_blocks,
        "free_blocks": cache.num_free_blocks,
        "cached_blocks": cache.num_cached_blocks,
        "pinned_blocks": cache.num_pinned_blocks,
        "owned_blocks": cache.num_owned_blocks,
        "active_requests": cache.num_active_requests,
    }


def describe_model(model: str) -> ModelInfo:
    """``ModelInfo`` of a preset name or a local model directory, without loading weights (a Ray ingress
    tokenizes and checks lengths; the replicas hold the model)."""
    from engine.media.processor import load_processor
    from engine.models import PRESETS, byte_tokenizer

    if model in PRESETS:
        p = PRESETS[model]
        tok = byte_tokenizer(vision=p.vision is not None)
        proc = load_processor(model, tok)
        return ModelInfo(model, tok, p.max_position_embeddings, p.vocab_size, 0.0, p.family == "qwen3_5", proc)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.cache_utils import DynamicCache

    from engine.hybrid.states import recurrent_layers

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    try:
        gc = GenerationConfig.from_pretrained(model, local_files_only=True)
    except OSError:  # no generation_config.json: transformers' defaults (greedy)
        gc = GenerationConfig()
    temperature = float(gc.temperature or 1.0) if gc.do_sample else 0.0
    hybrid = bool(recurrent_layers(DynamicCache(config=config.get_text_config(decoder=True))))
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    proc = load_processor(model, tokenizer)
    return ModelInfo(model, tokenizer, context_length(config), vocab, temperature, hybrid, proc)


class Worker(Protocol):
    """What serves calls on one runtime: ``EngineLoop`` (the engine) or ``Batcher`` (batched contiguous
    ``generate``). Use from one event loop: ``start``, ``stream`` (any number at once), ``stop``."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        """New token ids as they come, then one ``Finished``; closing it early cancels the call."""
        ...

    def run_exclusive(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn()`` between steps or batches, holding the runtime's lock. Thread-safe."""
        ...

    def stats(self) -> dict[str, Any]:
        """Queue and step (or batch) counters now. Changes nothing."""
        ...

    @property
    def cache_stats(self) -> dict[str, Any]:
        """The runtime's ``cache_stats()`` as of the end of the last step or batch."""
        ...


def make_worker(
    runtime: ModelRuntime,
    *,
    use_engine: bool,
    max_batch_size: int,
    batch_wait_ms: float,
    after: Callable[[bool], None] | None = None,
) -> Worker:
    """The engine loop over ``runtime``'s engine, or (``use_engine`` off, or a model the engine cannot run) a
    ``Batcher``; the reason for the latter is logged. ``after(finished)``: run after each step or batch, on the
    worker's thread (``finished``: whether a request finished in it; always True after a batch)."""
    engine = runtime.engine() if use_engine else None
    if engine is not None:
        return EngineLoop(runtime, engine, after_step=after)
    why = runtime.engine_unsupported_reason if use_engine else "the engine was turned off (--no-engine)"
    logging.getLogger("prefixcache").warning("prefixcache serve: batched generate instead of the engine: %s", why)
    return Batcher(
        runtime,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        after_batch=None if after is None else (lambda: after(True)),
    )


class LocalBackend:
    """One process: calls go to ``worker`` (``make_worker``) over ``runtime`` (which holds the tokenizer)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        model_id: str,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 5.0,
        use_engine: bool = True,
    ) -> None:
        self.runtime = runtime
        self.worker = make_worker(
            runtime, use_engine=use_engine, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms
        )
        pool = runtime.cache.num_blocks * runtime.block_size if isinstance(self.worker, EngineLoop) else None
        self.info = dataclasses.replace(model_info(model_id, runtime), pool_tokens=pool)
        # calls with images: contiguous generate, one at a time (the engine takes no images)
        self.media_worker = Batcher(runtime, max_batch_size=1, batch_wait_ms=0) if runtime.processor else None

    async def start(self) -> None:
        await self.worker.start()
        if self.media_worker is not None:
            await self.media_worker.start()

    async def stop(self) -> None:
        if self.media_worker is not None:
            await self.media_worker.stop()
        await self.worker.stop()

    def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        if call.media:
            if self.media_worker is None:
                raise ValueError("a call with images on a model without a processor")
            return self.media_worker.stream(call)
        return self.worker.stream(call)

    async def refresh(self) -> None:
        return None

    async def ready(self) -> str | None:
        return None

    def runs_engine(self) -> bool:
        return isinstance(self.worker, EngineLoop)

    def figures(self) -> dict[str, dict[str, Any]]:
        return {"local": replica_figures(self.worker.cache_stats, self.worker.stats())}

    async def debug(self) -> dict[str, dict[str, Any]]:
        got = self.worker.run_exclusive(lambda: debug_figures(self.runtime))
        figures = await asyncio.wrap_future(got)
        figures["queue_length"] = self.worker.stats().get("queue_length", 0)
        return {"local": figures}
