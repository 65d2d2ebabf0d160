"""What prefix caching needs to know of one image-text-to-text family: which inputs carry its images, how to cut
them into one image each, how many placeholder tokens an image has (without running the vision tower), how to run
the tower on one image, and (M-RoPE families) how its 3-D positions are computed.

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
class Family:
    """One family's image layout (see the module docstring). ``inputs``: the media kwargs it takes;
    ``optional``: kwargs it takes that are not per image (``mm_token_type_ids``); ``mrope``: 3-D positions."""

    model_types: tuple[str, ...]
    inputs: tuple[str, ...]
    optional: tuple[str, ...] = ()
    mrope: bool = False

    def split(self, model: Any, kwargs: Inputs) -> list[Inputs]:
        """The media kwargs of each image, in the order the model consumes them. ValueError when they disagree."""
        raise NotImplementedError

    def tokens(self, model: Any, item: Inputs) -> int:
        """Placeholder tokens of one image (its ``split`` entry)."""
        raise NotImplementedError

    def encode(self, model: Any, item: Inputs) -> torch.Tensor:
        """The vision tower's output for one image: (placeholder tokens, hidden) rows in placeholder order."""
        out = inner(model).get_image_features(**item, return_dict=True).pooler_output
        feats = torch.cat(list(out), dim=0) if isinstance(out, (list, tuple)) else out.reshape(-1, out.shape[-1])
        return feats


def inner(model: Any) -> Any:
    """The model under the LM head (``model.model``), which owns the vision tower."""
    return getattr(model, "model", model)


def _batch_rows(kwargs: Inputs, key: str) -> torch.Tensor:
    value = kwargs[key]
    if not isinstance(value, torch.Tensor) or value.ndim < 1:
        raise ValueError(f"{key} must be a tensor with one entry per image, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Llava(Family):
    """LLaVA-style: ``pixel_values`` (images, channels, height, width), a fixed-size vision tower, one run of
    placeholders per image."""

    def split(self, model: Any, kwargs: Inputs) -> list[Inputs]:
        pv = _batch_rows(kwargs, "pixel_values")
        if pv.ndim != 4:
            raise ValueError(f"pixel_values must be (images, channels, height, width), got shape {tuple(pv.shape)}")
        return [{"pixel_values": pv[k : k + 1]} for k in range(pv.shape[0])]

    def tokens(self, model: Any, item: Inputs) -> int:
        cfg = model.config
        patch = int(cfg.vision_config.patch_size)
        h, w = item["pixel_values"].shape[-2:]
        n = (int(h) // patch) * (int(w) // patch)
        return n + 1 if getattr(cfg, "vision_feature_select_strategy", "default") == "full" else n


@dataclass(frozen=True)
class QwenVL(Family):
    """Qwen2-VL / Qwen2.5-VL: ``pixel_values`` holds every image's patches in one (patches, dim) tensor and
    ``image_grid_thw`` each image's (t, h, w) in patches; an image has t*h*w / merge**2 placeholders; positions
    are 3-D (M-RoPE) and depend on every image's grid."""

    def split(self, model: Any, kwargs: Inputs) -> list[Inputs]:
        pv, grid = _batch_rows(kwargs, "pixel_values"), _batch_rows(kwargs, "image_grid_thw")
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

    def tokens(self, model: Any, item: Inputs) -> int:
        merge = int(model.config.vision_config.spatial_merge_size)
        n = int(item["image_grid_thw"].prod())
        if n % (merge * merge):
            raise ValueError(f"image_grid_thw {item['image_grid_thw'].tolist()} is not a multiple of the merge size")
        return n // (merge * merge)

    def positions(
        self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, kwargs: Inputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The 3-D position ids (3, batch, width) of the padded batch and each row's rope delta (batch, 1), as the
        model computes them for a prompt it sees whole."""
        grid = kwargs.get("image_grid_thw")
        if grid is None:  # text only: 1-D positions on all three axes, no delta
            pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
            return pos[None].expand(3, -1, -1), torch.zeros(input_ids.shape[0], 1, dtype=torch.long)
        types = kwargs.get("mm_token_type_ids")
        if types is None:
            types = (input_ids == model.config.image_token_id).to(torch.int)
        pos, deltas = inner(model).get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask
        )
        return pos, deltas


FAMILIES: tuple[Family, ...] = (
    Llava(("llava",), ("pixel_values",)),
    QwenVL(("qwen2_vl", "qwen2_5_vl"), ("pixel_values", "image_grid_thw"), ("mm_token_type_ids",), mrope=True),
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


def names() -> Sequence[str]:
    return [t for f in FAMILIES for t in f.model_types]


def mrope_family(model: Any) -> QwenVL | None:
    """The M-RoPE family of ``model`` (whose cached calls, text-only ones too, need their 3-D positions), or None."""
    fam, _ = family_for(model)
    return fam if isinstance(fam, QwenVL) else None
