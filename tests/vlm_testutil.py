"""Tiny image-text-to-text models with seeded random weights, built from transformers configs (nothing
downloaded), and the inputs their processors give: pixel tensors made here, placeholder runs laid out as each
family's processor lays them out."""

from __future__ import annotations

import torch
import transformers as T

LLAVA_IMAGE = 299
QWEN_IMAGE, QWEN_START, QWEN_END = 390, 392, 393
PATCH_DIM = 3 * 2 * 14 * 14  # Qwen-VL: channels x temporal patch x patch x patch


def tiny_llava(seed: int = 0) -> T.LlavaForConditionalGeneration:
    vision = T.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    text = T.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = T.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=LLAVA_IMAGE, vision_feature_layer=-1, image_seq_length=4
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T.LlavaForConditionalGeneration(cfg).eval()


def tiny_qwen_vl(kind: str = "qwen2_5_vl", seed: int = 0, hidden: int = 64, layers: int = 2) -> T.PreTrainedModel:
    """A Qwen2-VL or Qwen2.5-VL model: 14-pixel patches, 2x2 merge, M-RoPE sections (2, 3, 3)."""
    text = dict(
        vocab_size=400,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )
    vision: dict = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    special = dict(
        image_token_id=QWEN_IMAGE, video_token_id=391, vision_start_token_id=QWEN_START, vision_end_token_id=QWEN_END
    )
    if kind == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=56)
        vision["fullatt_block_indexes"] = [1]
        cfg: T.PretrainedConfig = T.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
        cls: type = T.Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
        cfg = T.Qwen2VLConfig(text_config=text, vision_config=vision, **special)
        cls = T.Qwen2VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg).eval()


def qwen_image(h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One image of h x w patches (even): its ``pixel_values`` rows, its ``image_grid_thw`` row and its
    placeholder run as the processor writes it (vision start, h*w/4 image pads, vision end)."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(h * w, PATCH_DIM, generator=g),
        torch.tensor([[1, h, w]]),
        [
            QWEN_START,
            *[QWEN_IMAGE] * (h * w // 4),
            QWEN_END,
        ],
    )


def llava_image(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(seed))
