"""The processor of the image-text presets (``tiny-vlm``, ``small-vlm``): what a transformers processor does for
Qwen2.5-VL, built from parts made here (the byte tokenizer with image tokens, Qwen2-VL's image processor), and
``load_processor`` for a preset or a local model directory (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


class PresetProcessor:
    """``processor(text=[...], images=[...], return_tensors="pt")`` as Qwen2.5-VL's processor answers it: each
    ``<|image_pad|>`` of the text becomes one placeholder per merged patch of its image (in order), beside
    ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` and a left-padding ``attention_mask``."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = "<|image_pad|>"
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.merge = int(image_processor.merge_size)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(
        self, text: str | Sequence[str], images: Sequence[Any] | None = None, return_tensors: str = "pt"
    ) -> dict[str, torch.Tensor]:
        """Model inputs for ``text`` (one prompt or a batch) and its ``images`` (PIL images, in the order their
        ``<|image_pad|>`` tokens appear). ValueError when the counts differ."""
        texts = [text] if isinstance(text, str) else list(text)
        images = list(images or [])
        wanted = sum(t.count(self.image_token) for t in texts)
        if wanted != len(images):
            raise ValueError(f"the text holds {wanted} images' placeholders ({self.image_token}), {len(images)} given")
        out: dict[str, torch.Tensor] = {}
        counts: list[int] = []
        if images:
            got = self.image_processor(images=images, return_tensors="pt")
            out["pixel_values"], out["image_grid_thw"] = got["pixel_values"], got["image_grid_thw"]
            counts = [int(g.prod()) // (self.merge * self.merge) for g in got["image_grid_thw"]]
        rows, k = [], 0
        for t in texts:
            ids: list[int] = []
            for i, piece in enumerate(t.split(self.image_token)):
                if i:
                    ids += [self.image_token_id] * counts[k]
                    k += 1
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
            rows.append(ids)
        width = max(len(r) for r in rows)
        pad = int(self.tokenizer.pad_token_id)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, ids in enumerate(rows):
            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[r, width - len(ids) :] = 1
        out.update(input_ids=input_ids, attention_mask=mask, mm_token_type_ids=(input_ids == self.image_token_id).int())
        return out


def load_processor(name_or_path: str, tokenizer: Any) -> Any:
    """The processor of a preset (``PresetProcessor``; None for a text preset) or of a local model directory
    (transformers' ``AutoProcessor``; None when the directory has no image processor)."""
    from engine.models import PRESETS, image_processor

    if name_or_path in PRESETS:
        ip = image_processor(name_or_path)
        return None if ip is None else PresetProcessor(tokenizer, ip)
    path = Path(name_or_path)
    if not (path / "preprocessor_config.json").is_file() and not (path / "processor_config.json").is_file():
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, local_files_only=True)
