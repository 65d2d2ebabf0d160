"""Making a hybrid model's ``HybridStates``: its state shapes, its recurrent modules wrapped, exactness probed."""

from __future__ import annotations

from transformers import PreTrainedModel

from engine.errors import LoadCheckError, UnsupportedModelError
from engine.hybrid import layer_state, probe, recurrent
from engine.hybrid.states import recurrent_layers, spec_of
from engine.hybrid.store import HybridStates
from engine.versions import label

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
    (probed too). Raises ``UnsupportedModelError`` when the recurrent modules cannot be told apart, and
    ``LoadCheckError`` (the runtime then runs the model uncached) when a recurrent cache layer holds a member
    ``layer_state`` does not know, or the probes raise or are exact neither way: all three depend on the installed
    transformers, which the reason names."""
    name = type(model).__name__
    try:
        cache = probe.probe_cache(model)
    except Exception as exc:
        raise LoadCheckError(
            f"{name}'s first forward with a cache raised {type(exc).__name__}: {exc} ({label()})"
        ) from exc
    for i in recurrent_layers(cache):
        why = layer_state.audit(cache.layers[i], f"cache layer {i}")
        if why is not None:
            raise LoadCheckError(f"{why} ({label()})")
    spec = spec_of(cache)
    if not spec.layers:
        return None
    modules = recurrent.find_modules(model, list(spec.layers))
    if isinstance(modules, str):
        raise UnsupportedModelError(f"PrefixCachedModel cannot cache {name}: {modules}")
    tolerance = probe.tolerance(model)
    recurrent.install(modules, tokenwise=False)
    try:
        diff = probe.chunked_difference(model, tokenwise=False)
        tokenwise = diff > tolerance
        if tokenwise:
            recurrent.install(modules, tokenwise=True)
            slow = probe.chunked_difference(model, tokenwise=True)
    except Exception as exc:
        raise LoadCheckError(
            f"{name}'s forward over a cached prefix (a prompt in two chunks) raised {type(exc).__name__}: {exc} "
            f"({label()})"
        ) from exc
    if tokenwise and slow > tolerance:
        raise LoadCheckError(
            f"{name}'s recurrent layers do not continue exactly from a saved state (logits differ by {diff:.1e} in "
            f"chunks, {slow:.1e} token by token, relative; {label()})"
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
