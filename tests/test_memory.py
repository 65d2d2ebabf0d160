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


def write(tmp_path, cfg, name="config.json"):
    (tmp_path / name).write_text(json.dumps(cfg))
    return tmp_path / name


def test_hybrid_and_latent_configs_by_hand(tmp_path):
    # Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (full_attention_interval, no layer_types): 12 with
    # KV (2 KV heads x 256, bf16), 36 gated delta nets (16 key / 32 value heads of 128, kernel 4)
    nxt = {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
    }
    m = from_config(write(tmp_path, nxt))
    assert (m.layers, m.recurrent_layers, m.total_layers) == (12, 36, 48)
    assert m.bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    conv = (2 * 16 * 128 + 32 * 128) * 4  # elements per layer, bf16
    assert m.state_bytes == 36 * (conv * 2 + 32 * 128 * 128 * 4) == 77_856_768
    assert m.gb(1000, 16, snapshots=10) == pytest.approx((1000 * 16 * 24_576 + 10 * 77_856_768) / 1e9)
    assert resolve_model(str(tmp_path), dtype="fp32").state_bytes == 36 * (conv + 32 * 128 * 128) * 4
    # Qwen3.5 as shipped: a multimodal config whose text_config is the language model
    text = {k: v for k, v in nxt.items() if k not in ("model_type", "torch_dtype", "full_attention_interval")}
    text["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    text["num_hidden_layers"] = 4
    mm = {"model_type": "qwen3_5", "dtype": "bfloat16", "text_config": {**text, "model_type": "qwen3_5_text"}}
    m = from_config(write(tmp_path, mm, "mm.json"))
    assert (m.layers, m.recurrent_layers, m.dtype) == (1, 3, "bfloat16")
    assert m.state_bytes == 3 * (conv * 2 + 32 * 128 * 128 * 4)
    # DeepSeek-V3: 61 layers of multi-head latent attention cache kv_lora_rank 512 + rotary 64 per token and layer
    ds = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "torch_dtype": "bfloat16",
    }
    m = from_config(write(tmp_path, ds, "ds.json"))
    assert m.bytes_per_token == 61 * (512 + 64) * 2 == 70_272 and m.state_bytes == 0 and not m.hybrid
    assert m.layers_text() == "61 layers x latent 576 (MLA)"
    # Nemotron-H's older pattern string (M mamba, * attention, - MLP) and no num_hidden_layers
    nh = {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*-M",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 6,
        "conv_kernel": 3,
        "torch_dtype": "float32",
    }
    m = from_config(write(tmp_path, nh, "nh.json"))
    assert (m.layers, m.recurrent_layers, m.total_layers) == (1, 2, 4)
    assert m.state_bytes == 2 * ((4 * 8 + 2 * 2 * 6) * 3 + 4 * 8 * 6) * 4
    # Kimi Linear's checkpoint spelling: linear_attn_config, layers numbered from 1
    kimi = {
        "model_type": "kimi_linear",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "kv_lora_rank": 12,
        "qk_rope_head_dim": 4,
        "linear_attn_config": {
            "full_attn_layers": [4],
            "kda_layers": [1, 2, 3],
            "num_heads": 2,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
        },
        "torch_dtype": "float32",
    }
    m = from_config(write(tmp_path, kimi, "kimi.json"))
    assert (m.layers, m.recurrent_layers, m.bytes_per_token) == (1, 3, (12 + 4) * 4)
    assert m.state_bytes == 3 * (3 * 2 * 8 * 4 + 2 * 8 * 8) * 4


def test_unknown_recurrent_layers_are_refused(tmp_path):
    attn = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    cases = [
        # a family whose recurrent state is not known here
        (
            {"model_type": "minimax", "layer_types": ["linear_attention", "full_attention"], **attn},
            "'minimax' has 1 recurrent layer",
        ),
        # a known family missing a key of its formula
        (
            {
                "model_type": "qwen3_5_text",
                "num_hidden_layers": 4,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "linear_conv_kernel_dim": 4,
                **attn,
            },
            "missing 'linear_num_value_heads'",
        ),
        ({"model_type": "mamba2", "num_hidden_layers": 4, "hidden_size": 64}, "recurrent only"),
        ({"model_type": "zamba", "num_hidden_layers": 4, "mamba_d_state": 16, **attn}, "looks like a hybrid"),
        ({"model_type": "zamba2", "layers_block_type": ["mamba", "hybrid"], **attn}, "layer 1 has type 'hybrid'"),
        ({"model_type": "bamba", "num_hidden_layers": 2, **attn}, "no attention layers"),
        ({"model_type": "granitemoehybrid", "num_hidden_layers": 2, **attn}, "missing the layer types"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            from_config(write(tmp_path, cfg))


def test_presets_match_engine_models():
    """Every preset's KV bytes per token and snapshot bytes are what the engine allocates for the real model: its
    KV pool (per block / block size) and its recurrent-state spec (ModelRuntime's, or for small-hybrid the probe
    ModelRuntime runs, engine.hybrid.probe.probe_spec: its runtime's exactness probes take half a minute)."""
    pytest.importorskip("torch")
    from engine import hf_cache
    from engine.hybrid.probe import probe_spec
    from engine.kv_pool import KVPool, bytes_per_token
    from engine.models import PRESETS as ENGINE
    from engine.models import build_preset
    from engine.runtime import ModelRuntime, RuntimeConfig

    assert set(PRESETS) == set(ENGINE)
    # by hand: small-hybrid's 3 attention layers x (K + V) x 4 KV heads x 64 x 4 bytes; 9 gated delta nets x (conv
    # (2*6*64 + 12*64) * 4 + state 12*64*64) elements x 4 bytes
    assert PRESETS["small-hybrid"].bytes_per_token == 3 * 2 * 4 * 64 * 4 == 6_144
    assert PRESETS["small-hybrid"].state_bytes == 9 * ((2 * 6 * 64 + 12 * 64) * 4 + 12 * 64 * 64) * 4 == 1_990_656
    for name, p in ENGINE.items():
        m = PRESETS[name]
        assert m.dtype == "float32"  # engine builds presets in float32 by default
        model, _ = build_preset(name)
        if name == "small-hybrid":
            pool = KVPool(hf_cache.probe_specs(model), 1, 16, dtype=model.dtype, device="cpu", check_memory=False)
            snapshot = probe_spec(model).bytes_per_snapshot
        else:
            tokens = 4096 if m.window_layers else 64  # window slots round to whole blocks: a pool where that is small
            rt = ModelRuntime(model, RuntimeConfig(max_cached_tokens=tokens, max_cached_states=1))
            assert rt.pool is not None
            pool = rt.pool
            snapshot = 0 if rt.hybrid is None else rt.hybrid.spec.bytes_per_snapshot
            assert m.window_layers == (0 if rt.window is None else len(rt.window[1])), name
            assert m.whole_bytes_per_token == bytes_per_token(rt.specs, model.dtype), name
        per_token = pool.nbytes / (pool.num_blocks * pool.block_size)
        if m.window_layers:
            assert abs(m.bytes_per_token - per_token) <= 0.005 * per_token, name
        else:
            assert m.bytes_per_token == per_token, name
        assert m.state_bytes == snapshot, name
        assert m.hybrid == (p.family == "qwen3_5") and (m.total_layers or m.layers) == p.num_hidden_layers


# ---- hybrid and latent-attention families: config.json as transformers writes it, against the real models ------
COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MAMBA2 = dict(mamba_n_heads=16, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=6, mamba_d_conv=3, mamba_chunk_size=16)
# family -> (config class, model class, config arguments, float32 KV bytes per token, float32 snapshot bytes), the
# bytes by hand: KV = attention layers x elements per token and layer x 4; state = recurrent layers x (conv + SSM)
FAMILIES = {
    "qwen3_5": (  # 3 linear + 1 full; conv (2*2*8 + 4*12) * 3 = 240, state 4*8*12 = 384
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=3,
        ),
        1 * 2 * 2 * 16 * 4,
        3 * (240 + 384) * 4,
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
        1 * 2 * 2 * 16 * 4,
        3 * (240 + 384) * 4,
    ),
    "bamba": (  # layers 0 and 2 Mamba-2: conv (16*8 + 2*2*6) * 3 = 456, state 16*8*6 = 768
        "BambaConfig",
        "BambaForCausalLM",
        dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_expand=2, **MAMBA2),
        1 * 2 * 2 * 16 * 4,
        2 * (456 + 768) * 4,
    ),
    "granitemoehybrid": (  # legacy layer type names
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"],
            mamba_expand=2,
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=32,
            **MAMBA2,
        ),
        1 * 2 * 2 * 16 * 4,
        2 * (456 + 768) * 4,
    ),
    "falcon_h1": (  # attention and Mamba-2 in both layers: conv (48 + 2*2*6) * 3 = 216, state 6*8*6 = 288
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            mamba_d_ssm=48,
            mamba_n_heads=6,
            mamba_d_head=8,
            mamba_n_groups=2,
            mamba_d_state=6,
            mamba_d_conv=3,
            mamba_chunk_size=16,
        ),
        2 * 2 * 2 * 16 * 4,
        2 * (216 + 288) * 4,
    ),
    "nemotron_h": (  # mamba, attention, mlp, mamba: conv (4*8 + 2*2*6) * 3 = 168, state 4*8*6 = 192
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=6,
            conv_kernel=3,
            use_mamba_kernels=False,
            chunk_size=16,
        ),
        1 * 2 * 2 * 16 * 4,
        2 * (168 + 192) * 4,
    ),
    "jamba": (  # attention at odd layers; Mamba-1 inner 2*64 = 128: conv 128*3, state 128*6
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=4,
            expert_layer_offset=3,
            num_experts=2,
            mamba_d_state=6,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_dt_rank=8,
            use_mamba_kernels=False,
        ),
        2 * 2 * 2 * 16 * 4,
        2 * (128 * 3 + 128 * 6) * 4,
    ),
    "lfm2": (  # short convs at layers 0 and 2: hidden 64 x conv_L_cache 3, no SSM state
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3),
        2 * 2 * 2 * 16 * 4,
        2 * 64 * 3 * 4,
    ),
    "kimi_linear": (  # KDA at layers 0 and 2: conv 3*2*8*3 = 144, state 2*8*8 = 128; MLA latent 12 + 4
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_heads=2,
            linear_head_dim=8,
            linear_conv_kernel_dim=3,
            kv_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            q_lora_rank=None,
            num_experts=2,
            num_experts_per_token=1,
            moe_intermediate_size=32,
            first_k_dense_replace=3,
        ),
        1 * (12 + 4) * 4,
        2 * (144 + 128) * 4,
    ),
    "deepseek_v3": (  # all attention, MLA: latent 12 + rotary 4 per token and layer (not 2 x 4 heads x 12)
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            kv_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            q_lora_rank=16,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            first_k_dense_replace=2,
            n_group=1,
            topk_group=1,
        ),
        2 * (12 + 4) * 4,
        0,
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_formulas_match_the_real_models(family, tmp_path):
    """A tiny model of each family: its config.json as transformers saves it, read here, gives the KV bytes per
    token of the KV the engine probes (its pool's layer specs) and the snapshot bytes of the recurrent state it
    measures, in float32 and bfloat16 (where the SSM state stays float32); and the bytes computed by hand."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine import hf_cache
    from engine.hybrid.probe import probe_spec
    from engine.kv_pool import bytes_per_token

    config_cls, model_cls, args, kv_fp32, state_fp32 = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **args})
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = model.to(dtype)
        shape = from_config(tmp_path / "config.json", dtype=name)
        assert shape.bytes_per_token == bytes_per_token(hf_cache.probe_specs(model), dtype), (family, name)
        assert shape.state_bytes == probe_spec(model).bytes_per_snapshot, (family, name)
        if name == "float32":
            assert (shape.bytes_per_token, shape.state_bytes) == (kv_fp32, state_fp32)
        assert shape.hybrid == (state_fp32 > 0)
