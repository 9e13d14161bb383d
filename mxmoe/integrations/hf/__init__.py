"""mxmoe in Hugging Face transformers (>= 5): the experts implementation "mxmoe" (docs/huggingface.md).

transformers 5 builds an MoE model's routed experts as one module per layer with 3D parameters
(`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I); transposed (E, H, 2I) / (E, I, H) where the
module says `is_transposed`) whose forward is chosen by name from transformers' `ExpertsInterface`
(`config._experts_implementation`: "grouped_mm", "eager", ...). Importing this package registers
`mxmoe_experts_forward` there as "mxmoe": transformers' grouped_mm experts with both grouped GEMMs
on MX operands (`mxmoe.ops.mx_grouped_mm`).

    import mxmoe, mxmoe.integrations.hf
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mxmoe")  # experts only
    mxmoe.convert(model, mxmoe.MXOptions())  # experts and Linear layers (attention, router, lm_head kept)

`mxmoe.convert` imports this package itself when it meets such a module. Neither changes the
parameters or their names: `save_pretrained` writes the model's own weights and config.
"""

from __future__ import annotations

from mxmoe.integrations.hf.experts import NAME, mxmoe_experts_forward, register, use_mx_experts

register()

__all__ = ["NAME", "mxmoe_experts_forward", "register", "use_mx_experts"]
