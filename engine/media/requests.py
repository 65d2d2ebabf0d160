"""A prompt with images as ``generate_batch`` and ``score`` take one: a mapping with ``input_ids`` (one unpadded row:
a list, a 1-D tensor, or a (1, length) tensor, as a processor gives it for one prompt) and the processor's media
tensors beside it (``pixel_values``, ``image_grid_thw``, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# what a processor gives beside the ids that is not the image: dropped (a mask must be all ones: no padding)
_NOT_MEDIA = ("input_ids", "attention_mask")


def media_prompt(prompt: Mapping[str, Any], what: str) -> tuple[list[int], dict[str, Any]]:
    """``prompt``'s token ids and its media kwargs; ValueError naming ``what`` for a padded or missing row."""
    if "input_ids" not in prompt:
        raise ValueError(f"{what} is a mapping without input_ids (give a processor's output for one prompt)")
    ids = prompt["input_ids"]
    if isinstance(ids, torch.Tensor):
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{what}['input_ids'] must be one row of integer ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    tokens = [int(t) for t in ids]
    if not tokens:
        raise ValueError(f"{what}['input_ids'] is empty: a prompt needs at least one token")
    mask = prompt.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(f"{what}['attention_mask'] marks padding: give each prompt unpadded")
    media = {k: v for k, v in prompt.items() if k not in _NOT_MEDIA and v is not None}
    for k, v in media.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{what}[{k!r}] must be a tensor, got {type(v).__name__}")
    return tokens, media
