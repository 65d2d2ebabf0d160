"""What the app talks to: a ``Backend`` runs ``GenerateCall``s. ``LocalBackend`` is one process (a ``Batcher``
over one ``PrefixCachedModel``); ``engine.serve.ray_app.RayBackend`` sends calls to Ray Serve replicas."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from engine.serve.batcher import Batcher, StreamItem
from engine.serve.metrics import replica_figures
from engine.serve.protocol import GenerateCall


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

    def figures(self) -> Mapping[str, Mapping[str, Any]]:
        """Each replica's figures (cache, queue, batches) as of the last refresh."""
        ...


def context_length(config: Any) -> int | None:
    """The longest sequence a model config allows (prompt + generated), or None."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


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


def load_wrapped(model: str, *, max_cached_tokens: int | None, block_size: int, seed: int = 0) -> Any:
    """A ``PrefixCachedModel`` of a preset name or a local model directory, with ``.tokenizer``."""
    from engine import PrefixCachedModel

    return PrefixCachedModel.from_pretrained(
        model, seed=seed, max_cached_tokens=max_cached_tokens, block_size=block_size
    )


class LocalBackend:
    """One process: calls go to a ``Batcher`` over ``pcm`` (a ``PrefixCachedModel`` with ``.tokenizer``)."""

    def __init__(self, pcm: Any, model_id: str, *, max_batch_size: int = 8, batch_wait_ms: float = 5.0) -> None:
        self.pcm = pcm
        self.info = model_info(model_id, pcm.model, pcm.tokenizer)
        self.batcher = Batcher(pcm, max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms)

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    def stream(self, call: GenerateCall) -> AsyncGenerator[StreamItem, None]:
        return self.batcher.stream(call)

    async def refresh(self) -> None:
        return None

    async def ready(self) -> str | None:
        return None

    def figures(self) -> dict[str, dict[str, Any]]:
        return {"local": replica_figures(self.batcher.cache_stats, self.batcher.stats())}
