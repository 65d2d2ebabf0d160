"""What the app talks to: a ``Backend`` runs ``GenerateCall``s. ``LocalBackend`` is one process: the
continuous-batching engine of one ``PrefixCachedModel`` (``EngineLoop``), or, for a model the engine cannot run,
a ``Batcher`` of batched ``generate`` calls; ``engine.serve.ray_app.RayBackend`` sends calls to Ray Serve
replicas."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.models import context_length
from engine.serve.batcher import Batcher
from engine.serve.engine_loop import EngineLoop
from engine.serve.metrics import replica_figures
from engine.serve.protocol import GenerateCall, StreamItem


@dataclass(frozen=True)
class ModelInfo:
    """What the app needs to know of the model without running it."""

    model_id: str
    tokenizer: Any
    context_length: int | None  # None: the config names no limit
    vocab_size: int
    default_temperature: float  # 0.0 (greedy) unless the model's generation config samples


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


def model_info(model_id: str, model: Any, tokenizer: Any) -> ModelInfo:
    """``ModelInfo`` of a loaded model and its tokenizer."""
    gc = model.generation_config
    temperature = float(gc.temperature or 1.0) if gc.do_sample else 0.0
    return ModelInfo(model_id, tokenizer, context_length(model.config), int(model.config.vocab_size), temperature)


def describe_model(model: str) -> ModelInfo:
    """``ModelInfo`` of a preset name or a local model directory, without loading weights (a Ray ingress
    tokenizes and checks lengths; the replicas hold the model)."""
    from engine.models import PRESETS, byte_tokenizer

    if model in PRESETS:
        p = PRESETS[model]
        return ModelInfo(model, byte_tokenizer(), p.max_position_embeddings, p.vocab_size, 0.0)  # type: ignore[no-untyped-call]
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    try:
        gc = GenerationConfig.from_pretrained(model, local_files_only=True)
    except OSError:  # no generation_config.json: transformers' defaults (greedy)
        gc = GenerationConfig()  # type: ignore[no-untyped-call]
    temperature = float(gc.temperature or 1.0) if gc.do_sample else 0.0
    return ModelInfo(model, tokenizer, context_length(config), int(config.vocab_size), temperature)


def load_wrapped(
    model: str,
    *,
    max_cached_tokens: int | None,
    block_size: int,
    seed: int = 0,
    engine_config: Any = None,
    **tier: Any,
) -> Any:
    """A ``PrefixCachedModel`` of a preset name or a local model directory, with ``.tokenizer``; ``tier``: the
    wrapper's ``disk_cache`` / ``max_disk_bytes`` / ``shared_cache``."""
    from engine import PrefixCachedModel

    return PrefixCachedModel.from_pretrained(
        model,
        seed=seed,
        max_cached_tokens=max_cached_tokens,
        block_size=block_size,
        engine_config=engine_config,
        **tier,
    )


Worker = EngineLoop | Batcher


def make_worker(pcm: Any, *, use_engine: bool, max_batch_size: int, batch_wait_ms: float, after: Any = None) -> Worker:
    """The engine loop over ``pcm``'s engine, or (``use_engine`` off, or a model the engine cannot run) a
    ``Batcher``; the reason for the latter is logged. ``after(finished)``: the loop's ``after_step`` (the
    batcher's ``after_batch`` is called with no argument)."""
    import logging

    engine = pcm.engine() if use_engine else None
    if engine is not None:
        return EngineLoop(pcm, engine, after_step=after)
    why = pcm.engine_unsupported_reason if use_engine else "the engine was turned off (--no-engine)"
    logging.getLogger("prefixcache").warning("prefixcache serve: batched generate instead of the engine: %s", why)
    return Batcher(
        pcm,
        max_batch_size=max_batch_size,
        batch_wait_ms=batch_wait_ms,
        after_batch=None if after is None else (lambda: after(True)),
    )


class LocalBackend:
    """One process: calls go to ``worker`` (``make_worker``) over ``pcm`` (a ``PrefixCachedModel`` with
    ``.tokenizer``)."""

    def __init__(
        self,
        pcm: Any,
        model_id: str,
        *,
        max_batch_size: int = 8,
        batch_wait_ms: float = 5.0,
        use_engine: bool = True,
    ) -> None:
        self.pcm = pcm
        self.info = model_info(model_id, pcm.model, pcm.tokenizer)
        self.worker = make_worker(
            pcm, use_engine=use_engine, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms
        )

    async def start(self) -> None:
        await self.worker.start()

    async def stop(self) -> None:
        await self.worker.stop()

    def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        return self.worker.stream(call)

    async def refresh(self) -> None:
        return None

    async def ready(self) -> str | None:
        return None

    def runs_engine(self) -> bool:
        return isinstance(self.worker, EngineLoop)

    def figures(self) -> dict[str, dict[str, Any]]:
        return {"local": replica_figures(self.worker.cache_stats, self.worker.stats())}
