"""What prefix caching needs to know of one image-text-to-text family: which inputs carry its images, how to cut
them into items (an image, or a tile where the model encodes tiles on their own), how many placeholder tokens an
item has, how the model encodes one, whether an image's placeholders attend to each other both ways, and (M-RoPE
families) how its 3-D positions are computed.

Only families listed here are cached with images; the rest run uncached with the reason (``family_for``). Every
family here hands the model its images' encoder outputs through ``mm_encoder_outputs`` (transformers >= 5.24),
so a suffix gets exactly the features of the placeholders it holds, the rest of the image being in the cached KV.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Features:
    """One item's encoder output as rows in placeholder order: ``main`` (tokens, hidden), ``extra`` (Qwen3-VL's
    deepstack features, one (tokens, hidden) per layer), and how the model's own ``get_image_features`` shapes
    them (a list of per-image tensors or one tensor of ``ndim`` dimensions; its output class)."""

    main: torch.Tensor
    extra: tuple[torch.Tensor, ...]
    listed: bool
    ndim: int
    cls: type

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.main, *self.extra))

    def outputs(self, parts: Sequence[tuple[Features, int, int]]) -> Any:
        """``mm_encoder_outputs["image"]`` holding rows ``[lo, hi)`` of each of ``parts``' features, shaped as the
        model's own encoder output is."""
        main = torch.cat([f.main[lo:hi] for f, lo, hi in parts])
        pooled: Any = [main] if self.listed else (main[None] if self.ndim == 3 else main)
        kw: dict[str, Any] = {"pooler_output": pooled}
        if self.extra:
            kw["deepstack_features"] = [  # per layer, a list of per-image rows (the model cats them)
                [torch.cat([f.extra[i][lo:hi] for f, lo, hi in parts])] for i in range(len(self.extra))
            ]
        return self.cls(**kw)


@dataclass(frozen=True)
class Family:
    """One family's image layout (see the module docstring).

    ``inputs``: the media kwargs that carry its items; ``optional``: call-level kwargs it also takes out of
    ``generate`` (``mm_token_type_ids``, ``token_type_ids``: rebuilt per suffix); ``layout``: "images" (every
    input has one entry per item along dim 0), "grid" (Qwen-style: patches of every image in one tensor,
    ``image_grid_thw`` per image), "rows" (Idefics3-style: (rows, items per row, ...), zero images padding) or
    "groups" (LLaVA-OneVision: a row's images are encoded differently when it holds several, so an item is the
    images of one row, ``batch_num_images`` long);
    ``fixed``: the config attribute holding every item's placeholder count (None: counted from the encoder's
    output, kept by content id); ``bidirectional``: an image's placeholders attend to each other both ways, so a
    match never ends inside one; ``types``: the per-token kwarg that marks image tokens for that attention."""

    model_types: tuple[str, ...]
    inputs: tuple[str, ...]
    optional: tuple[str, ...] = ()
    layout: str = "images"
    mrope: bool = False
    fixed: str | None = None
    bidirectional: bool = False
    types: str | None = None

    def split(self, model: Any, kwargs: Inputs) -> list[Inputs]:
        """The media kwargs of each item, in the order the model consumes them. ValueError when they disagree."""
        for key, value in kwargs.items():
            if not isinstance(value, torch.Tensor) or value.ndim < 1:
                raise ValueError(f"{key} must be a tensor with an entry per image, got {type(value).__name__}")
        if self.layout == "grid":
            return _split_grid(kwargs)
        if self.layout == "rows":
            return _split_rows(kwargs)
        if self.layout == "groups":
            return _split_groups(kwargs)
        sizes = {k: v.shape[0] for k, v in kwargs.items()}
        n = sizes[self.inputs[0]]
        if any(s != n for s in sizes.values()):
            raise ValueError(f"the image inputs disagree on the number of images: {sizes}")
        return [{k: v[i : i + 1] for k, v in kwargs.items()} for i in range(n)]

    def tokens(self, model: Any, item: Inputs) -> int | None:
        """Placeholder tokens of one item without running the encoder, where its inputs say (else None)."""
        if self.layout == "grid":
            merge = int(model.config.vision_config.spatial_merge_size)
            n = int(item["image_grid_thw"].prod())
            if n % (merge * merge):
                raise ValueError(f"image_grid_thw {item['image_grid_thw'].tolist()} is not a multiple of the merge")
            return n // (merge * merge)
        if self.fixed is not None:
            return int(getattr(model.config, self.fixed))
        return None

    def encode(self, model: Any, item: Inputs) -> Features:
        """The encoder's output for one item (``Features``)."""
        out = inner(model).get_image_features(**item, return_dict=True)
        pooled = out.pooler_output
        listed = isinstance(pooled, (list, tuple))
        main = torch.cat(list(pooled)) if listed else pooled.reshape(-1, pooled.shape[-1])
        ndim = 2 if listed else pooled.ndim
        layers = getattr(out, "deepstack_features", None) or ()
        extra = tuple(torch.cat(list(f)) if isinstance(f, (list, tuple)) else f for f in layers)
        return Features(main, extra, listed, ndim, type(out))


def _split_grid(kwargs: Inputs) -> list[Inputs]:
    pv, grid = kwargs["pixel_values"], kwargs["image_grid_thw"]
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"image_grid_thw must be (images, 3), got shape {tuple(grid.shape)}")
    sizes = grid.prod(dim=1).tolist()
    if sum(sizes) != pv.shape[0]:
        raise ValueError(
            f"image_grid_thw gives {sum(sizes)} patches for {len(sizes)} images, but pixel_values holds "
            f"{pv.shape[0]} patches"
        )
    out, at = [], 0
    for k, n in enumerate(sizes):
        out.append({"pixel_values": pv[at : at + n], "image_grid_thw": grid[k : k + 1]})
        at += n
    return out


def _split_groups(kwargs: Inputs) -> list[Inputs]:
    """LLaVA-OneVision: one item per row's images (``batch_num_images`` per row; absent: every image alone)."""
    per_row = kwargs.get("batch_num_images")
    images = {k: v for k, v in kwargs.items() if k != "batch_num_images"}
    n = next(iter(images.values())).shape[0]
    sizes = [1] * n if per_row is None else [int(c) for c in per_row.tolist() if int(c) > 0]
    if sum(sizes) != n:
        raise ValueError(f"batch_num_images gives {sum(sizes)} images, the image inputs hold {n}")
    out, at = [], 0
    for size in sizes:
        item = {k: v[at : at + size] for k, v in images.items()}
        if per_row is not None:
            item["batch_num_images"] = torch.tensor([size], dtype=per_row.dtype)
        out.append(item)
        at += size
    return out


def _split_rows(kwargs: Inputs) -> list[Inputs]:
    """Idefics3 / SmolVLM: (rows, items, channels, h, w) with all-zero padding items, dropped as the model does."""
    pv = kwargs["pixel_values"]
    if pv.ndim != 5:
        raise ValueError(f"pixel_values must be (rows, images, channels, height, width), got {tuple(pv.shape)}")
    mask = kwargs.get("pixel_attention_mask")
    out = []
    for r in range(pv.shape[0]):
        for i in range(pv.shape[1]):
            if bool((pv[r, i] == 0).all()):
                continue
            item = {"pixel_values": pv[r, i][None, None]}
            if mask is not None:
                item["pixel_attention_mask"] = mask[r, i][None, None]
            out.append(item)
    return out


def positions(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: Inputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """An M-RoPE model's 3-D position ids (3, batch, width) of the padded batch and each row's rope delta
    (batch, 1), as the model computes them for a prompt it sees whole."""
    grid = kwargs.get("image_grid_thw")
    if grid is None:  # text only: 1-D positions on all three axes, no delta
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        return pos[None].expand(3, -1, -1), torch.zeros(input_ids.shape[0], 1, dtype=torch.long)
    types = kwargs.get("mm_token_type_ids")
    if types is None:
        types = (input_ids == image_token_id(model)).to(torch.int)
    got = inner(model).get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask)
    return got[0], got[1]


def image_token_id(model: Any) -> int:
    cfg = model.config
    value = getattr(cfg, "image_token_id", None)
    if value is None:
        value = getattr(cfg, "image_token_index", None)
    if value is None:
        raise ValueError(f"{type(model).__name__}'s config names no image token")
    return int(value)


GRID = ("pixel_values", "image_grid_thw")
FAMILIES: tuple[Family, ...] = (
    Family(("llava",), ("pixel_values",)),
    Family(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"), GRID, ("mm_token_type_ids",), "grid", mrope=True),
    Family(("qwen3_5", "qwen3_5_moe"), GRID, ("mm_token_type_ids",), "grid", mrope=True),  # hybrid: linear attention
    Family(("glm4v",), GRID, ("mm_token_type_ids",), "grid", mrope=True),
    Family(
        ("gemma3",),
        ("pixel_values",),
        ("token_type_ids",),
        fixed="mm_tokens_per_image",
        bidirectional=True,
        types="token_type_ids",
    ),
    Family(
        ("gemma4",),
        ("pixel_values", "image_position_ids"),
        ("mm_token_type_ids",),
        bidirectional=True,
        types="mm_token_type_ids",
    ),
    Family(("mistral3",), ("pixel_values", "image_sizes")),
    Family(("llava_onevision",), ("pixel_values", "image_sizes", "batch_num_images"), layout="groups"),
    Family(("llava_next",), ("pixel_values", "image_sizes")),
    Family(("internvl",), ("pixel_values",)),  # an item is a tile: the model encodes every tile on its own
    Family(("aya_vision",), ("pixel_values",)),
    Family(("llama4",), ("pixel_values",)),
    Family(("lfm2_vl",), ("pixel_values", "pixel_attention_mask", "spatial_shapes")),
    Family(("idefics3", "smolvlm"), ("pixel_values", "pixel_attention_mask"), layout="rows"),
)


def family_for(model: Any) -> tuple[Family | None, str | None]:
    """The family of ``model`` with what its forward must accept, or None and why its images cannot be cached."""
    model_type = getattr(model.config, "model_type", None)
    fam = next((f for f in FAMILIES if model_type in f.model_types), None)
    if fam is None:
        return None, f"images on {model_type} are not cached yet (cached families: {', '.join(names())})"
    params = inspect.signature(inner(model).forward).parameters
    if "mm_encoder_outputs" not in params or not hasattr(inner(model), "get_image_features"):
        return None, f"{model_type}'s forward takes no mm_encoder_outputs on this transformers"
    if fam.mrope and not hasattr(inner(model), "get_rope_index"):
        return None, f"{model_type} has no get_rope_index on this transformers"
    return fam, None


def inner(model: Any) -> Any:
    """The model under the LM head (``model.model``), which owns the vision tower."""
    return getattr(model, "model", model)


def names() -> Sequence[str]:
    return [t for f in FAMILIES for t in f.model_types]
