"""The built-in default model and tokenizer (no downloads), and loading a model from a local path.

Presets are models with seeded random weights and a byte-level tokenizer: 256 byte tokens plus special tokens
(``<|bos|>``, ``<|eos|>``, ``<|pad|>``, role markers) and a chat template. ``tiny`` and ``small`` are Llama-style;
``tiny-swa`` and ``small-swa`` are Gemma-3-shaped (five sliding-window layers, of 32 and 512 tokens, per
full-attention one);
``tiny-hybrid`` and ``small-hybrid`` have Qwen3.5's hybrid layer pattern (three gated-delta-net linear-attention
layers to one full-attention layer); ``tiny-vlm`` and ``small-vlm`` are Qwen2.5-VL-shaped image-text models (a
windowed ViT, 2x2 patch merge, M-RoPE) with the family's image processor configured here (``image_processor``)
and a chat template that takes image parts. Random weights give meaningless text but real compute: enough for
cache correctness and speed measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import (
        GenerationMixin,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

    class CausalLM(PreTrainedModel, GenerationMixin):
        """(Types only.) A model with ``generate``, as ``AutoModelForCausalLM`` loads one."""


SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# content as a string, or as parts: {"type": "text", "text": ...} and {"type": "image"} (one image's placeholder)
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class Preset:
    """Shape of a built-in model: Llama-style (``family`` "llama"), or Qwen3.5's hybrid pattern ("qwen3_5":
    ``linear`` = key heads, value heads and head dim of its linear-attention layers, every fourth layer full
    attention with ``head_dim``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int = 272  # 256 bytes + 7 specials, rounded up to a multiple of 16
    initializer_range: float = 0.02
    family: str = "llama"
    head_dim: int | None = None
    linear: tuple[int, int, int] | None = None
    vision: tuple[int, int, int] | None = None  # qwen2_5_vl: the ViT's depth, hidden size and heads
    max_image_tokens: int = 0  # qwen2_5_vl: the image processor's bound on one image's placeholder tokens
    sliding_window: int = 0  # gemma3: the window of its sliding layers (five per full-attention layer)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        initializer_range=0.1,
    ),
    "small": Preset(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=3072,
        max_position_embeddings=4096,
    ),
    "tiny-hybrid": Preset(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        initializer_range=0.1,
        family="qwen3_5",
        head_dim=16,
        linear=(2, 4, 16),
    ),
    "tiny-vlm": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=4096,
        initializer_range=0.1,
        family="qwen2_5_vl",
        vision=(2, 32, 2),
        max_image_tokens=256,
    ),
    "small-vlm": Preset(  # the small text model beside a 4-layer ViT of 256; an image is up to 1,280 tokens
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2560,
        max_position_embeddings=8192,
        family="qwen2_5_vl",
        vision=(4, 256, 4),
        max_image_tokens=1280,
    ),
    "tiny-swa": Preset(  # Gemma-3-shaped like small-swa, window 32
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        initializer_range=0.1,
        family="gemma3",
        head_dim=16,
        sliding_window=32,
    ),
    "small-swa": Preset(  # Gemma-3-shaped: 5 sliding-window layers (512 tokens) per full one
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2560,
        max_position_embeddings=16384,
        family="gemma3",
        head_dim=64,
        sliding_window=512,
    ),
    "small-hybrid": Preset(  # 99.2M parameters; one recurrent-state snapshot: 1.9 MiB (the KV of 324 tokens)
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2560,
        max_position_embeddings=4096,
        family="qwen3_5",
        head_dim=64,
        linear=(6, 12, 64),
    ),
}


def byte_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level ``PreTrainedTokenizerFast``: ids 0-255 are bytes, then the special tokens; a chat template.
    ``vision``: also the image tokens (``VISION_TOKENS``) and a chat template that takes image parts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS) + (list(VISION_TOKENS) if vision else []))
    bos = 256
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        padding_side="left",
        chat_template=VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the one ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_preset(
    name: str, *, dtype: torch.dtype = torch.float32, device: Any = "cpu", seed: int = 0
) -> tuple[CausalLM, PreTrainedTokenizerFast]:
    """A preset model with seeded random weights (the global RNG is left untouched) and its tokenizer."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    p = PRESETS[name]
    tokenizer = byte_tokenizer(vision=p.vision is not None)
    shape_only = ("family", "head_dim", "linear", "vision", "max_image_tokens", "sliding_window")
    common = {k: v for k, v in asdict(p).items() if k not in shape_only}
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    if p.family == "qwen3_5":
        assert p.linear is not None
        key_heads, value_heads, linear_dim = p.linear
        config: Any = Qwen3_5TextConfig(
            **common,
            **special,
            head_dim=p.head_dim or common["hidden_size"] // common["num_attention_heads"],
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=linear_dim,
            linear_value_head_dim=linear_dim,
            linear_conv_kernel_dim=4,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(p.num_hidden_layers)
            ],
        )
        factory: Any = Qwen3_5ForCausalLM
    elif p.family == "qwen2_5_vl":
        config, factory = _vlm_config(p, common, special, tokenizer)
    elif p.family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        head_dim = p.head_dim or common["hidden_size"] // common["num_attention_heads"]
        config = Gemma3TextConfig(
            **common,
            **special,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=p.sliding_window,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(p.num_hidden_layers)
            ],
        )
        factory = Gemma3ForCausalLM
    else:
        config = LlamaConfig(**common, **special)
        factory = LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(config)
    model = model.to(dtype=dtype, device=device).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model, tokenizer


def _vlm_config(p: Preset, common: dict[str, Any], special: dict[str, Any], tokenizer: Any) -> tuple[Any, Any]:
    """A Qwen2.5-VL config of preset ``p`` (M-RoPE sections in the ratio Qwen uses) and its model class."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    assert p.vision is not None
    depth, width, heads = p.vision
    half = p.hidden_size // p.num_attention_heads // 2
    t = half // 4
    text = {
        **common,
        **special,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2],
            "rope_theta": 1_000_000.0,
        },
    }
    vision = dict(
        depth=depth,
        hidden_size=width,
        num_heads=heads,
        intermediate_size=4 * width,
        out_hidden_size=p.hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[depth - 1],
        in_channels=3,
    )
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[3],
        tie_word_embeddings=False,
    )
    return config, Qwen2_5_VLForConditionalGeneration


def image_processor(name: str) -> Any:
    """The image processor of an image-text preset (Qwen2-VL's, configured here: 14-pixel patches, 2x2 merge, up
    to the preset's ``max_image_tokens`` per image), or None for a text preset."""
    p = PRESETS.get(name)
    if p is None or p.vision is None:
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unit = 28 * 28  # one placeholder token: a 2x2 merge of 14-pixel patches
    return Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=4 * unit, max_pixels=p.max_image_tokens * unit
    )


def load_model(
    name_or_path: str, *, dtype: Any = None, device: Any = None, seed: int = 0
) -> tuple[LlamaForCausalLM | CausalLM, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` for a preset name (see ``PRESETS``) or a local HF model directory.

    Never downloads: a path is loaded with ``local_files_only=True``. ``dtype`` defaults to float32,
    ``device`` to "cpu"; ``seed`` only matters for presets.
    """
    dtype = _dtype(dtype)
    device = device or "cpu"
    if name_or_path in PRESETS:
        return build_preset(name_or_path, dtype=dtype, device=device, seed=seed)
    path = Path(name_or_path)
    if not path.is_dir():
        raise ValueError(
            f"{name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a local model directory"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def context_length(config: Any) -> int | None:
    """The longest sequence a model config allows (prompt + generated), or None; an image-text model's is its
    text model's."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for cfg in (config, text):
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _dtype(dtype: Any) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]
