"""One ``generate`` call's images: which placeholder tokens of which row each item (an image, or a tile the model
encodes on its own) owns, its content id, the key material of every block its placeholders touch
(``prefixcache.core.key_material``), the encoder outputs a suffix needs, where a match may end, and (M-RoPE
families) the 3-D positions of the whole padded batch.

A row's placeholders are the image-token ids after its padding; items are consumed in order, row by row, as the
model's own ``masked_scatter`` consumes them, each taking as many placeholders as its inputs say
(``Family.tokens``) or, where they do not say, as its encoder output has rows (computed once, its count then kept
by content id). A count that does not add up is the caller's error (ValueError naming the row), raised before
anything is matched or pinned. Placeholders in a call without images are text, as the bare model takes them
(and keyed as text: they never hit an image's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash

from engine.media.encoder_cache import EncoderCache
from engine.media.families import Family, Features, Inputs, image_token_id, positions
from prefixcache.core.key_material import block_material


@dataclass(frozen=True)
class Item:
    """One item: its row, its placeholder positions in that row (after the padding, ascending), its content id
    and its own media inputs."""

    row: int
    positions: np.ndarray
    content_id: bytes
    inputs: Inputs


@dataclass(frozen=True)
class MediaCall:
    """The images of one call (module docstring). ``positions``/``deltas``: M-RoPE families' 3-D position ids of
    the padded batch (3, batch, width) and rope deltas (batch, 1); ``types``: the per-token image marks of a
    bidirectional family (batch, width); None otherwise. ``features``: encoder outputs this call computed;
    ``kwargs``: its media kwargs as they were given."""

    family: Family
    items: list[list[Item]]
    material: list[dict[int, bytes]]
    positions: torch.Tensor | None
    deltas: torch.Tensor | None
    pads: list[int]
    types: torch.Tensor | None = None
    features: dict[bytes, Features] = field(default_factory=dict)
    kwargs: dict[str, Any] = field(default_factory=dict)  # the call's media kwargs as given (the bare model's)

    def encoder_outputs(
        self, model: Any, cache: EncoderCache, row: int, start: int, stop: int
    ) -> dict[str, Any] | None:
        """``mm_encoder_outputs`` for tokens ``[start, stop)`` of ``row`` (after its padding): the features of the
        placeholders among them, each item's encoder output taken from this call, ``cache``, or computed (whole)
        into it."""
        parts: list[tuple[Features, int, int]] = []
        for item in self.items[row]:
            pos = item.positions
            lo, hi = int(np.searchsorted(pos, start)), int(np.searchsorted(pos, stop))
            if lo == hi:
                continue
            feats = self.features.get(item.content_id)
            if feats is None:
                feats = cache.get(item.content_id, partial(self.family.encode, model, item.inputs))
            if feats.main.shape[0] != len(pos):
                raise ValueError(
                    f"row {row}: the vision tower gave {feats.main.shape[0]} features for an image with {len(pos)} "
                    "placeholder tokens"
                )
            parts.append((feats, lo, hi))
        if not parts:
            return None
        return {"image": parts[0][0].outputs(parts)}

    def position_ids(self, row: int, start: int, stop: int) -> torch.Tensor | None:
        """M-RoPE position ids (3, 1, stop - start) of padded positions ``[start, stop)`` of ``row``, or None."""
        if self.positions is None:
            return None
        return self.positions[:, row : row + 1, start:stop]

    def type_ids(self, row: int, stop: int) -> dict[str, torch.Tensor]:
        """A bidirectional family's image marks of ``row`` up to padded position ``stop``, from its padding on (the
        cached part too: the model's mask takes the marks of every key position), as its kwarg."""
        if self.types is None or self.family.types is None:
            return {}
        return {self.family.types: self.types[row : row + 1, self.pads[row] : stop]}

    def safe_blocks(self, row: int, blocks: int, block_size: int) -> int:
        """The most of ``blocks`` leading blocks of ``row`` a match may serve: a bidirectional family's match
        never ends inside an image (its cached part was computed seeing the whole image)."""
        if not self.family.bidirectional:
            return blocks
        end = blocks * block_size
        for item in self.items[row]:
            first, last = int(item.positions[0]), int(item.positions[-1])
            if first < end <= last:
                end = first
        return end // block_size


def media_kwargs(family: Family, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The media kwargs of ``kwargs`` that ``family`` takes (the rest stay with ``generate``)."""
    return {k: v for k, v in kwargs.items() if k in family.inputs or k in family.optional}


def build(
    model: Any,
    family: Family,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    kwargs: dict[str, Any],
    block_size: int,
    cache: EncoderCache | None = None,
) -> MediaCall:
    """The ``MediaCall`` of a call with padded ``input_ids`` and left-padding ``mask``; ``kwargs``: its media
    kwargs (``media_kwargs``); ``cache``: where items' encoder outputs and placeholder counts are kept (items
    whose count their inputs do not give are encoded here, once). ValueError naming what does not add up."""
    given = {k: v for k, v in kwargs.items() if v is not None}
    inputs = {k: given[k] for k in family.inputs if k in given}
    batch, width = input_ids.shape
    pads = (width - mask.to(torch.long).sum(dim=1)).tolist()
    image_id = image_token_id(model)
    rows_pos = [np.flatnonzero((input_ids[r, pads[r] :] == image_id).cpu().numpy()) for r in range(batch)]
    items: list[list[Item]] = [[] for _ in range(batch)]
    features: dict[bytes, Features] = {}
    if inputs:
        missing = [k for k in family.inputs[:1] if k not in inputs]  # the pixels; the rest per family
        if missing:
            raise ValueError(f"images given without {', '.join(missing)} (the processor gives them together)")
        per_item = family.split(model, inputs)
        cids = [_content_id(model, it) for it in per_item]
        counts = [_count(model, family, it, cid, cache, features) for it, cid in zip(per_item, cids)]
        k = 0
        for r, pos in enumerate(rows_pos):
            have = 0
            while have < len(pos) and k < len(per_item):
                n = counts[k]
                if have + n > len(pos):
                    break
                items[r].append(Item(r, pos[have : have + n], cids[k], per_item[k]))
                have, k = have + n, k + 1
            if have != len(pos):
                raise ValueError(
                    f"row {r} holds {len(pos)} image placeholder tokens, but the images given for it fill {have} "
                    f"(images' placeholder counts: {counts})"
                )
        if k != len(per_item):
            raise ValueError(
                f"{len(per_item)} images given, but the rows' placeholder tokens hold only {k} of them "
                f"(images' placeholder counts: {counts})"
            )
    material = [
        block_material([(int(i.positions[0]), int(i.positions[-1]) + 1, i.content_id) for i in row], block_size)
        for row in items
    ]
    pos_ids = deltas = types = None
    if family.mrope:
        extra = {k: given[k] for k in family.optional if k in given}
        pos_ids, deltas = positions(model, input_ids, mask, {**inputs, **extra})
    if family.types is not None:
        types = given.get(family.types)
        if types is None or tuple(types.shape) != tuple(input_ids.shape):
            types = (input_ids == image_id).to(torch.long)
    return MediaCall(family, items, material, pos_ids, deltas, pads, types, features, given)


def _count(
    model: Any, family: Family, item: Inputs, cid: bytes, cache: EncoderCache | None, features: dict[bytes, Features]
) -> int:
    """Placeholder tokens of one item: from its inputs, else its kept count, else its encoder output's rows."""
    n = family.tokens(model, item)
    if n is not None:
        return n
    if cache is not None and (kept := cache.count(cid)) is not None:
        return kept
    encode = partial(family.encode, model, item)
    feats = encode() if cache is None else cache.get(cid, encode)
    features[cid] = feats
    return int(feats.main.shape[0])


def prepare(
    model: Any,
    family: Family | None,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    block_size: int,
    cache: EncoderCache | None = None,
) -> tuple[MediaCall | None, dict[str, Any]]:
    """A call's ``MediaCall`` (None: no images) and the kwargs left for ``generate``: its media kwargs go into the
    ``MediaCall``. ValueError for images that do not fit the placeholders."""
    if family is None:
        return None, kwargs
    mine = media_kwargs(family, kwargs)
    if not any(v is not None for k, v in mine.items() if k in family.inputs):  # text (M-RoPE: contiguous.generate)
        return None, {k: v for k, v in kwargs.items() if k not in mine}
    rest = {k: v for k, v in kwargs.items() if k not in mine}
    full = mask if mask is not None else torch.ones_like(input_ids)
    return build(model, family, input_ids, full, mine, block_size, cache), rest


def ends_in_image(call: MediaCall, width: int) -> bool:
    """Whether some row's last prompt token (padded width ``width``) is an image placeholder: its last step, which
    ``generate`` runs, would need the image."""
    return any(row and int(row[-1].positions[-1]) == width - 1 - call.pads[r] for r, row in enumerate(call.items))


def _content_id(model: Any, item: Inputs) -> bytes:
    """128 bits naming one item's content as this model type sees it (its tensors' dtypes, shapes and bytes)."""
    h = xxhash.xxh3_128(b"prefixcache-image\x00" + str(model.config.model_type).encode() + b"\x00")
    for key in sorted(item):
        t = item[key].detach().to("cpu").contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\x00".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()
