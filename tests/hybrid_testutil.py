"""Tiny random models of every hybrid (recurrent + attention) family transformers ships, and of the MLA families,
built from their config classes with seeded weights (nothing downloaded): for tests/test_hybrid.py.

Every config keeps vocab 300 and hidden 64 (128 for the Mamba-2 families, whose intermediate is expand x hidden),
2-4 layers with at least one recurrent and one attention layer where the family has both.
"""

from __future__ import annotations

import torch
import transformers

V = 300
COMMON = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
QWEN_LIN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
MOE_QWEN = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MAMBA2 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
MLA = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
)


def configs() -> dict[str, tuple[str, str, dict]]:
    """family -> (config class, causal-LM class, kwargs)."""
    return {
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**QWEN_LIN}),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**QWEN_LIN, **MOE_QWEN}),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**QWEN_LIN, **MOE_QWEN, "decoder_sparse_step": 1}),
        "nemotron_h": (
            "NemotronHConfig",
            "NemotronHForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
                mamba_num_heads=4,
                mamba_head_dim=16,
                ssm_state_size=16,
                n_groups=2,
                conv_kernel=4,
                chunk_size=16,
                use_mamba_kernels=False,
                n_routed_experts=4,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32,
            ),
        ),
        "granitemoehybrid": (
            "GraniteMoeHybridConfig",
            "GraniteMoeHybridForCausalLM",
            dict(
                **MAMBA2,
                num_hidden_layers=4,
                layer_types=["mamba", "mamba", "mamba", "attention"],
                num_local_experts=4,
                num_experts_per_tok=2,
                shared_intermediate_size=64,
                mamba_n_heads=4,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_head=32,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=16,
            ),
        ),
        "lfm2": (
            "Lfm2Config",
            "Lfm2ForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                conv_L_cache=3,
                layer_types=["conv", "conv", "full_attention", "conv"],
                block_auto_adjust_ff_dim=False,
            ),
        ),
        "lfm2_moe": (
            "Lfm2MoeConfig",
            "Lfm2MoeForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                conv_L_cache=3,
                num_dense_layers=1,
                num_experts=4,
                num_experts_per_tok=2,
                layer_types=["conv", "conv", "full_attention", "conv"],
            ),
        ),
        "lfm3": (
            "Lfm3Config",
            "Lfm3ForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                conv_L_cache=7,
                sliding_window=8,
                layer_types=["conv", "full_attention", "conv", "sliding_attention"],
            ),
        ),
        "kimi_linear": (
            "KimiLinearConfig",
            "KimiLinearForCausalLM",
            dict(
                hidden_size=64,
                intermediate_size=128,
                moe_intermediate_size=32,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=4,
                kv_lora_rank=16,
                q_lora_rank=None,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
                num_experts=4,
                num_experts_per_token=2,
                num_shared_experts=1,
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                linear_head_dim=16,
                linear_num_heads=4,
                linear_conv_kernel_dim=4,
            ),
        ),
        "falcon_h1": (
            "FalconH1Config",
            "FalconH1ForCausalLM",
            dict(
                **MAMBA2,
                num_hidden_layers=2,
                mamba_d_ssm=128,
                mamba_n_heads=4,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=16,
            ),
        ),
        "jamba": (
            "JambaConfig",
            "JambaForCausalLM",
            dict(
                **MAMBA2,
                num_hidden_layers=4,
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=4,
                num_experts_per_tok=2,
                use_mamba_kernels=False,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=8,
            ),
        ),
        "bamba": (
            "BambaConfig",
            "BambaForCausalLM",
            dict(
                **MAMBA2,
                num_hidden_layers=4,
                attn_layer_indices=[3],
                mamba_n_heads=4,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=16,
            ),
        ),
        "deepseek_v3": (
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            dict(**MLA, num_hidden_layers=2, first_k_dense_replace=1),
        ),
        "glm4_moe_lite": (
            "Glm4MoeLiteConfig",
            "Glm4MoeLiteForCausalLM",
            dict(**MLA, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"]),
        ),
    }


ATTN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def attention_configs() -> dict[str, tuple[str, str, dict]]:
    """Attention families of 2026 (MoE, sliding windows, sinks) for the version probe (benchmarks/compat.py)."""
    return {
        "gpt_oss": (
            "GptOssConfig",
            "GptOssForCausalLM",
            dict(
                **ATTN,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                attn_implementation="eager",  # its attention sinks: no sdpa
            ),
        ),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            dict(**ATTN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        ),
        "glm4_moe": (
            "Glm4MoeConfig",
            "Glm4MoeForCausalLM",
            dict(
                **ATTN,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
            ),
        ),
        "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(**ATTN, sliding_window=8)),
        # Kimi Linear with grouped MLA heads (2 KV heads of 4): transformers' forward over a cached prefix raises
        "kimi_linear_gqa": (
            "KimiLinearConfig",
            "KimiLinearForCausalLM",
            {**configs()["kimi_linear"][2], "num_key_value_heads": 2},
        ),
    }


FAMILIES = list(configs())
RECURRENT = [f for f in FAMILIES if f not in ("deepseek_v3", "glm4_moe_lite")]
ATTENTION = list(attention_configs())


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    cfg_name, model_name, kw = {**configs(), **attention_configs()}[family]
    cfg_cls = getattr(transformers, cfg_name)
    model_cls = getattr(transformers, model_name)
    kw = {**COMMON, **kw, **overrides}
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = kw.get("attn_implementation", "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg).to(dtype).eval()
    return model
