"""The engine of a ``PrefixCachedModel``: made on first use over the wrapper's own cache and pool.

``EngineSlot`` decides once whether the model can run on the paged path (``paged_unsupported_reason``, then a
probe forward compared with the model's own) and, when it can, makes the ``Engine``; ``reset()`` forgets it
(the pool was remade, the weights changed). With ``fast_linear`` (default: on the CPU, when the packed copy of
the weights fits ``FAST_LINEAR_MAX_BYTES``) the engine's forwards use prepacked oneDNN linears.
"""

from __future__ import annotations

from typing import Any

from engine.batching.engine import Engine
from engine.batching.scheduler import SchedulerConfig
from engine.paged import linear
from engine.paged.runner import PROBE_TOLERANCE, paged_unsupported_reason, probe_difference

FAST_LINEAR_MAX_BYTES = 4 << 30


class EngineSlot:
    """Holds a wrapper's engine (or the reason it has none)."""

    def __init__(self, config: SchedulerConfig | None, fast_linear: bool | None) -> None:
        self.config = config or SchedulerConfig()
        self.fast_linear = fast_linear
        self.engine: Engine | None = None
        self.reason: str | None = None
        self.tier: Any = None  # the wrapper's KVTier, handed to the engine
        self._linears: Any = None

    def get(self, pcm: Any) -> Engine | None:
        """The engine for ``pcm`` (made now if needed), or None (``self.reason`` says why)."""
        if self.engine is not None or self.reason is not None:
            return self.engine
        model, pool, cache = pcm.model, pcm.pool, pcm.cache
        if pool is None:
            self.reason = f"model not cacheable: {pcm.unsupported_reason}"
            return None
        reason = paged_unsupported_reason(model, pool)
        if reason is None:
            with cache.borrowed_blocks(min(4, cache.num_blocks)) as blocks:
                diff = probe_difference(model, pool, blocks)
            if diff > PROBE_TOLERANCE:
                reason = f"its paged forward's logits differ from its own by {diff:.1e} (relative)"
        if reason is not None:
            self.reason = reason
            return None
        gc = model.generation_config
        eos = gc.eos_token_id
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        self.engine = Engine(
            model,
            cache,
            pool,
            config=self.config,
            eos_token_ids=eos_ids,
            linears=self._packed(model),
            tier=self.tier,
        )
        return self.engine

    def _packed(self, model: Any) -> Any:
        if self.fast_linear is False or linear.available(model) is not None:
            return None
        if self._linears is None:
            if self.fast_linear is None and linear.weight_bytes(model) > FAST_LINEAR_MAX_BYTES:
                return None
            self._linears = linear.PackedLinears(model)
        return self._linears

    def reset(self, error: BaseException | None = None) -> None:
        """Forget the engine (its requests fail with ``error``); the packed weights are repacked on next use."""
        if self.engine is not None and error is not None:
            self.engine.abort_all(error)
        self.engine = None
        self.reason = None
        self._linears = None
