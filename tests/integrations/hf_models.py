"""Tiny Hugging Face transformers MoE models built from local configs (no download), for the tests
of mxmoe.integrations.hf and mxmoe.integrations.torchao: dims multiples of 32, 2 layers, 4 experts."""

from __future__ import annotations

import torch

VOCAB = 128
TINY = {
    # family: (config class name, model class name, config fields)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32)),
    # biases, transposed weights (E, K, N) and a gate of its own (clamped SwiGLU on interleaved halves)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"])),
}
"""The families the fast tests cover; ALL_FAMILIES (slow) adds every other one transformers ships
with an experts-interface module whose tiny config builds from generic fields."""

ALL_FAMILIES = (
    "afmoe", "deepseek_v4", "dots1", "ernie4_5_moe", "flint", "glm4_moe", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "kolibri1", "minimax", "minimax_m2", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "solar_open",
)  # fmt: skip
GENERIC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, n_routed_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=0,
    shared_expert_intermediate_size=32, n_shared_experts=1, max_position_embeddings=64, layer_types=None,
    mlp_only_layers=[], decoder_sparse_step=1,
)  # fmt: skip


def tiny_config(family: str, **overrides):
    """The tiny config of `family` (a key of TINY, or of ALL_FAMILIES: its defaults with GENERIC's
    fields where it has them)."""
    import transformers

    if family in TINY:
        cfg_name, _, fields = TINY[family]
        return getattr(transformers, cfg_name)(vocab_size=VOCAB, **{**fields, **overrides})
    cls = transformers.models.auto.configuration_auto.CONFIG_MAPPING[family]
    cfg = cls()
    for k, v in {**GENERIC, **overrides}.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    return cls(**cfg.to_dict())


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny causal LM of `family`, initialized from `seed`, in `dtype`."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    if family in TINY:
        model = getattr(transformers, TINY[family][1])(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype)


def tokens(batch: int = 4, seq: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)
