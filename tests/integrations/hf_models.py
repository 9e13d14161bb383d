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
    "afmoe", "aria_text", "axk1", "axk2", "beam", "cohere2_moe", "deepseek_v2",
    "deepseek_v32", "deepseek_v4", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "gemma4_text",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "jamba", "kolibri1", "laguna",
    "lfm2_moe", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_next", "solar_open", "zaya",
)  # fmt: skip
UNCONVERTED_FAMILIES = {"longcat_flash": "LongcatFlashExperts", "jetmoe": "JetMoeParallelExperts"}
"""Families whose experts live outside transformers' experts interface: left high precision, named."""
GENERIC = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, n_routed_experts=4,
    num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=0,
    shared_expert_intermediate_size=32, n_shared_experts=1, max_position_embeddings=64, layer_types=None,
    mlp_only_layers=[], decoder_sparse_step=1,
)  # fmt: skip
_MLA = dict(num_key_value_heads=2)  # multi-head latent attention: as many kv heads as heads
_DSA = dict(num_key_value_heads=2, index_n_heads=2, index_head_dim=64, index_topk=8)
_HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # one layer of each kind
FAMILY_FIELDS = {
    "axk1": _MLA, "axk2": _MLA, "deepseek_v2": _MLA, "glm4_moe_lite": _MLA, "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "flex_olmo": dict(pad_token_id=0),
    "hy_v4": dict(pad_token_id=0), "zaya": dict(num_experts_per_tok=1), "qwen3_next": _HYBRID,
    "qwen3_5_moe_text": _HYBRID, "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_n_groups=1,
                             layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                        layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=32,
                        vocab_size_per_layer_input=VOCAB, global_head_dim=32),
    "longcat_flash": dict(num_layers=2, num_key_value_heads=2, qk_head_dim=64, ffn_hidden_size=64,
                          expert_ffn_hidden_size=32, moe_topk=2, zero_expert_num=2),
}  # fmt: skip
"""Fields a family needs besides GENERIC's to build (and run) tiny."""


def _per_layer(fields: dict, layers: int) -> dict:
    """Two entries of each per-layer list (one of each kind where they differ: a dense and an MoE
    layer), the same two for every list."""
    if not fields:
        return {}
    rows = list(zip(*fields.values(), strict=True))
    first = next((i for i in range(layers) if rows[i] != rows[-1]), 0)
    return {k: [v[first], v[-1]] for k, v in fields.items()}


def tiny_config(family: str, **overrides):
    """The tiny config of `family` (a key of TINY, or of ALL_FAMILIES / UNCONVERTED_FAMILIES /
    "llama4_text": its
    defaults with GENERIC's and FAMILY_FIELDS' fields where it has them, its per-layer lists cut to
    two layers)."""
    import transformers

    if family in TINY:
        cfg_name, _, fields = TINY[family]
        return getattr(transformers, cfg_name)(vocab_size=VOCAB, **{**fields, **overrides})
    cls = transformers.models.auto.configuration_auto.CONFIG_MAPPING[family]
    defaults = cls().to_dict()
    layers = defaults.get("num_hidden_layers") or 0
    lists = {k: v for k, v in defaults.items() if isinstance(v, list) and layers > 2 and len(v) == layers}
    fields = {**GENERIC, **_per_layer(lists, layers), **FAMILY_FIELDS.get(family, {}), **overrides}
    if defaults.pop("per_layer_config", None) is not None:  # per-layer attributes (Gemma 4): by name only
        return cls(**{**defaults, **{k: v for k, v in fields.items() if k in defaults}})
    cfg = cls(**defaults)
    for k, v in fields.items():
        if hasattr(cfg, k):
            try:
                setattr(cfg, k, v)
            except AttributeError:  # a property without a setter (derived from other fields)
                pass
    built = cfg.to_dict()
    built.update({k: v for k, v in fields.items() if k in built})
    return cls(**built)


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
