"""KV memory per token and per block for a model: from a preset, a transformers config.json, or numbers.

Bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element, all layers. No
transformers import: a config.json is read as plain JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
GB = 1e9  # answers are in decimal gigabytes


@dataclass(frozen=True)
class KVShape:
    """The KV-cache shape of a model: what one token costs in every layer."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in ("layers", "kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{self.name}: {f} must be a positive integer, got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def bytes_per_block(self, block_size: int) -> int:
        """K+V bytes of one block of ``block_size`` tokens."""
        return self.bytes_per_token * block_size

    def gb(self, blocks: int, block_size: int) -> float:
        """Decimal GB that ``blocks`` blocks occupy."""
        return blocks * self.bytes_per_block(block_size) / GB


# The built-in models of engine/models.py (PRESETS "tiny" and "small": Llama-style, built in float32 by
# default). Copied here because prefixcache must not import the engine (torch): tiny has hidden 64, 4
# attention heads (head dim 16), 2 KV heads, 2 layers; small has hidden 768, 12 heads (head dim 64),
# 12 KV heads, 12 layers. Keep in sync with engine/models.py (tests/test_memory.py checks it).
PRESETS: dict[str, KVShape] = {
    "tiny": KVShape("tiny", layers=2, kv_heads=2, head_dim=16, dtype="float32"),
    "small": KVShape("small", layers=12, kv_heads=12, head_dim=64, dtype="float32"),
}


def from_config(path: str | Path, dtype: str | None = None) -> KVShape:
    """Read a transformers ``config.json`` (no transformers import). ``dtype`` overrides the file's.

    Uses num_hidden_layers, num_key_value_heads (default num_attention_heads), head_dim (default
    hidden_size / num_attention_heads) and torch_dtype/dtype (default bfloat16); a multimodal config's
    ``text_config`` is used when the top level has no layer count. Raises ValueError naming the file and key.
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

    def need(key: str) -> Any:
        if key not in cfg:
            raise ValueError(f"{path}: missing {key!r} (needed for the KV size)")
        return number(key)

    def number(key: str) -> int | None:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{path}: {key} must be a positive integer, got {v!r:.60}")
        return v

    layers = need("num_hidden_layers")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads") or heads
    if kv_heads is None:
        raise ValueError(f"{path}: missing 'num_key_value_heads' and 'num_attention_heads'")
    head_dim = number("head_dim")
    if head_dim is None:
        hidden = need("hidden_size")
        if not heads:
            raise ValueError(f"{path}: missing 'head_dim' and 'num_attention_heads' to derive it")
        head_dim = hidden // heads
    file_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return KVShape(
        path.parent.name or path.name,
        layers,
        kv_heads,
        head_dim,
        normalize_dtype(dtype or str(file_dtype)),
    )


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
            return p if dtype is None else KVShape(p.name, p.layers, p.kv_heads, p.head_dim, normalize_dtype(dtype))
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
