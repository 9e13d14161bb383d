"""The model of scripts/torchtitan_ep.sh, for torchtitan 0.2.2's trainer: `--model.name deepseek_v3
--model.flavor mxmoe_ep --experimental.custom_import torchtitan_ep_flavor` (scripts/ on PYTHONPATH).

"mxmoe_ep" is torchtitan's DeepSeek-V3 (MLA attention, softmax top-k routing, shared experts) with
routed experts wide enough that the expert-parallel exchange matters: dim 5120 (the row width of
the all-to-all benchmark, 16 x 8192 x 5120 per rank), 16 experts of hidden 2048 each, top-8 (the
DeepSeek-V3 fan-out: with 2 x 8192 tokens per GPU, 131072 routed rows per GPU), 1 shared expert,
4 layers of which 1 dense, vocabulary 2048 (the byte tokenizer's 258 fit). 2.13 B parameters,
1.5 B of them experts (EP-sharded), so AdamW's state fits 2 or 4 H200s with FSDP over the same GPUs.

Importing this module also registers the torchao peer's converter ("torchao_mxfp8",
scripts/torchtitan_torchao_peer.py): torchtitan 0.2 takes one `--experimental.custom_import`.
"""

import torchtitan_torchao_peer  # noqa: F401  (registers "torchao_mxfp8")
from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, deepseekv3_args
from torchtitan.models.moe import MoEArgs

FLAVOR = "mxmoe_ep"

deepseekv3_args.setdefault(
    FLAVOR,
    DeepSeekV3ModelArgs(
        vocab_size=2048,
        dim=5120,
        inter_dim=13824,
        moe_inter_dim=2048,
        n_layers=4,
        n_dense_layers=1,
        n_heads=40,
        moe_args=MoEArgs(
            num_experts=16,
            num_shared_experts=1,
            top_k=8,
            score_func="softmax",
            route_norm=False,
            score_before_experts=False,
        ),
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.70,
    ),
)
