"""What a ``generate`` call asks for, checked before it may use the prefix cache.

Anything that cannot be served exactly from a cached prefix runs uncached (plain ``model.generate``): beam search
and other non greedy/sampling modes, ``use_cache=False``, ``inputs_embeds``, ``output_attentions`` /
``output_hidden_states`` (their prompt step would cover only the suffix), static/quantized cache implementations,
inputs beside the ids that the model's image family does not key (``engine.media``), right padding,
missing ``attention_mask`` with pad tokens in the ids, non-integer or empty ids. Each check returns
the reason, or None. Nothing here changes anything.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from prefixcache.core.checks import check_int

_ALLOWED_MODES = ("greedy_search", "sample")
_BATCH_SHAPED_KWARGS = ("position_ids", "token_type_ids", "cache_position", "decoder_input_ids")
# model inputs beside the ids (images, video, audio): their content is not in the block keys, and two different
# images behind the same placeholder ids would hit each other's KV
_MEDIA_PREFIXES = ("pixel_", "image_", "video_", "audio_", "input_features", "mm_")


def uncached_reason(
    input_ids: Any, attention_mask: Any, kwargs: dict[str, Any], media: Sequence[str] = (), media_reason: str = ""
) -> str | None:
    """Why a call with these arguments must run uncached, or None. ``media``: the media kwargs the model's image
    family takes into its block keys (``engine.media``); ``media_reason``: why it takes none."""
    if input_ids is None:
        return "no input_ids (inputs_embeds or no prompt)"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds given"
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        return "input_ids is not a 2-D tensor"
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        return f"input_ids has dtype {input_ids.dtype}, not integer"
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        return f"input_ids is empty (shape {tuple(input_ids.shape)})"
    if bool((input_ids < 0).any()):
        return "input_ids holds negative ids"
    for key in _BATCH_SHAPED_KWARGS:
        if key not in media and kwargs.get(key) is not None:
            return f"{key} given"
    for key, value in kwargs.items():
        if key in media:
            continue
        if value is not None and (key.startswith(_MEDIA_PREFIXES) or isinstance(value, torch.Tensor)):
            why = f" ({media_reason})" if media_reason else ""
            return (
                f"{key} given: inputs beside input_ids (images, audio, extra tensors) are not part of the cache's "
                f"block keys on this model{why}, so a prompt holding them is not served from cache"
            )
    if kwargs.get("custom_generate") is not None or kwargs.get("assistant_model") is not None:
        return "custom_generate / assistant_model given"
    if kwargs.get("streamer") is not None and input_ids.shape[0] > 1:
        return "streamer with a batch (the model decides)"
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            return "attention_mask is not a tensor shaped like input_ids"
        mask = attention_mask.to(torch.bool)
        # left padding only: each row is 0...0 1...1 with at least one 1
        if not bool(mask[:, -1].all()) or bool((mask[:, 1:].int() < mask[:, :-1].int()).any()):
            return "attention_mask is not left padding"
    return None


def merged_config(model: Any, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """The generation config ``generate`` will use (the model's, or ``kwargs["generation_config"]``, updated by
    the other ``kwargs``) and None, or None and the reason the call must run uncached."""
    base = kwargs.get("generation_config") or model.generation_config
    gc = copy.deepcopy(base)
    try:
        gc.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    except Exception as exc:  # invalid settings: let the model raise its own error
        return None, f"invalid generation settings ({exc})"
    if gc.use_cache is False:
        return None, "use_cache=False"
    mode = str(getattr(gc.get_generation_mode(), "value", gc.get_generation_mode()))
    if mode not in _ALLOWED_MODES:
        return None, f"generation mode {mode} (only greedy search and sampling use the prefix cache)"
    if (gc.num_return_sequences or 1) > 1 and not gc.do_sample:
        return None, "num_return_sequences > 1 without sampling (the model decides what that means)"
    if getattr(gc, "cache_implementation", None) is not None:
        return None, f"cache_implementation={gc.cache_implementation!r}"
    if getattr(gc, "output_attentions", False) or getattr(gc, "output_hidden_states", False):
        return None, "output_attentions / output_hidden_states (the prompt step would cover only the suffix)"
    if getattr(gc, "prompt_lookup_num_tokens", None) is not None:
        return None, "prompt lookup decoding"
    if (getattr(gc, "guidance_scale", None) or 1.0) != 1.0:
        return None, "classifier-free guidance"
    if getattr(gc, "prefill_chunk_size", None) is not None:
        return None, "prefill_chunk_size"
    return gc, None


def unmasked_pads_reason(input_ids: torch.Tensor, attention_mask: Any, gc: Any) -> str | None:
    """Why a call without ``attention_mask`` must run uncached: pad tokens in its ids (the model decides what they
    mean), or None."""
    pad_id = gc.pad_token_id
    if attention_mask is None and pad_id is not None and bool((input_ids == pad_id).any()):
        return "pad tokens in input_ids without attention_mask"
    return None


def row_names(namespace: Any, input_ids: Any) -> list[str]:
    """One namespace per batch row: a str applies to every row, a sequence must give one str per row."""
    rows = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else 1
    if isinstance(namespace, str):
        return [namespace] * rows
    if not isinstance(namespace, Sequence):
        raise TypeError(f"namespace must be a str or a sequence of str, got {type(namespace).__name__}")
    spaces = list(namespace)
    for i, ns in enumerate(spaces):
        if not isinstance(ns, str):
            raise TypeError(f"namespace[{i}] must be a str, got {type(ns).__name__}")
    if len(spaces) != rows:
        raise ValueError(f"namespace gives {len(spaces)} namespaces for {rows} batch rows; give one per row")
    return spaces


def row_hints(hints: Any, rows: int) -> list[list[int]] | None:
    """``snapshot_hints`` as one list of token positions per batch row (one flat sequence applies to every row);
    ValueError / TypeError naming what is wrong."""
    if hints is None:
        return None
    items = list(hints)
    if all(not isinstance(h, Sequence) for h in items):
        flat = [_position(h) for h in items]
        return [flat] * rows
    if len(items) != rows or not all(isinstance(h, Sequence) for h in items):
        raise ValueError(f"snapshot_hints gives {len(items)} entries for {rows} batch rows: give one list per row")
    return [[_position(p) for p in h] for h in items]


def _position(value: Any) -> int:
    return check_int(value, "snapshot_hints position", minimum=0)
