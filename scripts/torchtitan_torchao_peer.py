"""torchao 0.18's MXFP8 training in torchtitan 0.2.2's trainer on a GPU below sm_100 (the H200): the
peer of mxmoe's "mxmoe" converter in scripts/torchtitan_h200.sh.

torchtitan 0.2.2's own MX converters ("quantize.linear.mx", "quantize.grouped_mm.mx") cannot run
there: both assert an sm_100 GPU, and they call torchao APIs that torchao 0.18 no longer has
(`MXLinearConfig`, `MoETrainingConfig`). torchao 0.18 itself has an emulated mode for other GPUs
(`KernelPreference.EMULATED`: torch-native MXFP8 casts, GEMMs on dequantized operands). This
module registers the converter "torchao_mxfp8", which does what torchtitan 0.3's MX converters do
with torchao 0.18, in that mode:

* Linear layers -> torchao's `MXFP8Linear(kernel_preference=EMULATED)` (RCEIL scales), sharing
  the parameters;
* torchtitan's `GroupedExperts` -> a subclass whose grouped GEMMs are torchao's
  `_to_mxfp8_then_scaled_grouped_mm` (recipe "mxfp8_emulated_rceil"), with token groups padded
  to 32 rows as torchtitan 0.2.2's own grouped-GEMM converter does.

It converts the modules mxmoe's converter converts: it reads `--mx.filter_fqns` (the `[mx]`
section of `--job.custom_config_module mxmoe.integrations.torchtitan`). Load it with
`--experimental.custom_import torchtitan_torchao_peer` (scripts/ on PYTHONPATH). Not part of mxmoe:
a benchmark peer.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm
from torchao.quantization.quantize_.common import KernelPreference
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import indices_padding_wrapper, set_token_group_alignment_size_m
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.tools.logging import logger

OP_CONFIG = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)


def _experts_mm(w1, w2, w3, x, num_tokens_per_expert):
    # torchtitan 0.2.2's _run_experts_grouped_mm with torchao's MXFP8 grouped GEMM
    offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    xb = x.bfloat16()

    def mm(a, w):
        b_t = w.bfloat16().transpose(-2, -1)
        return _quantize_then_scaled_grouped_mm(a, b_t, config=OP_CONFIG, offs=offs)

    h = F.silu(mm(xb, w1)) * mm(xb, w3)
    return mm(h, w2).type_as(x)


class TorchAOMXFP8GroupedExperts(GroupedExperts):
    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        ep = isinstance(self.w1, DTensor) and "ep" in self.w1.device_mesh.mesh_dim_names
        fn = _experts_mm if ep else indices_padding_wrapper(_experts_mm)  # EP pads in its dispatch
        return fn(w1, w2, w3, x, num_tokens_per_expert)


class TorchAOMXFP8Converter:
    def __init__(self, job_config, parallel_dims):
        mx = getattr(job_config, "mx", None)
        self.filter_fqns = list(mx.filter_fqns) if mx is not None else ["output", "router"]
        set_token_group_alignment_size_m(32)  # MXFP8 wgrad blocks run along the token axis

    def convert(self, model: nn.Module) -> None:
        linears = experts = 0
        for parent_fqn, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                fqn = f"{parent_fqn}.{name}" if parent_fqn else name
                if any(f in fqn for f in self.filter_fqns):
                    continue
                if type(child) is nn.Linear and child.in_features % 32 == 0 and child.out_features % 32 == 0:
                    new = MXFP8Linear(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        device="meta",
                        kernel_preference=KernelPreference.EMULATED,
                    )
                    new.weight, new.bias = child.weight, child.bias
                    setattr(parent, name, new)
                    linears += 1
                elif type(child) is GroupedExperts:
                    child.__class__ = TorchAOMXFP8GroupedExperts
                    experts += 1
        logger.info(
            f"torchao_mxfp8 (emulated): {linears} Linear -> MXFP8Linear, {experts} GroupedExperts "
            f"-> MXFP8 grouped GEMMs; filter_fqns {self.filter_fqns}"
        )

    def post_optimizer_hook(self, model) -> None:
        return


register_model_converter(TorchAOMXFP8Converter, "torchao_mxfp8")
