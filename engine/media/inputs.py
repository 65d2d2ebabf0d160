"""One ``generate`` call's images: which placeholder tokens of which row each image owns, its content id, the key
material of every block its placeholders touch (``prefixcache.core.key_material``), the encoder outputs a
suffix needs, and (M-RoPE families) the 3-D positions of the whole padded batch.

A row's placeholders are the ``image_token_id`` tokens after its padding; images are consumed in order, row by
row, as the model's own ``masked_scatter`` consumes them, each taking as many placeholders as its inputs say
(``Family.tokens``). A count that does not add up is the caller's error (ValueError naming the row), raised
before anything is matched or pinned. Placeholders in a call without images are text, as the bare model takes
them (and keyed as text: they never hit an image's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash
from transformers.modeling_outputs import BaseModelOutputWithPooling

from engine.media.encoder_cache import EncoderCache
from engine.media.families import Family, Inputs, QwenVL
from prefixcache.core.key_material import block_material


@dataclass(frozen=True)
class Item:
    """One image: its row, its placeholder positions in that row (after the padding, ascending), its content id
    and its own media inputs."""

    row: int
    positions: np.ndarray
    content_id: bytes
    inputs: Inputs


@dataclass(frozen=True)
class MediaCall:
    """The images of one call (module docstring). ``positions``/``deltas``: M-RoPE families' 3-D position ids of
    the padded batch (3, batch, width) and rope deltas (batch, 1); None otherwise."""

    family: Family
    items: list[list[Item]]
    material: list[dict[int, bytes]]
    positions: torch.Tensor | None
    deltas: torch.Tensor | None
    pads: list[int]

    def encoder_outputs(
        self, model: Any, cache: EncoderCache, row: int, start: int, stop: int
    ) -> dict[str, BaseModelOutputWithPooling] | None:
        """``mm_encoder_outputs`` for tokens ``[start, stop)`` of ``row`` (after its padding): the features of the
        placeholders among them, each image's tower output taken from ``cache`` or computed (whole) into it."""
        parts = []
        for item in self.items[row]:
            pos = item.positions
            lo, hi = np.searchsorted(pos, start), np.searchsorted(pos, stop)
            if lo == hi:
                continue
            feats = cache.get(item.content_id, partial(self.family.encode, model, item.inputs))
            if feats.shape[0] != len(pos):
                raise ValueError(
                    f"row {row}: the vision tower gave {feats.shape[0]} features for an image with {len(pos)} "
                    "placeholder tokens"
                )
            parts.append(feats[lo:hi])
        if not parts:
            return None
        features: Any = [torch.cat(parts)]  # the models take a list of per-image rows here
        return {"image": BaseModelOutputWithPooling(pooler_output=features)}

    def position_ids(self, row: int, start: int, stop: int) -> torch.Tensor | None:
        """M-RoPE position ids (3, 1, stop - start) of padded positions ``[start, stop)`` of ``row``, or None."""
        if self.positions is None:
            return None
        return self.positions[:, row : row + 1, start:stop]


def media_kwargs(family: Family, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The media kwargs of ``kwargs`` that ``family`` takes (the rest stay with ``generate``)."""
    return {k: v for k, v in kwargs.items() if k in family.inputs or k in family.optional}


def build(
    model: Any, family: Family, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any], block_size: int
) -> MediaCall:
    """The ``MediaCall`` of a call with padded ``input_ids`` and left-padding ``mask``; ``kwargs``: its media
    kwargs (``media_kwargs``). ValueError naming what does not add up. Changes nothing."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    inputs = {k: given[k] for k in family.inputs if k in given}
    batch, width = input_ids.shape
    pads = (width - mask.to(torch.long).sum(dim=1)).tolist()
    image_id = int(model.config.image_token_id)
    rows_pos = [np.flatnonzero((input_ids[r, pads[r] :] == image_id).cpu().numpy()) for r in range(batch)]
    items: list[list[Item]] = [[] for _ in range(batch)]
    if inputs:
        missing = [k for k in family.inputs if k not in inputs]
        if missing:
            raise ValueError(f"images given without {', '.join(missing)} (the processor gives them together)")
        per_image = family.split(model, inputs)
        counts = [family.tokens(model, it) for it in per_image]
        k = 0
        for r, pos in enumerate(rows_pos):
            have = 0
            while have < len(pos) and k < len(per_image):
                n = counts[k]
                if have + n > len(pos):
                    break
                cid = _content_id(model, per_image[k])
                items[r].append(Item(r, pos[have : have + n], cid, per_image[k]))
                have, k = have + n, k + 1
            if have != len(pos):
                raise ValueError(
                    f"row {r} holds {len(pos)} image placeholder tokens, but the images given for it fill {have} "
                    f"(images' placeholder counts: {counts})"
                )
        if k != len(per_image):
            raise ValueError(
                f"{len(per_image)} images given, but the rows' placeholder tokens hold only {k} of them "
                f"(images' placeholder counts: {counts})"
            )
    material = [
        block_material([(int(i.positions[0]), int(i.positions[-1]) + 1, i.content_id) for i in row], block_size)
        for row in items
    ]
    positions = deltas = None
    if isinstance(family, QwenVL):
        extra = {k: given[k] for k in family.optional if k in given}
        positions, deltas = family.positions(model, input_ids, mask, {**inputs, **extra})
    return MediaCall(family, items, material, positions, deltas, pads)


def _content_id(model: Any, item: Inputs) -> bytes:
    """128 bits naming one image's content as this model type sees it."""
    h = xxhash.xxh3_128(b"prefixcache-image\x00" + str(model.config.model_type).encode() + b"\x00")
    for key in sorted(item):
        t = item[key].detach().to("cpu").contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\x00".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def prepare(
    model: Any,
    family: Family | None,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    block_size: int,
) -> tuple[MediaCall | None, dict[str, Any]]:
    """A call's ``MediaCall`` (None: no images) and the kwargs left for ``generate``: its media kwargs go into the
    ``MediaCall``. ValueError for images that do not fit the placeholders."""
    if family is None:
        return None, kwargs
    mine = media_kwargs(family, kwargs)
    if not any(v is not None for v in mine.values()):  # text (an M-RoPE model's positions: contiguous.generate)
        return None, {k: v for k, v in kwargs.items() if k not in mine}
    rest = {k: v for k, v in kwargs.items() if k not in mine}
    full = mask if mask is not None else torch.ones_like(input_ids)
    return build(model, family, input_ids, full, mine, block_size), rest


def ends_in_image(call: MediaCall, width: int) -> bool:
    """Whether some row's last prompt token (padded width ``width``) is an image placeholder: its last step, which
    ``generate`` runs, would need the image."""
    return any(row and int(row[-1].positions[-1]) == width - 1 - call.pads[r] for r, row in enumerate(call.items))
