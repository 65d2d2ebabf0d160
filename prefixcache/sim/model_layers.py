"""What each layer of a model keeps per sequence, read from a transformers ``config.json`` (plain JSON, no
transformers import): attention KV (per token), a recurrent state (fixed size: SSM / linear-attention / short-conv
layers of hybrid models), both (Falcon-H1's parallel layers) or nothing (Nemotron-H's MLP layers).

The recurrent state of one sequence is what a snapshot holds (``prefixcache.core.snapshots``): per recurrent
layer a conv state (the last inputs of its causal conv, in the model's dtype) and, for SSM and linear-attention
layers, a recurrent state, float32 in transformers' torch paths even for bf16 models. Per layer, in elements:

====================================================  ===========================================  ==============
family (``model_type``)                               conv state                                    SSM state
====================================================  ===========================================  ==============
qwen3_5, qwen3_5_moe, qwen3_next (gated delta net)    (2 Hk dk + Hv dv) K                           Hv dk dv
kimi_linear (KDA)                                     3 H d K                                       H d d
bamba, granitemoehybrid, falcon_h1, nemotron_h        (I + 2 G N) K, I = heads x head dim           heads hd N
  (Mamba-2; Falcon-H1: I = mamba_d_ssm)
jamba (Mamba-1)                                       I K, I = mamba_expand x hidden                I N
lfm2, lfm2_moe, lfm3 (short conv)                     hidden x conv_L_cache                         0
====================================================  ===========================================  ==============

tests/test_memory.py checks every row against the state the engine measures on the real (tiny) models. A family
not listed whose config shows recurrent layers is refused with a ValueError naming what is unknown, never sized
wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ATTENTION = "attention"
RECURRENT = "recurrent"
BOTH = "both"
NEITHER = "none"
_TYPES = {  # layer type names (transformers' current and legacy ones) -> what the layer keeps
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "sliding_attention": ATTENTION,  # a window group's: kv_size counts its bytes at window_share (docs/sliding.md)
    "chunked_attention": ATTENTION,
    "indexed_attention": ATTENTION,
    "linear_attention": RECURRENT,
    "mamba": RECURRENT,
    "conv": RECURRENT,
    "mlp": NEITHER,
    "moe": NEITHER,
}
_PATTERN = {"M": RECURRENT, "*": ATTENTION, "-": NEITHER, "E": NEITHER}  # Nemotron-H's hybrid_override_pattern
# recurrent-only families: nothing for a prefix cache of KV blocks to hold
RECURRENT_ONLY = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")
# keys that betray recurrent layers in a config whose family is not known here
_RECURRENT_HINTS = ("mamba_", "ssm_", "linear_num_", "linear_conv_", "conv_L_cache", "linear_attn_config")


class ConfigReader:
    """A decoded ``config.json`` with checked access: errors name the file and the key."""

    def __init__(self, cfg: dict[str, Any], path: Path) -> None:
        self.cfg = cfg
        self.path = path
        self.model_type = str(cfg.get("model_type") or "").removesuffix("_text")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def number(self, key: str) -> int | None:
        """A positive integer, or None when absent or null."""
        v = self.cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"{self.path}: {key} must be a positive integer, got {v!r:.60}")
        return v

    def need(self, key: str, what: str = "the KV size") -> int:
        v = self.number(key)
        if v is None:
            raise ValueError(f"{self.path}: missing {key!r} (needed for {what})")
        return v

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")


@dataclass(frozen=True)
class Layers:
    """What a model's layers keep: ``attention`` layers with KV, ``recurrent`` layers with a state (Falcon-H1's
    layers count in both), ``total`` layers; ``conv_elements`` / ``ssm_elements``: one sequence's recurrent
    state over all recurrent layers (conv in the model's dtype, SSM in float32)."""

    total: int
    attention: int
    recurrent: int = 0
    conv_elements: int = 0
    ssm_elements: int = 0


def _kind(name: Any, c: ConfigReader, i: int) -> str:
    kind = _TYPES.get(str(name))
    if kind is None:
        if isinstance(name, str) and name.endswith("attention"):
            return ATTENTION
        raise c.fail(f"layer {i} has type {name!r}, which is not known here (known: {', '.join(_TYPES)})")
    return kind


def _listed(c: ConfigReader, key: str, one_based: bool = False) -> list[int]:
    v = c.cfg.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise c.fail(f"{key} must be a list of layer indices, got {v!r:.60}")
    return [x - 1 for x in v] if one_based else v


def _by_index(c: ConfigReader, n: int, attention: list[int], default: str) -> list[str]:
    """``n`` layers: those in ``attention`` are attention layers, the others ``default``."""
    bad = [i for i in attention if not 0 <= i < n]
    if bad:
        raise c.fail(f"attention layer index {bad[0]} is outside the {n} layers")
    at = set(attention)
    return [ATTENTION if i in at else default for i in range(n)]


def _kinds(c: ConfigReader) -> list[str]:
    """Per layer: ATTENTION, RECURRENT, BOTH or NEITHER (see the module docstring)."""
    mt, cfg = c.model_type, c.cfg
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list) and mt != "bamba":  # bamba's is derived from attn_layer_indices
            kinds = [_kind(t, c, i) for i, t in enumerate(cfg[key])]
            n = c.number("num_hidden_layers")
            if n is not None and n != len(kinds) and mt != "nemotron_h":  # Nemotron-H's layer count is deprecated
                raise c.fail(f"{key} lists {len(kinds)} layers, num_hidden_layers says {n}")
            return kinds
    if isinstance(cfg.get("hybrid_override_pattern"), str):
        pattern = cfg["hybrid_override_pattern"]
        if set(pattern) - set(_PATTERN):
            raise c.fail(f"hybrid_override_pattern {pattern!r:.60} has symbols other than {''.join(_PATTERN)}")
        return [_PATTERN[s] for s in pattern]
    n = c.need("num_hidden_layers")
    if mt in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        every = c.number("full_attention_interval") or 4
        return [ATTENTION if (i + 1) % every == 0 else RECURRENT for i in range(n)]
    if mt == "kimi_linear" and isinstance(cfg.get("linear_attn_config"), dict):
        lac = ConfigReader(cfg["linear_attn_config"], c.path)  # the checkpoint's spelling, layers numbered from 1
        return _by_index(lac, n, _listed(lac, "full_attn_layers", one_based=True), RECURRENT)
    if mt == "bamba":
        return _by_index(c, n, _listed(c, "attn_layer_indices") if c.has("attn_layer_indices") else [], RECURRENT)
    if mt == "jamba":
        period, offset = c.need("attn_layer_period", "the layer pattern"), c.cfg.get("attn_layer_offset", 0)
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
            raise c.fail(f"attn_layer_offset must be an integer in [0, attn_layer_period), got {offset!r:.60}")
        return [ATTENTION if i % period == offset else RECURRENT for i in range(n)]
    if mt in ("lfm2", "lfm2_moe") and c.has("full_attn_idxs"):
        return _by_index(c, n, _listed(c, "full_attn_idxs"), RECURRENT)
    if mt == "falcon_h1":
        return [BOTH] * n  # attention and a Mamba-2 mixer side by side in every layer
    if mt in RECURRENT_ONLY:
        raise c.fail(f"model_type {mt!r} is recurrent only: it keeps no attention KV for a prefix cache to hold")
    if mt not in FAMILIES:
        hints = [k for k in cfg if k.startswith(_RECURRENT_HINTS)]
        if hints:
            raise c.fail(
                f"model_type {mt!r} looks like a hybrid model (it has {hints[0]!r}) but does not list its layer "
                f"types, and its recurrent-state size is not known here (known families: {', '.join(FAMILIES)})"
            )
    if mt in FAMILIES:
        raise c.fail(f"missing the layer types of this {mt} model ('layer_types' or the family's own keys)")
    return [ATTENTION] * n


# ---- per family: the recurrent state of one layer, in elements (conv, SSM) -------------------------------------
def _gated_delta(c: ConfigReader) -> tuple[int, int]:
    what = f"the recurrent-state size of {c.model_type}"
    hk, dk = c.need("linear_num_key_heads", what), c.need("linear_key_head_dim", what)
    hv, dv = c.need("linear_num_value_heads", what), c.need("linear_value_head_dim", what)
    k = c.need("linear_conv_kernel_dim", what)
    return (2 * hk * dk + hv * dv) * k, hv * dk * dv


def _kimi(c: ConfigReader) -> tuple[int, int]:
    what = "the recurrent-state size of kimi_linear"
    lac = c.cfg.get("linear_attn_config")
    alt = ConfigReader(lac if isinstance(lac, dict) else {}, c.path)  # the checkpoint's own spelling
    h = c.number("linear_num_heads") or alt.need("num_heads", what)
    d = c.number("linear_head_dim") or alt.need("head_dim", what)
    k = c.number("linear_conv_kernel_dim") or alt.need("short_conv_kernel_size", what)
    return 3 * h * d * k, h * d * d


def _mamba2(heads: str, head_dim: str, groups: str, state: str, kernel: str, inner: str | None = None) -> Layer:
    def size(c: ConfigReader) -> tuple[int, int]:
        what = f"the recurrent-state size of {c.model_type}"
        h, hd = c.need(heads, what), c.need(head_dim, what)
        g, n, k = c.need(groups, what), c.need(state, what), c.need(kernel, what)
        width = (c.number(inner) if inner else None) or h * hd
        return (width + 2 * g * n) * k, h * hd * n

    return size


def _jamba(c: ConfigReader) -> tuple[int, int]:
    what = "the recurrent-state size of jamba"
    inner = c.need("mamba_expand", what) * c.need("hidden_size", what)
    return inner * c.need("mamba_d_conv", what), inner * c.need("mamba_d_state", what)


def _short_conv(c: ConfigReader) -> tuple[int, int]:
    what = f"the conv-state size of {c.model_type}"
    return c.need("hidden_size", what) * c.need("conv_L_cache", what), 0


Layer = Callable[[ConfigReader], tuple[int, int]]
FAMILIES: dict[str, Layer] = {
    "qwen3_5": _gated_delta,
    "qwen3_5_moe": _gated_delta,
    "qwen3_next": _gated_delta,
    "kimi_linear": _kimi,
    "bamba": _mamba2("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "granitemoehybrid": _mamba2("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv"),
    "falcon_h1": _mamba2(
        "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", inner="mamba_d_ssm"
    ),
    "nemotron_h": _mamba2("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel"),
    "jamba": _jamba,
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
    "lfm3": _short_conv,
}


def read_layers(c: ConfigReader) -> Layers:
    """The layers of the model ``c`` describes (see the module docstring). Raises ValueError naming the file and
    what is missing or unknown, or that no layer keeps attention KV."""
    kinds = _kinds(c)
    attention = sum(k in (ATTENTION, BOTH) for k in kinds)
    recurrent = sum(k in (RECURRENT, BOTH) for k in kinds)
    if not attention:
        raise c.fail(f"no attention layers among its {len(kinds)}: a prefix cache of KV blocks has nothing to hold")
    if not recurrent:
        return Layers(len(kinds), attention)
    family = FAMILIES.get(c.model_type)
    if family is None:
        raise c.fail(
            f"model_type {c.model_type!r} has {recurrent} recurrent layer(s), whose state size is not known here "
            f"(known families: {', '.join(FAMILIES)})"
        )
    conv, ssm = family(c)
    return Layers(len(kinds), attention, recurrent, recurrent * conv, recurrent * ssm)


def preset_layers(total: int, key_heads: int, value_heads: int, head_dim: int, kernel: int = 4) -> Layers:
    """The layers of a built-in hybrid preset (engine/models.py): Qwen3.5's pattern, every fourth layer full
    attention, the others gated delta nets with ``key_heads``/``value_heads`` heads of ``head_dim``."""
    cfg = {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": total,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": kernel,
    }
    return read_layers(ConfigReader(cfg, Path("<preset>")))
