"""KV memory per token and per block for a model, and the recurrent state of a hybrid one: from a preset, a
transformers config.json, or numbers.

Bytes per token = layers x (2 (K and V) x KV heads x head dim) x bytes per element, over the layers that keep KV:
the attention layers (a hybrid model's recurrent layers keep none). Multi-head latent attention (DeepSeek-V2/V3,
GLM-4-MoE-Lite, Kimi Linear: configs with ``kv_lora_rank``) caches one latent per token and layer instead:
``kv_lora_rank + qk_rope_head_dim`` elements. A hybrid model's recurrent layers keep a fixed-size state per
sequence, cached as snapshots: ``state_bytes`` is one snapshot (``prefixcache.sim.model_layers`` has the
formulas). Sliding-window or chunked layers (``window_layers`` of them, a window group: docs/sliding.md) keep their
K/V in ``window_share`` slots per block, so a cached token costs the full layers' bytes plus ``window_share`` of
theirs, as the engine sizes its pool. No transformers import: a config.json is read as plain JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefixcache.core.windows import DEFAULT_WINDOW_SHARE
from prefixcache.sim.model_layers import ConfigReader, Layers, preset_layers, read_layers

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8": 1,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
SSM_STATE_BYTES = 4  # the SSM / linear-attention state is float32 in transformers' torch paths, whatever the dtype
GB = 1e9  # answers are in decimal gigabytes


@dataclass(frozen=True)
class KVShape:
    """The cache shape of a model: what one token of KV costs in its ``layers`` attention layers, and (a hybrid
    model) what one recurrent-state snapshot of its ``recurrent_layers`` costs.

    ``latent_dim``: multi-head latent attention's elements per token and layer (replacing 2 x ``kv_heads`` x
    ``head_dim``); ``conv_elements`` / ``ssm_elements``: one snapshot's conv state (kept in ``dtype``) and SSM
    state (float32), over all recurrent layers; ``total_layers``: every layer of the model (None: ``layers``)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    latent_dim: int | None = None
    recurrent_layers: int = 0
    conv_elements: int = 0
    ssm_elements: int = 0
    total_layers: int | None = None
    window_layers: int = 0
    window_share: float = DEFAULT_WINDOW_SHARE

    def __post_init__(self) -> None:
        if isinstance(self.window_layers, bool) or not isinstance(self.window_layers, int):
            raise ValueError(f"{self.name}: window_layers must be an integer, got {self.window_layers!r}")
        if not 0 <= self.window_layers <= self.layers:
            raise ValueError(f"{self.name}: window_layers must be in [0, layers], got {self.window_layers}")
        if not 0 < self.window_share <= 1:
            raise ValueError(f"{self.name}: window_share must be in (0, 1], got {self.window_share!r}")
        for f in ("layers", "kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{self.name}: {f} must be a positive integer, got {v!r}")
        for f in ("latent_dim", "total_layers"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{self.name}: {f} must be a positive integer or None, got {v!r}")
        for f in ("recurrent_layers", "conv_elements", "ssm_elements"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{self.name}: {f} must be an integer >= 0, got {v!r}")
        if not self.recurrent_layers and (self.conv_elements or self.ssm_elements):
            raise ValueError(f"{self.name}: a recurrent state needs recurrent layers")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")

    @property
    def elements_per_layer(self) -> int:
        """KV elements of one token in one attention layer."""
        return self.latent_dim or 2 * self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one cached token takes across the attention layers (a window group's at ``window_share``)."""
        per_layer = self.elements_per_layer * DTYPE_BYTES[self.dtype]
        full = (self.layers - self.window_layers) * per_layer
        return full + round(self.window_share * self.window_layers * per_layer)

    @property
    def whole_bytes_per_token(self) -> int:
        """KV bytes of one token with every attention layer kept whole (``sliding_windows=False``)."""
        return self.layers * self.elements_per_layer * DTYPE_BYTES[self.dtype]

    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes of one block of ``block_size`` tokens."""
        return self.bytes_per_token * block_size

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent-state snapshot (one sequence's state in every recurrent layer); 0 for a model
        without recurrent layers."""
        return self.conv_elements * DTYPE_BYTES[self.dtype] + self.ssm_elements * SSM_STATE_BYTES

    @property
    def hybrid(self) -> bool:
        """Whether the model keeps recurrent state beside its attention KV."""
        return self.recurrent_layers > 0

    def gb(self, blocks: int, block_size: int, snapshots: int = 0) -> float:
        """Decimal GB that ``blocks`` KV blocks and ``snapshots`` recurrent-state snapshots occupy."""
        return (blocks * self.bytes_per_block(block_size) + snapshots * self.state_bytes) / GB

    def with_dtype(self, dtype: str) -> KVShape:
        """The same model sized in ``dtype`` (KV and conv state; the SSM state stays float32)."""
        return replace(self, dtype=normalize_dtype(dtype))

    def layers_text(self) -> str:
        """The KV shape in words: "12 layers x 12 KV heads x head dim 64", "3 attention layers (of 12) x 4 KV heads
        x head dim 64", "61 layers x latent 576 (MLA)"."""
        layers = f"{self.layers} layers"
        if self.total_layers not in (None, self.layers):
            layers = f"{self.layers} attention layers (of {self.total_layers})"
        if self.latent_dim:
            return f"{layers} x latent {self.latent_dim} (MLA)"
        text = f"{layers} x {self.kv_heads} KV heads x head dim {self.head_dim}"
        if self.window_layers:
            text += f" ({self.window_layers} windowed, at {self.window_share:g} slots per block)"
        return text

    def state_text(self) -> str:
        """One snapshot in words: "9 recurrent layers: 55,296 conv elements x float32 + 442,368 state elements x
        float32 = 1,990,656 bytes"."""
        return (
            f"{self.recurrent_layers} recurrent layers: {self.conv_elements:,} conv elements x {self.dtype} + "
            f"{self.ssm_elements:,} state elements x float32 = {self.state_bytes:,} bytes"
        )


def _hybrid_preset(name: str, layers: Layers, kv_heads: int, head_dim: int) -> KVShape:
    return KVShape(
        name,
        layers.attention,
        kv_heads,
        head_dim,
        "float32",
        recurrent_layers=layers.recurrent,
        conv_elements=layers.conv_elements,
        ssm_elements=layers.ssm_elements,
        total_layers=layers.total,
    )


# The built-in models of engine/models.py (PRESETS, built in float32 by default). Copied here because prefixcache
# must not import the engine (torch). "tiny" and "small" are Llama-style: tiny has hidden 64, 4 attention heads
# (head dim 16), 2 KV heads, 2 layers; small has hidden 768, 12 heads (head dim 64), 12 KV heads, 12 layers.
# "tiny-hybrid" and "small-hybrid" have Qwen3.5's pattern (every fourth layer full attention, the others gated
# delta nets, conv kernel 4): tiny-hybrid 4 layers, 2 KV heads of 16, linear 2 key / 4 value heads of 16;
# small-hybrid 12 layers, 4 KV heads of 64, linear 6 key / 12 value heads of 64. "tiny-vlm" and "small-vlm" are
# Qwen2.5-VL-shaped (image-text; their KV is tiny's and small's text model with 2 and 4 KV heads). Keep in sync with
# engine/models.py (tests/test_memory.py checks them against the real models: KV pool and state snapshot).
PRESETS: dict[str, KVShape] = {
    "tiny": KVShape("tiny", layers=2, kv_heads=2, head_dim=16, dtype="float32"),
    "small": KVShape("small", layers=12, kv_heads=12, head_dim=64, dtype="float32"),
    "tiny-hybrid": _hybrid_preset("tiny-hybrid", preset_layers(4, 2, 4, 16), kv_heads=2, head_dim=16),
    "small-hybrid": _hybrid_preset("small-hybrid", preset_layers(12, 6, 12, 64), kv_heads=4, head_dim=64),
    "tiny-vlm": KVShape("tiny-vlm", layers=2, kv_heads=2, head_dim=16, dtype="float32"),
    "small-vlm": KVShape("small-vlm", layers=12, kv_heads=4, head_dim=64, dtype="float32"),
    # Gemma-3-shaped, 5 of 6 layers sliding (windows of 32 and 512 tokens): a window group (docs/sliding.md)
    "tiny-swa": KVShape("tiny-swa", layers=6, kv_heads=2, head_dim=16, dtype="float32", window_layers=5),
    "small-swa": KVShape("small-swa", layers=12, kv_heads=4, head_dim=64, dtype="float32", window_layers=10),
}


def from_config(path: str | Path, dtype: str | None = None) -> KVShape:
    """Read a transformers ``config.json`` (no transformers import). ``dtype`` overrides the file's.

    Uses num_hidden_layers, num_key_value_heads (default num_attention_heads), head_dim (default
    hidden_size / num_attention_heads), kv_lora_rank + qk_rope_head_dim for latent attention, the layer types
    and the family's recurrent-layer keys (``prefixcache.sim.model_layers``), and torch_dtype/dtype (default
    bfloat16); a multimodal config's ``text_config`` is used when the top level has no layer count. Raises
    ValueError naming the file and key.
    """
    path = Path(path)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read model config: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except (ValueError, RecursionError) as exc:  # a 5000-digit integer; nesting too deep
        raise ValueError(f"{path}: not a model config ({type(exc).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k in ("torch_dtype", "dtype")}}
    c = ConfigReader(cfg, path)
    model = read_layers(c)
    heads = c.number("num_attention_heads")
    kv_heads = c.number("num_key_value_heads") or heads
    if kv_heads is None:
        raise c.fail("missing 'num_key_value_heads' and 'num_attention_heads'")
    head_dim = c.number("head_dim")
    if head_dim is None:
        hidden = c.need("hidden_size")
        if not heads:
            raise c.fail("missing 'head_dim' and 'num_attention_heads' to derive it")
        head_dim = hidden // heads
    latent = None
    if c.has("kv_lora_rank"):  # multi-head latent attention: the cache holds the latent and the rotary key part
        latent = c.need("kv_lora_rank") + c.need("qk_rope_head_dim", "the latent KV size")
    file_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return KVShape(
        path.parent.name or path.name,
        model.attention,
        kv_heads,
        head_dim,
        normalize_dtype(dtype or str(file_dtype)),
        latent_dim=latent,
        recurrent_layers=model.recurrent,
        conv_elements=model.conv_elements,
        ssm_elements=model.ssm_elements,
        total_layers=model.total,
        window_layers=_window_layers(cfg) if not model.recurrent else 0,
    )


def _window_layers(cfg: dict[str, Any]) -> int:
    """The layers of a config's window group as the engine makes it: the sliding-window or the chunked layers
    (``layer_types``), whichever are more; 0 without ``layer_types``."""
    types = cfg.get("layer_types")
    if not isinstance(types, list):
        return 0
    sliding = sum(t == "sliding_attention" for t in types) if cfg.get("sliding_window") else 0
    chunked = sum(t == "chunked_attention" for t in types) if cfg.get("attention_chunk_size") else 0
    return max(sliding, chunked)


def normalize_dtype(dtype: str) -> str:
    """ "torch.bfloat16" / "bf16" / "bfloat16" -> a key of DTYPE_BYTES. Raises ValueError when unknown."""
    d = str(dtype).strip().lower().removeprefix("torch.")
    if d not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return d


def resolve_model(
    model: str | None = None,
    *,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
) -> KVShape | None:
    """A preset name, a config.json path (or a folder holding one), or explicit numbers; None if nothing given."""
    numbers = (layers, kv_heads, head_dim)
    if model is not None:
        if any(n is not None for n in numbers):
            raise ValueError("give either a model (preset or config.json) or --layers/--kv-heads/--head-dim, not both")
        if model in PRESETS:
            p = PRESETS[model]
            return p if dtype is None else p.with_dtype(dtype)
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
        return from_config(path, dtype)
    if all(n is None for n in numbers):
        if dtype is not None:
            raise ValueError(f"dtype {dtype!r} needs a model: give a preset, a config.json or the numbers")
        return None
    if any(n is None for n in numbers):
        raise ValueError("--layers, --kv-heads and --head-dim must be given together")
    return KVShape("custom", int(layers), int(kv_heads), int(head_dim), normalize_dtype(dtype or "bfloat16"))  # type: ignore[arg-type]
