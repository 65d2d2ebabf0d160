"""Making a hybrid model's ``HybridStates``: its state shapes, its recurrent modules wrapped, exactness probed."""

from __future__ import annotations

from transformers import PreTrainedModel

from engine.errors import UnsupportedModelError
from engine.hybrid import probe, recurrent
from engine.hybrid.store import HybridStates

DEFAULT_MAX_CACHED_STATES = 64  # snapshots a hybrid model's state pool holds when none is given


def open_hybrid(
    model: PreTrainedModel,
    *,
    live: int,
    snapshots: int | None,
    block_size: int,
    hash_seed: int,
    interval: int,
    check_memory: bool,
) -> HybridStates | None:
    """The recurrent-state side of ``model``'s cache (None: it has no recurrent layers). Wraps its recurrent
    modules (``engine.hybrid.recurrent``) and probes that a state saved after a prompt's first chunk continues
    exactly; where a multi-token forward over a state is inexact, its modules take such inputs one token at a time
    (probed too). Raises ``UnsupportedModelError`` with the reason when neither is exact or the recurrent modules
    cannot be told apart."""
    spec = probe.probe_spec(model)
    if not spec.layers:
        return None
    name = type(model).__name__
    modules = recurrent.find_modules(model, list(spec.layers))
    if isinstance(modules, str):
        raise UnsupportedModelError(f"PrefixCachedModel cannot cache {name}: {modules}")
    tolerance = probe.tolerance(model)
    recurrent.install(modules, tokenwise=False)
    diff = probe.chunked_difference(model, tokenwise=False)
    tokenwise = diff > tolerance
    if tokenwise:
        recurrent.install(modules, tokenwise=True)
        slow = probe.chunked_difference(model, tokenwise=True)
        if slow > tolerance:
            raise UnsupportedModelError(
                f"PrefixCachedModel cannot cache {name}: its recurrent layers do not continue exactly from a saved "
                f"state (logits differ by {diff:.1e} in chunks, {slow:.1e} token by token, relative)"
            )
    return HybridStates(
        spec,
        live=live,
        snapshots=DEFAULT_MAX_CACHED_STATES if snapshots is None else snapshots,
        device=next(model.parameters()).device,
        block_size=block_size,
        hash_seed=hash_seed,
        interval=interval,
        tokenwise=tokenwise,
        check_memory=check_memory,
    )
