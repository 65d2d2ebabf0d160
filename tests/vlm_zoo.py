"""A zoo of tiny image-text-to-text models, one per family: seeded random weights built from transformers config
classes (nothing downloaded), and inputs laid out as each family's processor lays them out (placeholder runs with
their start/end/break/tile tokens, pixel tensors of the image processor's shapes and dtypes, the extra kwargs).

Text ids in tests are small ints (10-100); every vocab is >= 300, special and placeholder ids lie in (200, vocab),
pad id is 0 and rows are left-padded. ``Image(seed, size)``: ``size`` 0 is the family's default image; other sizes
are family-specific variants (a patch grid, a tile layout, an original resolution: the ``*_GRIDS``, ``*_SIZES``,
``*_TILES``, ``*_LAYOUTS`` tables below; an unknown size is a KeyError) where the family's count of tokens depends on the
image; fixed-size families (llava, gemma3, paligemma) ignore it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import transformers as T
from transformers import PreTrainedModel


@dataclass(frozen=True)
class Image:
    """One image in a prompt."""

    seed: int
    size: int = 0  # 0: the family's default; otherwise a family-specific size variant


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _seeded(cls: type, cfg: T.PretrainedConfig, seed: int) -> PreTrainedModel:
    """``cls(cfg)`` with weights from ``seed``; matrices the init leaves at zero (Gemma3's projection, say, which would
    keep the image from the text model) get small random values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2 and not p.any():
                    p.normal_(0.0, 0.05)
        return model


def _llama_text(vocab: int = 300, hidden: int = 64, **kw) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def _clip_vision(image_size: int = 28, patch: int = 14, **kw) -> dict:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
        **kw,
    )


class Zoo:
    """One family: its tiny model and its processor's layout of inputs.

    ``run(img)``: the token ids the processor writes for one image. ``pixels(img)``: that image's entries of the
    media kwargs (concatenated along dim 0 over a batch's images, in order) unless ``collate`` builds the kwargs for
    the whole batch from the images of each row. ``type_ids``: the name of a per-token modality kwarg (``token_type_ids``
    or ``mm_token_type_ids``), 1 where the id is in ``type_id_set``. ``row``: how the processor rewrites a row's ids
    around its expanded runs (PaliGemma's BOS and newline)."""

    def __init__(
        self,
        name: str,
        model: PreTrainedModel,
        image_id: int,
        run: Callable[[Image], list[int]],
        pixels: Callable[[Image], dict[str, torch.Tensor]] | None = None,
        collate: Callable[[list[list[Image]], torch.Tensor], dict] | None = None,
        type_ids: str | None = None,
        type_id_set: Sequence[int] = (),
        row: Callable[[list[list[int] | Image]], list[int]] | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.image_id = image_id
        self._run = run
        self._pixels = pixels
        self._collate = collate
        self._type_ids = type_ids
        self._type_id_set = list(type_id_set) or [image_id]
        self._row = row

    def run(self, img: Image) -> list[int]:
        return self._run(img)

    def inputs(self, rows: Sequence[Sequence[int | Image]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Left-padded input_ids, attention_mask and the media kwargs for a batch of rows (text token ids and
        Images in order), as the processor gives them for that batch."""
        flat: list[list[int]] = []
        images: list[list[Image]] = []
        for row in rows:
            parts: list[list[int] | Image] = []
            for part in row:
                if isinstance(part, Image):
                    parts.append(part)
                elif parts and isinstance(parts[-1], list):
                    parts[-1].append(part)
                else:
                    parts.append([part])
            if self._row is not None:
                flat.append(self._row(parts))
            else:
                flat.append([t for p in parts for t in (self.run(p) if isinstance(p, Image) else p)])
            images.append([p for p in parts if isinstance(p, Image)])
        width = max(len(r) for r in flat)
        ids = torch.zeros((len(flat), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(flat):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        kw: dict = {}
        if any(images):
            if self._collate is not None:
                kw.update(self._collate(images, ids))
            elif self._pixels is not None:
                per = [self._pixels(img) for r in images for img in r]
                kw.update({k: torch.cat([p[k] for p in per]) for k in per[0]})
        if self._type_ids is not None:
            kw[self._type_ids] = torch.isin(ids, torch.tensor(self._type_id_set)).long()
        return ids, mask, kw


# --- llava: LlavaProcessor writes (image_size / patch)**2 image tokens (the CLS dropped by the "default" strategy);
# CLIPImageProcessor gives one (3, 28, 28) crop per image
LLAVA_IMAGE = 299


def _llava(seed: int) -> Zoo:
    cfg = T.LlavaConfig(
        vision_config=T.CLIPVisionConfig(**_clip_vision(projection_dim=32)),
        text_config=T.LlamaConfig(**_llama_text()),
        image_token_id=LLAVA_IMAGE,
        vision_feature_layer=-1,
        image_seq_length=4,
    )
    model = _seeded(T.LlavaForConditionalGeneration, cfg, seed)
    return Zoo(
        "llava",
        model,
        LLAVA_IMAGE,
        run=lambda img: [LLAVA_IMAGE] * 4,
        pixels=lambda img: {"pixel_values": _randn(img.seed, 1, 3, 28, 28)},
    )


# --- qwen2_vl / qwen2_5_vl / qwen3_vl / qwen3_5 / glm4v: the chat template's <|vision_start|><|image_pad|>
# <|vision_end|>, the pad expanded to t*h*w / merge**2 tokens; pixel_values: (sum t*h*w, C * temporal * patch**2)
# flattened patches, image_grid_thw (n, 3), mm_token_type_ids 1 on the image pads
QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 390, 391, 392, 393
QWEN_GRIDS = {0: (4, 6), 1: (2, 4), 2: (4, 4), 3: (6, 8)}  # size -> (h, w) in patches, even (2x2 merge)


def _grid_media(patch_dim: int, merge: int = 2) -> tuple[Callable, Callable]:
    def run_for(start: int, image: int, end: int) -> Callable[[Image], list[int]]:
        def run(img: Image) -> list[int]:
            h, w = QWEN_GRIDS[img.size]
            return [start, *[image] * (h * w // merge**2), end]

        return run

    def pixels(img: Image) -> dict[str, torch.Tensor]:
        h, w = QWEN_GRIDS[img.size]
        return {"pixel_values": _randn(img.seed, h * w, patch_dim), "image_grid_thw": torch.tensor([[1, h, w]])}

    return run_for, pixels


def _qwen_vl(name: str, seed: int) -> Zoo:
    """Qwen2-VL or Qwen2.5-VL: 14-pixel patches, 2x2 merge, M-RoPE sections (2, 3, 3)."""
    hidden = 64
    text = _llama_text(400, hidden)
    text.pop("head_dim")
    text["max_position_embeddings"] = 4096
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision: dict = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    special = dict(
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_VIDEO,
        vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END,
    )
    if name == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=56)
        vision["fullatt_block_indexes"] = [1]
        cfg: T.PretrainedConfig = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        cls: type = T.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
        cfg = T.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
        cls = T.Qwen2VLForConditionalGeneration
    run_for, pixels = _grid_media(3 * 2 * 14 * 14)
    return Zoo(
        name,
        _seeded(cls, cfg, seed),
        QWEN_IMAGE,
        run=run_for(QWEN_START, QWEN_IMAGE, QWEN_END),
        pixels=pixels,
        type_ids="mm_token_type_ids",
    )


# --- gemma3: Gemma3Processor replaces <start_of_image> with "\n\n<boi>" + mm_tokens_per_image soft tokens +
# "<eoi>\n\n" ("\n\n" is one token); pixel_values (n, 3, S, S) without pan-and-scan; token_type_ids (renamed from
# mm_token_type_ids) 1 on the soft tokens: the model attends bidirectionally within each image's run
G3_NL2, G3_BOI, G3_EOI, G3_IMAGE = 250, 251, 252, 262


def _gemma3(seed: int) -> Zoo:
    vision = T.SiglipVisionConfig(**_clip_vision(image_size=28, patch=7))  # 4x4 patches, pooled to 2x2
    text = T.Gemma3TextConfig(
        **_llama_text(300, 64, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    )
    cfg = T.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        boi_token_index=G3_BOI,
        eoi_token_index=G3_EOI,
        image_token_index=G3_IMAGE,
    )
    return Zoo(
        "gemma3",
        _seeded(T.Gemma3ForConditionalGeneration, cfg, seed),
        G3_IMAGE,
        run=lambda img: [G3_NL2, G3_BOI, *[G3_IMAGE] * 4, G3_EOI, G3_NL2],
        pixels=lambda img: {"pixel_values": _randn(img.seed, 1, 3, 28, 28)},
        type_ids="token_type_ids",
    )


# --- mistral3: PixtralProcessor writes, per row of (patch * merge)-pixel cells, [IMG] * cols + [IMG_BREAK], the
# last break replaced by [IMG_END]; PixtralImageProcessor pads pixel_values to the batch's largest height and width
# (zeros at the bottom and right) and gives image_sizes (n, 2), the unpadded sizes
M3_IMAGE, M3_BREAK, M3_END = 210, 211, 212
M3_SIZES = {0: (56, 56), 1: (28, 56), 2: (56, 84), 3: (84, 28)}  # size -> (height, width) pixels, multiples of 28


def _mistral3(seed: int) -> Zoo:
    vision = T.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=84, patch_size=14
    )
    text = T.MistralConfig(**_llama_text(300, 64))
    cfg = T.Mistral3Config(vision_config=vision, text_config=text, image_token_index=M3_IMAGE, spatial_merge_size=2)

    def run(img: Image) -> list[int]:
        h, w = M3_SIZES[img.size]
        ids = ([M3_IMAGE] * (w // 28) + [M3_BREAK]) * (h // 28)
        return [*ids[:-1], M3_END]

    def collate(images: list[list[Image]], ids: torch.Tensor) -> dict:
        flat = [img for r in images for img in r]
        sizes = [M3_SIZES[img.size] for img in flat]
        mh, mw = max(h for h, _ in sizes), max(w for _, w in sizes)
        pv = torch.zeros(len(flat), 3, mh, mw)
        for i, (img, (h, w)) in enumerate(zip(flat, sizes)):
            pv[i, :, :h, :w] = _randn(img.seed, 3, h, w)
        return {"pixel_values": pv, "image_sizes": torch.tensor(sizes)}

    return Zoo("mistral3", _seeded(T.Mistral3ForConditionalGeneration, cfg, seed), M3_IMAGE, run=run, collate=collate)


# --- llava_next: LlavaNextProcessor writes image_token * (anyres features: base patch + unpadded grid + one newline
# per grid row, less the CLS); LlavaNextImageProcessor gives pixel_values (n, max patches, 3, S, S), the base
# resized image first, then the crops of the best pinpoint, zero-padded to the batch's most patches, and image_sizes
# (n, 2), the original sizes: the token count depends on the original size
ANYRES_SIZES = {0: (28, 28), 1: (28, 56), 2: (56, 56), 3: (40, 30)}  # size -> original (height, width)
ANYRES_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56]]
NEXT_IMAGE = 230


def _anyres_processor(cls: type, **attrs) -> object:
    """A stand-in ``self`` for the processor's own token-count methods (no tokenizer needed)."""
    ns = type("P", (), {})()
    ns.image_processor = type("IP", (), {"image_grid_pinpoints": ANYRES_PINPOINTS})()
    for k, v in attrs.items():
        setattr(ns, k, v)
    ns._get_unpadded_features = cls._get_unpadded_features.__get__(ns)
    ns._get_number_of_features = cls._get_number_of_features.__get__(ns)
    return ns


def _anyres_pixels(images: list[Image], patches: list[int]) -> torch.Tensor:
    pv = torch.zeros(len(images), max(patches), 3, 28, 28)
    for i, (img, n) in enumerate(zip(images, patches)):
        pv[i, :n] = _randn(img.seed, n, 3, 28, 28)
    return pv


def _llava_next(seed: int) -> Zoo:
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = T.LlavaNextConfig(
        vision_config=T.CLIPVisionConfig(**_clip_vision(projection_dim=32)),
        text_config=T.LlamaConfig(**_llama_text()),
        image_token_index=NEXT_IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=ANYRES_PINPOINTS,
        image_seq_length=4,
    )
    proc = _anyres_processor(T.LlavaNextProcessor, patch_size=14, num_additional_image_tokens=1)

    def run(img: Image) -> list[int]:
        return [NEXT_IMAGE] * (proc._get_number_of_features(*ANYRES_SIZES[img.size], 28, 28) - 1)

    def collate(images: list[list[Image]], ids: torch.Tensor) -> dict:
        flat = [img for r in images for img in r]
        sizes = [ANYRES_SIZES[img.size] for img in flat]
        patches = [image_size_to_num_patches(s, ANYRES_PINPOINTS, 28) for s in sizes]
        return {"pixel_values": _anyres_pixels(flat, patches), "image_sizes": torch.tensor(sizes)}

    return Zoo("llava_next", _seeded(T.LlavaNextForConditionalGeneration, cfg, seed), NEXT_IMAGE, run, collate=collate)


# --- llava_onevision: as llava_next with SigLIP (no CLS, anyres_max_9) for a row's only image; in a row with several
# images each is one unpatched (padded-to-square) crop written as num_image_tokens + 1 (newline) tokens, so an
# image's run depends on its row; batch_num_images (images per row) tells the model which rows were patched
OV_IMAGE = 231


def _llava_onevision(seed: int) -> Zoo:
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = T.LlavaOnevisionConfig(
        vision_config=T.SiglipVisionConfig(**_clip_vision()),
        text_config=T.Qwen2Config(**_llama_text()),
        image_token_index=OV_IMAGE,
        video_token_index=232,
        vision_feature_layer=-1,
        image_grid_pinpoints=ANYRES_PINPOINTS,
    )
    proc = _anyres_processor(T.LlavaOnevisionProcessor, num_image_tokens=4, vision_aspect_ratio="anyres_max_9")

    def run(img: Image, alone: bool = True) -> list[int]:
        if not alone:
            return [OV_IMAGE] * 5
        return [OV_IMAGE] * proc._get_number_of_features(*ANYRES_SIZES[img.size], 28, 28)

    def row(parts: list) -> list[int]:
        alone = sum(isinstance(p, Image) for p in parts) == 1
        return [t for p in parts for t in (run(p, alone) if isinstance(p, Image) else p)]

    def collate(images: list[list[Image]], ids: torch.Tensor) -> dict:
        images = [r for r in images if r]
        flat = [img for r in images for img in r]
        sizes = [ANYRES_SIZES[img.size] for img in flat]
        alone = [len(r) == 1 for r in images for _ in r]
        patches = [image_size_to_num_patches(s, ANYRES_PINPOINTS, 28) if a else 1 for s, a in zip(sizes, alone)]
        return {
            "pixel_values": _anyres_pixels(flat, patches),
            "image_sizes": torch.tensor(sizes),
            "batch_num_images": torch.tensor([len(r) for r in images]),
        }

    model = _seeded(T.LlavaOnevisionForConditionalGeneration, cfg, seed)
    return Zoo("llava_onevision", model, OV_IMAGE, run, collate=collate, row=row)


# --- idefics3 / smolvlm: the processor writes <fake_token_around_image><global-img> + image_seq_len <image> +
# <fake_token_around_image> for an unsplit image; a split one first has, per tile row, per tile
# <fake_token_around_image><row_i_col_j> + image_seq_len <image>, then "\n", then "\n" and the global run. The image
# processor gives pixel_values (batch, most images in a row, 3, S, S) (an image's tiles, then its global view; rows
# with fewer zero-filled) and pixel_attention_mask (batch, most images, S, S) int64, 1 on real pixels
ID3_FAKE, ID3_IMAGE, ID3_GLOBAL, ID3_NL = 240, 241, 242, 243
ID3_ROWCOL = 250  # <row_i_col_j>: ID3_ROWCOL + 6 * (i - 1) + (j - 1)
ID3_TILES = {0: (0, 0), 1: (1, 2), 2: (2, 2)}  # size -> (rows, cols) of tiles; (0, 0): not split


def _idefics3(name: str, seed: int) -> Zoo:
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    vision["patch_size"] = 7  # 4x4 patches, pixel-shuffled by 2 into 4 tokens
    text = T.LlamaConfig(**_llama_text())
    if name == "smolvlm":
        cfg: T.PretrainedConfig = T.SmolVLMConfig(
            vision_config=vision, text_config=text, scale_factor=2, image_token_id=ID3_IMAGE
        )
        cls: type = T.SmolVLMForConditionalGeneration
    else:
        cfg = T.Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, image_token_id=ID3_IMAGE)
        cls = T.Idefics3ForConditionalGeneration
    seq = [ID3_IMAGE] * 4

    def run(img: Image) -> list[int]:
        rows, cols = ID3_TILES[img.size]
        ids: list[int] = []
        for i in range(rows):
            for j in range(cols):
                ids += [ID3_FAKE, ID3_ROWCOL + 6 * i + j, *seq]
            ids.append(ID3_NL)
        if rows:
            ids.append(ID3_NL)
        return [*ids, ID3_FAKE, ID3_GLOBAL, *seq, ID3_FAKE]

    def collate(images: list[list[Image]], ids: torch.Tensor) -> dict:
        views = [[] for _ in images]
        for r, row in zip(views, images):
            for img in row:
                rows, cols = ID3_TILES[img.size]
                r += list(_randn(img.seed, rows * cols + 1, 3, 28, 28))
        most = max(len(r) for r in views)
        pv = torch.zeros(len(images), most, 3, 28, 28)
        mask = torch.zeros(len(images), most, 28, 28, dtype=torch.long)
        for i, r in enumerate(views):
            for j, v in enumerate(r):
                pv[i, j] = v
                mask[i, j] = 1
        return {"pixel_values": pv, "pixel_attention_mask": mask}

    return Zoo(name, _seeded(cls, cfg, seed), ID3_IMAGE, run, collate=collate)


# --- qwen3_vl / qwen3_5 (Qwen3VLProcessor) and glm4v (Glm4vProcessor, <|begin_of_image|><|image|><|end_of_image|>):
# the Qwen layout above with 16-pixel (Qwen3) or 14-pixel (GLM) patches. Qwen3-VL adds the vision tower's
# deepstack features (from the layers in deepstack_visual_indexes) to the first text layers' hidden states at the
# image tokens; Qwen3.5 is a hybrid: Gated DeltaNet linear-attention layers with full-attention ones
GLM_IMAGE, GLM_START, GLM_END = 380, 381, 382


def _qwen3(name: str, seed: int) -> Zoo:
    hidden = 64
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, out_hidden_size=hidden)
    vision.update(spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    text = _llama_text(400, hidden)
    text["max_position_embeddings"] = 4096
    special = dict(
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_VIDEO,
        vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END,
    )
    if name == "qwen3_vl":
        vision["deepstack_visual_indexes"] = [0]
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        cfg: T.PretrainedConfig = T.Qwen3VLConfig(text_config=text, vision_config=vision, **special)
        cls: type = T.Qwen3VLForConditionalGeneration
    else:
        text.update(head_dim=32, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4)
        text.update(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
        text["rope_parameters"] = {
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.5,
        }
        cfg = T.Qwen3_5Config(text_config=text, vision_config=vision, **special)
        cls = T.Qwen3_5ForConditionalGeneration
    run_for, pixels = _grid_media(3 * 2 * 16 * 16)
    return Zoo(
        name,
        _seeded(cls, cfg, seed),
        QWEN_IMAGE,
        run=run_for(QWEN_START, QWEN_IMAGE, QWEN_END),
        pixels=pixels,
        type_ids="mm_token_type_ids",
    )


def _glm4v(seed: int) -> Zoo:
    hidden = 64
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, image_size=56)
    vision.update(spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden)
    text = _llama_text(400, hidden)
    text.pop("head_dim")
    text["max_position_embeddings"] = 4096
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}
    cfg = T.Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=GLM_IMAGE,
        video_token_id=383,
        image_start_token_id=GLM_START,
        image_end_token_id=GLM_END,
        video_start_token_id=384,
        video_end_token_id=385,
    )
    run_for, pixels = _grid_media(3 * 2 * 14 * 14)
    return Zoo(
        "glm4v",
        _seeded(T.Glm4vForConditionalGeneration, cfg, seed),
        GLM_IMAGE,
        run=run_for(GLM_START, GLM_IMAGE, GLM_END),
        pixels=pixels,
        type_ids="mm_token_type_ids",
    )


# --- llama4: Llama4Processor writes <|image_start|>, then for a tiled image per tile row the tiles' <|patch|> runs
# split by <|tile_x_separator|> and closed by <|tile_y_separator|>, then <|image|> and the global view's <|patch|>
# run, then <|image_end|>; Llama4ImageProcessor gives pixel_values (all chunks, 3, S, S): each image's tiles, then its
# global view (only when it has more than one tile)
L4_START, L4_END, L4_IMAGE, L4_PATCH, L4_TX, L4_TY = 260, 261, 262, 263, 264, 265
L4_TILES = {0: (1, 1), 1: (1, 2), 2: (2, 2), 3: (2, 1)}  # size -> aspect ratio (tile rows, tile cols)


def _llama4(seed: int) -> Zoo:
    vision = T.Llama4VisionConfig(
        hidden_size=32,
        intermediate_size=128,  # also the pixel-shuffled width the adapter takes: hidden / ratio**2
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=7,  # 4x4 patches, pixel-shuffled by 0.5 into 4 tokens per chunk
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
        pixel_shuffle_ratio=0.5,
    )
    text = T.Llama4TextConfig(
        **_llama_text(300, 64, intermediate_size_mlp=128, num_local_experts=2, attention_chunk_size=64),
    )
    cfg = T.Llama4Config(vision_config=vision, text_config=text, boi_token_index=L4_START, eoi_token_index=L4_END)
    cfg.image_token_index = L4_PATCH
    chunk = [L4_PATCH] * 4

    def run(img: Image) -> list[int]:
        rh, rw = L4_TILES[img.size]
        ids = [L4_START]
        if rh * rw > 1:
            for _ in range(rh):
                for x in range(rw):
                    ids += chunk + ([L4_TX] if x < rw - 1 else [])
                ids.append(L4_TY)
        return [*ids, L4_IMAGE, *chunk, L4_END]

    def pixels(img: Image) -> dict[str, torch.Tensor]:
        rh, rw = L4_TILES[img.size]
        return {"pixel_values": _randn(img.seed, rh * rw + (rh * rw > 1), 3, 28, 28)}

    return Zoo("llama4", _seeded(T.Llama4ForConditionalGeneration, cfg, seed), L4_PATCH, run, pixels)


# --- internvl / aya_vision: GotOcr2ImageProcessor gives pixel_values (all patches, 3, S, S), an image's tiles then,
# when it has more than one, its thumbnail. InternVLProcessor writes <img> + image_seq_length * patches <IMG_CONTEXT>
# + </img>; AyaVisionProcessor writes <|START_OF_IMG|>, per tile but the last TILE_k (one id here; the real tokenizer
# splits "TILE_1" into text tokens) + the tile's <|IMG_PATCH|> run, then TILE_GLOBAL + the thumbnail's, <|END_OF_IMG|>
IVL_START, IVL_END, IVL_IMAGE = 270, 271, 272
AYA_START, AYA_END, AYA_PATCH, AYA_GLOBAL, AYA_TILE = 275, 276, 277, 278, 280  # TILE_k: AYA_TILE + k
GOT_PATCHES = {0: 1, 1: 3, 2: 5}  # size -> patches (tiles + thumbnail)


def _internvl(seed: int) -> Zoo:
    vision = T.InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7
    )  # 4x4 patches, pixel-shuffled by 0.5 into 4 tokens per patch
    cfg = T.InternVLConfig(
        vision_config=vision,
        text_config=T.Qwen2Config(**_llama_text()),
        image_token_id=IVL_IMAGE,
        image_seq_length=4,
        downsample_ratio=0.5,
    )
    return Zoo(
        "internvl",
        _seeded(T.InternVLForConditionalGeneration, cfg, seed),
        IVL_IMAGE,
        run=lambda img: [IVL_START, *[IVL_IMAGE] * (4 * GOT_PATCHES[img.size]), IVL_END],
        pixels=lambda img: {"pixel_values": _randn(img.seed, GOT_PATCHES[img.size], 3, 28, 28)},
    )


def _aya_vision(seed: int) -> Zoo:
    text = T.Cohere2Config(
        **_llama_text(300, 64, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    )
    cfg = T.AyaVisionConfig(
        vision_config=T.SiglipVisionConfig(**_clip_vision(image_size=28, patch=7)),  # 4x4 patches, 2x2 after downsample
        text_config=text,
        downsample_factor=2,
        image_token_index=AYA_PATCH,
    )
    tile = [AYA_PATCH] * 4

    def run(img: Image) -> list[int]:
        ids = [AYA_START]
        for k in range(1, GOT_PATCHES[img.size]):
            ids += [AYA_TILE + k, *tile]
        return [*ids, AYA_GLOBAL, *tile, AYA_END]

    return Zoo(
        "aya_vision",
        _seeded(T.AyaVisionForConditionalGeneration, cfg, seed),
        AYA_PATCH,
        run=run,
        pixels=lambda img: {"pixel_values": _randn(img.seed, GOT_PATCHES[img.size], 3, 28, 28)},
    )


# --- paligemma: PaliGemmaProcessor expands <image> to image_seq_length image tokens, inserts <bos> after the row's
# last image and appends "\n" (a row without images is left alone here); token_type_ids come from the tokenizer, all
# 0 without a suffix, and the model makes every token with type 0 a prefix attended bidirectionally: the whole prompt,
# text included, is one bidirectional block. pixel_values (n, 3, S, S)
PG_BOS, PG_NL, PG_IMAGE = 201, 203, 290


def _paligemma(seed: int) -> Zoo:
    text = T.GemmaConfig(**_llama_text(300, 64))
    text.bos_token_id = PG_BOS
    cfg = T.PaliGemmaConfig(
        vision_config=T.SiglipVisionConfig(**_clip_vision()),  # 2x2 patches: 4 image tokens
        text_config=text,
        image_token_index=PG_IMAGE,
        projection_dim=64,
    )

    def run(img: Image) -> list[int]:
        return [PG_IMAGE] * 4

    def row(parts: list) -> list[int]:
        last = max((i for i, p in enumerate(parts) if isinstance(p, Image)), default=None)
        ids: list[int] = []
        for i, p in enumerate(parts):
            if isinstance(p, Image):
                ids += [*run(p), PG_BOS] if i == last else run(p)
            else:
                ids += p
        return ids if last is None else [*ids, PG_NL]

    return Zoo(
        "paligemma",
        _seeded(T.PaliGemmaForConditionalGeneration, cfg, seed),
        PG_IMAGE,
        run=run,
        pixels=lambda img: {"pixel_values": _randn(img.seed, 1, 3, 28, 28)},
        type_ids="token_type_ids",
        type_id_set=(-1,),  # none: all zeros
        row=row,
    )


# --- lfm2_vl: Lfm2VlProcessor (use_image_special_tokens) writes <|image_start|>, for a tiled image per tile
# <|img_row_i_col_j|> + the tile's <image> run, then <|img_thumbnail|> + the thumbnail's run, <|image_end|>; an untiled
# image is <|image_start|> + its run + <|image_end|>; a run is ceil(h / 8 / 2) * ceil(w / 8 / 2) tokens. The image
# processor gives SigLIP2 NaFlex patches: pixel_values (views, max_num_patches, 3 * 8 * 8) zero-padded, an image's
# tiles then its thumbnail, pixel_attention_mask (views, max_num_patches) int32, spatial_shapes (views, 2) in patches
LFM_START, LFM_END, LFM_THUMB, LFM_IMAGE, LFM_ROWCOL = 300, 301, 302, 303, 310  # <|img_row_i_col_j|>: 310 + 10i + j
LFM_LAYOUTS = {0: (0, 0, 32, 48), 1: (1, 2, 32, 64), 2: (2, 2, 48, 48)}  # size -> tile rows, cols, image/thumb px
LFM_PATCHES = 36  # max_num_patches: max(max_image_tokens * 2**2, (tile_size / 8) ** 2) with max_image_tokens 9


def _lfm2_vl(seed: int) -> Zoo:
    vision = T.Siglip2VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8, num_patches=16
    )
    text = T.Lfm2Config(
        **_llama_text(400, 64, layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False),
    )
    cfg = T.Lfm2VlConfig(
        vision_config=vision, text_config=text, image_token_id=LFM_IMAGE, projector_hidden_size=64, downsample_factor=2
    )

    def views(img: Image) -> list[tuple[int, int]]:  # (height, width) in patches of each view
        rows, cols, h, w = LFM_LAYOUTS[img.size]
        return [(4, 4)] * (rows * cols) + [(h // 8, w // 8)]

    def run(img: Image) -> list[int]:
        rows, cols, _, _ = LFM_LAYOUTS[img.size]
        vs = views(img)
        ids = [LFM_START]
        for k in range(rows * cols):
            ids += [LFM_ROWCOL + 10 * (k // cols + 1) + k % cols + 1, *[LFM_IMAGE] * (vs[k][0] * vs[k][1] // 4)]
        if rows * cols:
            ids.append(LFM_THUMB)
        return [*ids, *[LFM_IMAGE] * (math.ceil(vs[-1][0] / 2) * math.ceil(vs[-1][1] / 2)), LFM_END]

    def pixels(img: Image) -> dict[str, torch.Tensor]:
        vs = views(img)
        pv = torch.zeros(len(vs), LFM_PATCHES, 3 * 8 * 8)
        mask = torch.zeros(len(vs), LFM_PATCHES, dtype=torch.int32)
        for i, (h, w) in enumerate(vs):
            pv[i, : h * w] = _randn(img.seed * 100 + i, h * w, 3 * 8 * 8)
            mask[i, : h * w] = 1
        return {"pixel_values": pv, "pixel_attention_mask": mask, "spatial_shapes": torch.tensor(vs)}

    return Zoo("lfm2_vl", _seeded(T.Lfm2VlForConditionalGeneration, cfg, seed), LFM_IMAGE, run, pixels)


# --- gemma4: Gemma4Processor writes <boi> + the image's soft tokens + <eoi>; Gemma4ImageProcessor resizes keeping
# the aspect ratio to the most (pooling 3 x patch)-multiple size within max_soft_tokens * 9 patches, so the count of
# soft tokens depends on the aspect ratio, and gives pixel_values (n, max_patches, 3 * patch**2) zero-padded and
# image_position_ids (n, max_patches, 2) (x, y; -1 on padding); mm_token_type_ids 1 on the soft tokens, attended
# bidirectionally within each image (use_bidirectional_attention="vision")
G4_BOI, G4_EOI, G4_IMAGE = 255, 256, 257
G4_SIZES = {0: (32, 32), 1: (32, 64), 2: (64, 32)}  # size -> original (height, width)
G4_PATCH, G4_MAX_PATCHES = 4, 70 * 9  # max_soft_tokens 70 (the smallest supported), pooling 3


def _gemma4_size(img: Image) -> tuple[int, int]:
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    return get_aspect_ratio_preserving_size(*G4_SIZES[img.size], G4_PATCH, G4_MAX_PATCHES, 3)


def _gemma4(seed: int) -> Zoo:
    vision = T.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=G4_PATCH,
        pooling_kernel_size=3,
        position_embedding_size=64,
    )
    text = T.Gemma4TextConfig(
        **_llama_text(300, 64, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        global_head_dim=16,
        vocab_size_per_layer_input=300,
        hidden_size_per_layer_input=8,
        use_bidirectional_attention="vision",
    )
    cfg = T.Gemma4Config(
        vision_config=vision,
        text_config=text,
        boi_token_id=G4_BOI,
        eoi_token_id=G4_EOI,
        image_token_id=G4_IMAGE,
        video_token_id=258,
        boa_token_id=259,
        eoa_token_index=260,
    )

    def run(img: Image) -> list[int]:
        h, w = _gemma4_size(img)
        return [G4_BOI, *[G4_IMAGE] * (h * w // (G4_PATCH * 3) ** 2), G4_EOI]

    def pixels(img: Image) -> dict[str, torch.Tensor]:
        h, w = (x // G4_PATCH for x in _gemma4_size(img))
        pv = torch.zeros(1, G4_MAX_PATCHES, 3 * G4_PATCH**2)
        pv[0, : h * w] = _randn(img.seed, h * w, 3 * G4_PATCH**2)
        pos = torch.full((1, G4_MAX_PATCHES, 2), -1, dtype=torch.long)
        xs, ys = torch.meshgrid(torch.arange(w), torch.arange(h), indexing="xy")
        pos[0, : h * w] = torch.stack([xs, ys], dim=-1).reshape(-1, 2)
        return {"pixel_values": pv, "image_position_ids": pos}

    model = _seeded(T.Gemma4ForConditionalGeneration, cfg, seed)
    return Zoo("gemma4", model, G4_IMAGE, run, pixels, type_ids="mm_token_type_ids")


_BUILDERS: dict[str, Callable[[int], Zoo]] = {
    "llava": _llava,
    "qwen2_vl": lambda seed: _qwen_vl("qwen2_vl", seed),
    "qwen2_5_vl": lambda seed: _qwen_vl("qwen2_5_vl", seed),
    "gemma3": _gemma3,
    "mistral3": _mistral3,
    "llava_onevision": _llava_onevision,
    "idefics3": lambda seed: _idefics3("idefics3", seed),
    "smolvlm": lambda seed: _idefics3("smolvlm", seed),
    "qwen3_vl": lambda seed: _qwen3("qwen3_vl", seed),
    "qwen3_5": lambda seed: _qwen3("qwen3_5", seed),
    "llama4": _llama4,
    "internvl": _internvl,
    "llava_next": _llava_next,
    "paligemma": _paligemma,
    "aya_vision": _aya_vision,
    "lfm2_vl": _lfm2_vl,
    "glm4v": _glm4v,
    "gemma4": _gemma4,
}


def build(name: str, seed: int = 0) -> Zoo:
    """The tiny model of family ``name`` (a model_type) with weights from ``seed``, and its inputs' layout."""
    return _BUILDERS[name](seed)


# every family tried builds, and its bare generate (one image, two images, a left-padded batch of rows with 1 and 2
# images, a text-only row next to an image row) runs and reads the pixels: none failed
NAMES: tuple[str, ...] = tuple(_BUILDERS)
FAILED: dict[str, str] = {}
