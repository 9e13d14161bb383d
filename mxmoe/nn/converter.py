"""`mxmoe.convert(model, MXConfig(...))`: swap a model's Linear and GroupedExperts modules for
their MX versions in place (torchtitan's MX converter, for Hopper)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import MXLinear
from mxmoe.nn.mx_experts import MXGroupedExperts
from mxmoe.ops import GEMM_BACKENDS, MXOpConfig
from mxmoe.quant.kernels import KERNELS, why_unavailable

log = logging.getLogger("mxmoe")

RECIPES = {"mxfp8": "floor", "mxfp8_rceil": "rceil"}
GEMM_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class MXConfig:
    """What `convert` swaps and how the swapped modules quantize (MXFP8: e4m3 elements, blocks of 32)."""

    recipe_name: str = "mxfp8_rceil"
    """"mxfp8_rceil": RCEIL scales (cuBLAS round-up; never saturates; default) | "mxfp8": FLOOR
    scales (OCP; the block max can saturate to 448)."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output", "router"])
    """Modules whose fully qualified name contains any of these substrings stay high precision.
    Default: the output projection (as torchtitan) and the MoE router (its routing decisions and
    tiny out dim E are precision-sensitive)."""
    convert_linears: bool = True
    """Swap nn.Linear for MXLinear."""
    convert_grouped_experts: bool = True
    """Swap mxmoe.nn.GroupedExperts for MXGroupedExperts."""
    mxfp8_dim1_cast_kernel_choice: str = "triton"
    """Kernel for every cast producing a dim1 (transposed) result: "triton" | "cuda" | "torch"."""
    mxfp8_dim0_cast_kernel_choice: str = "auto"
    """Kernel for dim0 casts and dequantization: "auto" (fastest available) | "triton" | "cuda" | "torch"."""
    gemm_backend: str = "emulated"
    """GEMM on MX operands: "emulated" (dequantize exactly, bf16/fp32 GEMM; default) | "fp8" (sm_90
    fp8 tensor cores, one MMA per 32-block of K; opt-in, see mxmoe.ops.fp8_gemm)."""
    gemm_dtype: str = "auto"
    """Operand dtype of the emulated GEMM: "auto" (bf16 on CUDA, fp32 on CPU) | "bfloat16" | "float32"."""

    def op_config(self) -> MXOpConfig:
        """The MXOpConfig every swapped module gets (validates recipe and choices)."""
        if self.recipe_name not in RECIPES:
            raise ValueError(
                f"recipe_name={self.recipe_name!r} is not an MX recipe; expected one of {list(RECIPES)}"
            )
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(
                f"gemm_dtype={self.gemm_dtype!r} is not supported; expected one of {list(GEMM_DTYPES)}"
            )
        if self.mxfp8_dim1_cast_kernel_choice not in KERNELS:
            raise ValueError(
                f"mxfp8_dim1_cast_kernel_choice={self.mxfp8_dim1_cast_kernel_choice!r}; "
                f"expected one of {KERNELS}"
            )
        if self.mxfp8_dim0_cast_kernel_choice != "auto" and self.mxfp8_dim0_cast_kernel_choice not in KERNELS:
            raise ValueError(
                f"mxfp8_dim0_cast_kernel_choice={self.mxfp8_dim0_cast_kernel_choice!r}; "
                f"expected 'auto' or one of {KERNELS}"
            )
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend={self.gemm_backend!r}; expected one of {GEMM_BACKENDS}")
        return MXOpConfig(
            elem_dtype=torch.float8_e4m3fn,
            block_size=32,
            scaling_mode=RECIPES[self.recipe_name],
            kernel=self.mxfp8_dim0_cast_kernel_choice,
            dim1_kernel=self.mxfp8_dim1_cast_kernel_choice,
            gemm_backend=self.gemm_backend,
            gemm_dtype=GEMM_DTYPES[self.gemm_dtype],
        )


def _tp_degree(parallel_dims) -> int:
    if parallel_dims is None:
        return 1
    if isinstance(parallel_dims, dict):
        return int(parallel_dims.get("tp", 1) or 1)
    if hasattr(parallel_dims, "tp_enabled") and not hasattr(parallel_dims, "tp"):
        return 2 if parallel_dims.tp_enabled else 1
    if hasattr(parallel_dims, "tp"):
        return int(parallel_dims.tp or 1)
    raise TypeError(
        f"parallel_dims must be None, a dict like {{'dp_shard': 4, 'ep': 2, 'tp': 1}} or an object with "
        f"`tp` / `tp_enabled`; got {type(parallel_dims).__name__}"
    )


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return torch.device("cuda") if p.device.type == "meta" else p.device
    return torch.device("cpu")


def convert(model: nn.Module, config: MXConfig | None = None, parallel_dims=None) -> nn.Module:
    """Swap matching modules of `model` in place for their MX versions; returns `model`.

    nn.Linear -> MXLinear and GroupedExperts -> MXGroupedExperts (sharing the Parameter objects,
    so state-dict keys and optimizer state are unchanged), except modules whose FQN contains a
    `filter_fqns` substring and modules with a dim not divisible by 32 (skipped, named in the log
    line). Convert before applying FSDP (`fully_shard`) or torch.compile. Logs one line.

    Raises ValueError for an unknown recipe/choice, tensor parallelism (tp > 1), or a cast kernel
    that cannot run on the model's device (meta counts as CUDA).
    """
    config = MXConfig() if config is None else config
    if not isinstance(config, MXConfig):
        raise TypeError(f"config must be an MXConfig, got {type(config).__name__}")
    tp = _tp_degree(parallel_dims)
    if tp > 1:
        raise ValueError(
            f"tensor parallelism with MX is not supported yet (parallel_dims has tp={tp}); "
            "use tp=1 with data/expert parallelism"
        )
    op_config = config.op_config()
    device = _model_device(model)
    for name, kernel in (
        ("mxfp8_dim1_cast_kernel_choice", op_config.dim1_kernel),
        ("mxfp8_dim0_cast_kernel_choice", op_config.kernel),
    ):
        if kernel != "auto":
            reason = why_unavailable(kernel, device)
            if reason is not None:
                raise ValueError(f"{name}={kernel!r} cannot run for a model on {device}: {reason}")

    swapped = {"Linear": 0, "GroupedExperts": 0}
    skipped: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            new = None
            if isinstance(child, (MXLinear, MXGroupedExperts)):
                continue
            if isinstance(child, nn.Linear) and config.convert_linears:
                kind, dims = "Linear", (child.in_features, child.out_features)
            elif isinstance(child, GroupedExperts) and config.convert_grouped_experts:
                kind, dims = "GroupedExperts", (child.dim, child.hidden_dim)
            else:
                visit(child, fqn)
                continue
            if any(f in fqn for f in config.filter_fqns):
                skipped.append(f"{fqn} (filter_fqns)")
                continue
            if any(d % op_config.block_size for d in dims):
                skipped.append(f"{fqn} (dims {dims[0]}x{dims[1]} not divisible by {op_config.block_size})")
                continue
            if kind == "Linear":
                new = MXLinear.from_linear(child, op_config)
            else:
                new = MXGroupedExperts.from_experts(child, op_config)
            setattr(parent, child_name, new)
            swapped[kind] += 1

    visit(model, "")
    log.info(
        "mxmoe.convert: %d Linear -> MXLinear, %d GroupedExperts -> MXGroupedExperts (recipe %s, "
        "dim1 cast %s, gemm %s); skipped: %s",
        swapped["Linear"],
        swapped["GroupedExperts"],
        config.recipe_name,
        op_config.dim1_kernel,
        op_config.gemm_backend,
        ", ".join(skipped) or "none",
    )
    return model
