"""Everything a transformers recurrent cache layer holds, as whole units: audited, read and written here only.

transformers (5.x) keeps a recurrent layer's state on a ``LinearAttentionCacheLayerMixin``, and its members change
between releases (5.25 added ``cumulative_length_linear``, a token count that ``Cache.get_seq_length()`` reads).
Copying named fields in and out would leave a new member behind without a sound, so the layer is walked instead:
every instance attribute must be one this module knows (``MEMBERS``: state tensors, flags, settings, counters, and
the attention part of a layer that holds both), and ``audit`` names any other one. A model whose layers hold
something unknown is run uncached with that reason (``engine.hybrid.setup``), never half-restored.

``write`` is the one place a layer is given a state: the tensors per ``(state index, kind)``, their flags, kernel
size, device and dtype, and the token count set to the prefix length; it checks afterwards that the layer answers
``get_seq_length`` as a layer of that length should.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

# per state index j: the tensors a later forward continues from (the snapshot), by attribute -> kind
STATE = {"conv_states": "conv", "recurrent_states": "recurrent"}
# per state index j: whether a tensor is there, and whether the next forward continues from it
FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state")
# what the layer is (its shape of state and placement): the same for every sequence of a model
SETTINGS = ("number_of_states", "conv_kernel_size", "device", "dtype")
# tokens the layer has seen (transformers >= 5.25): set to the prefix length on a restore
COUNTERS = ("cumulative_length_linear",)
# past-state recording for ``crop`` (assisted decoding): never on in a cache prefixcache builds
RECORDING = ("record_past", "recurrent_states_to_keep", "recurrent_states_history")
# a layer that is attention too (Falcon-H1's): its K/V, served from the KV pool (``engine.hf_cache``)
ATTENTION = ("keys", "values", "is_initialized", "_bufs", "_views")

MEMBERS = frozenset((*STATE, *FLAGS, *SETTINGS, *COUNTERS, *RECORDING, *ATTENTION))


def audit(layer: Any, where: str) -> str | None:
    """Why ``layer`` (cache layer ``where``) cannot be snapshotted and restored whole, or None: an instance attribute
    this module does not know, past-state recording switched on, or a token count of a type it cannot set. Changes
    nothing."""
    unknown = sorted(set(vars(layer)) - MEMBERS)
    if unknown:
        described = ", ".join(f"{name} ({type(getattr(layer, name)).__name__})" for name in unknown)
        return (
            f"{where} ({type(layer).__name__}) holds {described}, which prefixcache does not know how to snapshot "
            "and restore"
        )
    if getattr(layer, "record_past", False):
        return f"{where} ({type(layer).__name__}) records past states (for crop), which a snapshot does not hold"
    for name in COUNTERS:
        value = getattr(layer, name, 0)
        if not isinstance(value, int) and not (isinstance(value, torch.Tensor) and value.dim() == 0):
            return f"{where} ({type(layer).__name__}).{name} is a {type(value).__name__}, not a token count"
    return None


def expected_length(layer: Any, length: int) -> int:
    """What ``layer.get_seq_length()`` answers for a layer holding ``length`` tokens: a layer that is attention
    too reports its K/V (whose length the KV side sets), a recurrent-only one its token count."""
    if isinstance(layer, DynamicLayer):
        keys = getattr(layer, "keys", None)
        return 0 if keys is None or not getattr(layer, "is_initialized", False) else int(keys.shape[-2])
    return length


def write(
    layer: LinearAttentionCacheLayerMixin,
    tensors: Mapping[tuple[int, str], torch.Tensor],
    kernels: Mapping[int, int | None],
    *,
    length: int,
    previous: bool = True,
) -> None:
    """Give ``layer`` a state: ``tensors[(j, kind)]`` become its conv / recurrent tensors (kept as given: a view
    writes through), flagged as initialised, with ``kernels[j]``, the tensors' device and dtype, a token count of
    ``length`` and ``has_previous_state`` = ``previous`` for every state index. Raises RuntimeError when the layer
    then does not report ``length`` tokens (an upstream change this code does not know). Changes ``layer``."""
    first: torch.Tensor | None = None
    for (j, kind), tensor in tensors.items():
        if kind == "conv":
            layer.conv_states[j] = tensor
            layer.is_conv_states_initialized[j] = True
            layer.conv_kernel_size[j] = kernels.get(j)
            first = tensor if first is None else first
        else:
            layer.recurrent_states[j] = tensor
            layer.is_recurrent_states_initialized[j] = True
    if first is not None:  # as the layer's lazy initialisation records them (transformers annotates them None)
        setattr(layer, "device", first.device)  # noqa: B010
        setattr(layer, "dtype", first.dtype)  # noqa: B010
    for j in range(layer.number_of_states):
        layer.has_previous_state[j] = previous
    device = first.device if first is not None else None
    for name in COUNTERS:
        if hasattr(layer, name):
            old = getattr(layer, name)
            new = torch.tensor(length, dtype=old.dtype, device=device) if isinstance(old, torch.Tensor) else length
            setattr(layer, name, new)
    answer = getattr(layer, "get_seq_length", None)  # recurrent layers answer it from transformers 5.25 on
    if callable(answer) and int(answer()) != expected_length(layer, length):
        raise RuntimeError(
            f"a restored {type(layer).__name__} reports {int(answer())} tokens where it holds "
            f"{expected_length(layer, length)}: its cache layer counts tokens in a way prefixcache does not know"
        )


def check_length(cache: Any, length: int) -> None:
    """Raise RuntimeError unless ``cache`` reports ``length`` tokens where the modeling code asks
    (``get_seq_length()``, layer 0 by default): a restore that left a count behind would shift every position.
    Changes nothing."""
    got = int(cache.get_seq_length())
    if got != length:
        raise RuntimeError(
            f"a restored cache reports {got} tokens where it holds {length}: transformers' cache counts tokens in a "
            "way prefixcache does not know"
        )


def tensors_of(layer: LinearAttentionCacheLayerMixin) -> dict[tuple[int, str], torch.Tensor]:
    """The state tensors ``layer`` holds, by ``(state index, kind)`` (uninitialised ones left out). Changes
    nothing."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for j in range(layer.number_of_states):
        conv = layer.conv_states.get(j)
        if conv is not None and layer.is_conv_states_initialized[j]:
            out[(j, "conv")] = conv
        rec = layer.recurrent_states.get(j)
        if rec is not None and layer.is_recurrent_states_initialized[j]:
            out[(j, "recurrent")] = rec
    return out
