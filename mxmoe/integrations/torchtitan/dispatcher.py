"""A torchtitan 0.3 token dispatcher whose expert-parallel all-to-alls are mxmoe's MXFP8 exchange.

`MXFP8AllToAllTokenDispatcher` is torchtitan's `AllToAllTokenDispatcher` (same routing, count
exchange, permutation, scoring and scatter-add) with its two token exchanges replaced:

  dispatch  forward: rows quantized to MXFP8 (e4m3, RCEIL, blocks of 32 along the model dim),
            element and scale bytes exchanged, dequantized on arrival to the rows' dtype
            (`mxmoe.comm.a2a_dispatch_mxfp8`): 1 + 1/32 bytes per element on the wire, not 2.
            backward: the rows' gradient exchanged in high precision (straight-through).
  combine   forward: expert outputs exchanged in high precision; backward: their gradient
            exchanged in MXFP8 (`mxmoe.comm.a2a_combine`).

This is the split mxmoe's own expert parallelism uses: what crosses the wire in MXFP8 is what the
MX expert GEMMs quantize along the same axis anyway (the experts' input rows, the gradient of
their output rows). With EP = 1 there is no exchange and it dispatches locally, as torchtitan's.
It is swapped in the way torchtitan swaps its own dispatchers: a `Config` in the tree's
`RoutedExperts.token_dispatcher` slot (`MXFP8TokenDispatcherConverter`, or the `mxmoe_a2a`
override of `mxmoe.integrations.torchtitan`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torchtitan.protocols.model import ModelConfigConverter

from mxmoe.comm import a2a_combine, a2a_dispatch_mxfp8
from mxmoe.integrations.torchtitan.common import takes_mx_rows
from mxmoe.nn.mx_experts import RowsFromAnchor
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.recipe import CAST_KERNELS, DEFAULT_RECIPE

log = logging.getLogger("mxmoe")

TRANSPORTS = ("auto", "symm", "nccl")


def _check_choices(kernel: str, transport: str) -> None:
    if kernel != "auto" and kernel not in CAST_KERNELS:
        raise ValueError(
            f"mxfp8_a2a_kernel_choice={kernel!r} is not a cast kernel; expected 'auto' or one of "
            f"{list(CAST_KERNELS)}"
        )
    if transport not in TRANSPORTS:
        raise ValueError(
            f"a2a_transport={transport!r} is not a transport; expected one of {list(TRANSPORTS)}"
        )


class MXFP8AllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher with MXFP8 token exchanges (module docstring).

    Rows are (tokens, dim) bf16/fp32 with dim % 32 == 0. Outside torch.compile only (the
    exchange's splits live on the host).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        mxfp8_a2a_kernel_choice: str = "auto"
        """Cast kernel of the exchange's quantize / dequantize: "auto" | "triton" | "cuda" | "torch"."""
        a2a_transport: str = "auto"
        """mxmoe.comm transport: "auto" (symmetric memory between GPUs of one host where it can
        run, else the process group) | "symm" | "nccl" (the process group: NCCL, or gloo on CPU)."""
        mx_rows: bool = False
        """Hand bf16 rows to the experts as received, an MXTensor (no dequantize, no requantize
        in the expert GEMMs). Set by the converters when the sibling experts take them
        (`link_mx_rows`); same results as the dequantized rows."""

    def __init__(self, config: Config):
        super().__init__(config)
        _check_choices(config.mxfp8_a2a_kernel_choice, config.a2a_transport)
        # the exchange's format is the default one (e4m3, RCEIL, blocks of 32); the option picks its kernel
        self.a2a_recipe = DEFAULT_RECIPE.replace(dim0_kernel=config.mxfp8_a2a_kernel_choice)
        self.transport = config.a2a_transport
        self.mx_rows = config.mx_rows

    def _dispatch_token_exchange(
        self, routed_input_ND: Tensor, pg, output_splits: list[int], input_splits: list[int]
    ) -> Tensor:
        # The splits come from torchtitan's count exchange, equal across ranks by construction:
        # skip mxmoe's own cross-rank check (an all_gather and a host sync per call).
        mx = a2a_dispatch_mxfp8(
            routed_input_ND,
            output_splits,
            input_splits,
            pg,
            check=False,
            recipe=self.a2a_recipe,
            transport=self.transport,
        )
        if self.mx_rows and routed_input_ND.dtype == torch.bfloat16:
            return mx  # (R, D) MXTensor blocked along D; gradient through mx.grad_anchor
        rows = mx.dequantize(recipe=self.a2a_recipe)
        return RowsFromAnchor.apply(mx.grad_anchor, rows)

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        if not isinstance(routed_input_RD, MXTensor):
            return super()._permute(routed_input_RD, num_global_tokens_per_local_expert_E)
        # torchtitan's index computation, run on a (R, 0) stand-in; the MX rows are gathered
        # (elements and scales) with their gradient anchor.
        R, D = routed_input_RD.shape
        stand_in = torch.empty((R, 0), device=routed_input_RD.device)
        _, _, permuted_indices, counts = super()._permute(stand_in, num_global_tokens_per_local_expert_E)
        return torch.Size((R, D)), routed_input_RD.index_rows(permuted_indices), permuted_indices, counts

    def _combine_token_exchange(
        self, routed_output_RD: Tensor, pg, input_splits: list[int], output_splits: list[int]
    ) -> Tensor:
        # torchtitan's combine sends with the dispatch's splits swapped.
        return a2a_combine(
            routed_output_RD.contiguous(),
            input_splits,
            output_splits,
            pg,
            check=False,
            recipe=self.a2a_recipe,
            transport=self.transport,
        )


class MXFP8TokenDispatcherConverter(ModelConfigConverter):
    """Swap every plain `AllToAllTokenDispatcher.Config` (torchtitan's "standard" EP backend) for
    `MXFP8AllToAllTokenDispatcher.Config`. Other dispatchers (DeepEP, HybridEP, TorchAO's padded
    one, MinimalAsyncEP) are left alone and named in the log line."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        mxfp8_a2a_kernel_choice: str = "auto"
        a2a_transport: str = "auto"

    def __init__(self, config: Config):
        self.config = config
        _check_choices(config.mxfp8_a2a_kernel_choice, config.a2a_transport)

    def convert(self, model_config):
        from torchtitan.models.common.moe import RoutedExperts

        swapped, kept = 0, []
        for fqn, routed, _parent, _attr in list(model_config.traverse(RoutedExperts.Config)):
            d = routed.token_dispatcher
            if type(d) is AllToAllTokenDispatcher.Config:
                routed.token_dispatcher = mxfp8_dispatcher_config(d, **self._kwargs())
                swapped += 1
            elif not isinstance(d, MXFP8AllToAllTokenDispatcher.Config):
                kept.append(f"{fqn}.token_dispatcher ({type(d).__qualname__})")
            link_mx_rows(routed)
        log.info(
            "mxmoe: %d token dispatchers -> MXFP8 all-to-all; kept: %s", swapped, ", ".join(kept) or "none"
        )
        return model_config

    def _kwargs(self) -> dict:
        return {
            "mxfp8_a2a_kernel_choice": self.config.mxfp8_a2a_kernel_choice,
            "a2a_transport": self.config.a2a_transport,
        }


def link_mx_rows(routed_experts_config) -> None:
    """Let an MXFP8 dispatcher hand MX rows to its sibling experts when they take them
    (`takes_mx_rows`); called by both converters, whichever runs last decides."""
    d = routed_experts_config.token_dispatcher
    if isinstance(d, MXFP8AllToAllTokenDispatcher.Config):
        d.mx_rows = takes_mx_rows(routed_experts_config.inner_experts)


def mxfp8_dispatcher_config(
    cfg: AllToAllTokenDispatcher.Config, *, mxfp8_a2a_kernel_choice: str = "auto", a2a_transport: str = "auto"
) -> MXFP8AllToAllTokenDispatcher.Config:
    """The MXFP8 dispatcher config for torchtitan's all-to-all dispatcher config `cfg`."""
    _check_choices(mxfp8_a2a_kernel_choice, a2a_transport)
    return MXFP8AllToAllTokenDispatcher.Config(
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        mxfp8_a2a_kernel_choice=mxfp8_a2a_kernel_choice,
        a2a_transport=a2a_transport,
    )
