"""Blocks -> bytes: presets (kept in sync with engine/models.py), config.json files, explicit numbers."""

from __future__ import annotations

import json

import pytest

from prefixcache.sim.kv_size import PRESETS, KVShape, from_config, resolve_model


def test_bytes_by_hand():
    # Llama-3-8B-like: 32 layers, 8 KV heads, head dim 128, bf16 -> 2*32*8*128*2 = 131072 B/token
    m = KVShape("l3", layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert m.bytes_per_token == 131_072
    assert m.bytes_per_block(16) == 2_097_152
    assert m.gb(1000, 16) == pytest.approx(2.097152)


def test_config_json(tmp_path):
    cfg = {
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 2048,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_config(tmp_path / "config.json")
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (28, 8, 128, "bfloat16")  # head dim = 2048 / 16
    assert m.bytes_per_token == 2 * 28 * 8 * 128 * 2
    # a folder works too, explicit head_dim wins, missing KV heads fall back to attention heads, dtype override
    cfg2 = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32, "dtype": "float32"}
    (tmp_path / "m2").mkdir()
    (tmp_path / "m2" / "config.json").write_text(json.dumps(cfg2))
    m2 = resolve_model(str(tmp_path / "m2"), dtype="fp16")
    assert (m2.layers, m2.kv_heads, m2.head_dim, m2.dtype) == (2, 4, 32, "fp16")
    assert m2.bytes_per_token == 2 * 2 * 4 * 32 * 2


def test_multimodal_text_config(tmp_path):
    cfg = {
        "torch_dtype": "bfloat16",
        "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = from_config(tmp_path / "config.json")
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (4, 2, 64, "bfloat16")


def test_errors_name_the_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        from_config(tmp_path / "config.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        from_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError, match="together"):
        resolve_model(layers=2, kv_heads=2)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_model(layers=2, kv_heads=2, head_dim=8, dtype="int3")
    assert resolve_model() is None
    assert resolve_model(layers=2, kv_heads=2, head_dim=8).bytes_per_token == 2 * 2 * 2 * 8 * 2


def test_presets_match_engine_models():
    pytest.importorskip("torch")
    from engine.models import PRESETS as ENGINE

    assert set(PRESETS) == set(ENGINE)
    for name, p in ENGINE.items():
        m = PRESETS[name]
        assert (m.layers, m.kv_heads, m.head_dim) == (
            p.num_hidden_layers,
            p.num_key_value_heads,
            p.hidden_size // p.num_attention_heads,
        )
        assert m.dtype == "float32"  # engine builds presets in float32 by default
