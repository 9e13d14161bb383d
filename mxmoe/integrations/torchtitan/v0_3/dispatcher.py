"""A torchtitan 0.3 token dispatcher whose expert-parallel exchange is mxmoe's (the dispatch seam,
`mxmoe.token_dispatch`).

`MXFP8AllToAllTokenDispatcher` is torchtitan's `AllToAllTokenDispatcher` whose exchange goes
through mxmoe's seam at the rows stage: torchtitan's local reorder (tokens sorted by expert) and its
combine (scores, deterministic scatter-add) are kept, and between them
`AllToAllDispatcher.exchange_rows` / `return_rows` exchange the counts and the rows, and put the
received rows in local-expert order:

  dispatch  forward: rows quantized to MXFP8 in the experts' recipe (e4m3, RCEIL, blocks of 32 along
            the model dim by default), element and scale bytes exchanged (1 + 1/32 bytes per element
            on the wire, not 2), handed to MX experts that take them as MX data or dequantized;
            backward: the rows' gradient exchanged in its own dtype (straight-through).
  combine   forward: expert outputs exchanged in their own dtype; backward: their gradient
            exchanged in MXFP8.

With `mxfp8_a2a = false` both go in the rows' dtype. This is the split mxmoe's own expert
parallelism and its torchtitan 0.2 adapter use: what crosses the wire in MXFP8 is what the MX expert
GEMMs quantize along the same axis anyway. The collectives are custom ops (`mxmoe.comm.custom_ops`):
torchtitan's `--compile.enable` (each block compiled with fullgraph=True) traces through them. With
EP = 1 there is no exchange and it dispatches locally, as torchtitan's. It is swapped in the way
torchtitan swaps its own dispatchers: a `Config` in the tree's `RoutedExperts.token_dispatcher` slot
(`MXMoEConverter`, `MXFP8TokenDispatcherConverter`, or the `mxmoe_a2a` override).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    LocalDispatchMetadata,
    LocalTokenDispatcher,
)
from torchtitan.protocols.model import ModelConfigConverter

from mxmoe.comm.a2a_dispatcher import ExchangeHandle, make_dispatcher
from mxmoe.comm.transport import check_transport
from mxmoe.integrations.torchtitan.common import RECIPE_FIELDS, check_kernels, options_of, same_format
from mxmoe.integrations.torchtitan.v0_3.fields import finish_conversion, options_fields, recipe_of
from mxmoe.nn.converter import ConversionReport
from mxmoe.options import MXOptions
from mxmoe.token_dispatch import ExpertRows, describe_exchange

log = logging.getLogger("mxmoe")
_LOGGED = False
"""Whether the model last converted (`convert_dispatchers`) has logged its exchange."""

EXCHANGE_FIELDS = (*RECIPE_FIELDS, "mxfp8_a2a", "a2a_transport")
"""The MXOptions fields the dispatcher's Config carries: the recipe of MXFP8 rows and the exchange."""
ExchangeFields = options_fields("ExchangeFields", EXCHANGE_FIELDS)

RENAMED = {"mxfp8_a2a_kernel_choice": "mxfp8_dim0_cast_kernel_choice"}
"""Old dispatcher options -> the MXOptions field that replaced them."""


@dataclass(frozen=True, kw_only=True)
class MXFP8DispatchMetadata(LocalDispatchMetadata):
    """What `MXFP8AllToAllTokenDispatcher.combine` needs: torchtitan's local order and scores, and
    mxmoe's exchange handle."""

    exchange: ExchangeHandle

    @property
    def input_splits(self) -> list[int]:
        """Rows sent to each rank (a host read, for inspection)."""
        return self.exchange.send.tolist()

    @property
    def output_splits(self) -> list[int]:
        """Rows received from each rank (a host read, for inspection)."""
        return self.exchange.recv.tolist()


class MXFP8AllToAllTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's all-to-all token dispatcher with mxmoe's exchange (module docstring).

    Rows are (tokens, dim) bf16/fp32 with dim % block_size == 0. Its Config carries MXOptions'
    recipe and exchange fields (`EXCHANGE_FIELDS`) and `mx_rows`; the module keeps its recipe as
    `.recipe`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config, ExchangeFields):
        mx_rows: bool = False
        """Hand bf16 rows to the experts as received, an MXTensor (no dequantize, no requantize
        in the expert GEMMs). Set by the converters when the sibling experts take them
        (`link_mx_rows`); the same results as dequantized rows."""

    def __init__(self, config: Config):
        super().__init__(config)
        options = options_of(config)
        self.recipe = options.to_recipe()
        self.mxfp8 = options.mxfp8_a2a
        self.transport = check_transport(options.a2a_transport, "a2a_transport")
        self.mx_rows = config.mx_rows
        self.exchange = None

    def wire_meshes(self, *, ep_mesh) -> None:
        super().wire_meshes(ep_mesh=ep_mesh)
        # mxmoe's dispatcher over the EP group, its transport resolved now, outside compiled code
        self.exchange = None
        if ep_mesh is not None:
            d = make_dispatcher(ep_mesh.get_group(), transport=self.transport, mxfp8=self.mxfp8)
            if not hasattr(d, "exchange_rows"):
                raise ValueError(
                    f"a2a_transport={self.transport!r} moves tokens itself; this dispatcher keeps "
                    "torchtitan's token order and exchanges rows: choose a row transport ('auto', "
                    "'nccl', 'symm')"
                )
            self.exchange = d
            global _LOGGED
            if not _LOGGED:  # one line per process: every MoE layer has the same options
                log.info("mxmoe: %s", describe_exchange(d, ExpertRows(self.recipe)))
                _LOGGED = True

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if self.ep_mesh is None:
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        routed_ND, token_indices_N, scores_N = self._local_reorder(x_TD, topk_scores_TK, topk_expert_ids_TK)
        # MX rows to the experts only from bf16 rows: the MX experts quantize bf16 (torchtitan's
        # experts cast to bf16), so MX rows of fp32 would not be what they quantize
        rows_as = ExpertRows(self.recipe, as_mx=self.mx_rows and routed_ND.dtype == torch.bfloat16)
        rows_RD, counts_e, handle = self.exchange.exchange_rows(
            routed_ND, num_local_tokens_per_expert_E, rows_as=rows_as
        )
        meta = MXFP8DispatchMetadata(
            token_indices_experts_sorted_N=token_indices_N,
            topk_scores_experts_sorted_N=scores_N,
            exchange=handle,
        )
        return rows_RD, counts_e, meta

    def combine(self, routed_output_RD: Tensor, metadata, x_TD: Tensor) -> Tensor:
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        routed_ND = self.exchange.return_rows(routed_output_RD.contiguous(), metadata.exchange)
        return LocalTokenDispatcher.combine(self, routed_ND, metadata, x_TD)


def mxfp8_dispatcher_config(cfg: AllToAllTokenDispatcher.Config, options: MXOptions | None = None, **changes):
    """The MXFP8 dispatcher config for torchtitan's all-to-all dispatcher config `cfg`, with the
    exchange fields of `options` (default MXOptions()) and `changes` (MXOptions field names; an old
    name is refused naming its replacement)."""
    for old, new in RENAMED.items():
        if old in changes:
            raise ValueError(f"{old} is now {new} (the exchange's cast kernel is the recipe's dim0 kernel)")
    options = options_of(options if options is not None else MXOptions(), **changes)
    return MXFP8AllToAllTokenDispatcher.Config(
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        **{name: getattr(options, name) for name in EXCHANGE_FIELDS},
    )


def link_mx_rows(routed_experts_config) -> None:
    """Let an MXFP8 dispatcher hand MX rows to its sibling experts when they take them: MX experts
    with torchtitan's SwiGLU forward whose recipe quantizes as the exchange does (element dtype,
    block size, scaling mode); called by the converters, whichever runs last decides."""
    d = routed_experts_config.token_dispatcher
    if not isinstance(d, MXFP8AllToAllTokenDispatcher.Config):
        return
    experts = routed_experts_config.inner_experts
    owner = getattr(type(experts), "_owner", None)
    takes = bool(getattr(owner, "ACCEPTS_MX_ROWS", False))
    d.mx_rows = takes and same_format(recipe_of(experts), recipe_of(d))


def convert_dispatchers(model_config, options: MXOptions, report: ConversionReport):
    """Every plain `AllToAllTokenDispatcher.Config` (torchtitan's "standard" EP backend) of
    `model_config` -> `MXFP8AllToAllTokenDispatcher.Config` with `options`' exchange fields,
    recorded in `report`; other dispatchers (DeepEP, HybridEP, TorchAO's padded one, MinimalAsyncEP)
    are left alone and recorded as skipped. Returns the config."""
    from torchtitan.models.common.moe import RoutedExperts

    global _LOGGED
    _LOGGED = False  # the model being converted logs its exchange once

    kind = "AllToAllTokenDispatcher"
    report.converted.setdefault(kind, [])
    for fqn, routed, _parent, _attr in list(model_config.traverse(RoutedExperts.Config)):
        d = routed.token_dispatcher
        if type(d) is AllToAllTokenDispatcher.Config:
            routed.token_dispatcher = mxfp8_dispatcher_config(d, options)
            report.converted[kind].append(f"{fqn}.token_dispatcher")
        elif isinstance(d, MXFP8AllToAllTokenDispatcher.Config):  # converted before: given `options`
            same = recipe_of(d) == report.recipe
            (report.already if same else report.reconfigured).append(f"{fqn}.token_dispatcher")
            routed.token_dispatcher = mxfp8_dispatcher_config(d, options)
        else:
            why = f"{type(d).__qualname__}: not the all-to-all one"
            report.skipped.append((f"{fqn}.token_dispatcher", why))
        link_mx_rows(routed)
    return model_config


ConversionReport.MX_NAMES.setdefault("AllToAllTokenDispatcher", "mxmoe's exchange")


class MXFP8TokenDispatcherConverter(ModelConfigConverter):
    """Swap every plain `AllToAllTokenDispatcher.Config` for `MXFP8AllToAllTokenDispatcher.Config`
    (`convert_dispatchers`), with MXOptions' exchange fields (its Config is MXOptions)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config, MXOptions):
        pass

    def __init__(self, config: Config):
        self.config = config
        self.options = options_of(config)
        # the exchange casts with the recipe's dim0 kernel: one this machine cannot run stops now
        check_kernels(self.options, type(self).__name__)
        self.recipe = self.options.to_recipe()

    def convert(self, model_config):
        report = ConversionReport(self.recipe, converted={})
        model_config = convert_dispatchers(model_config, self.options, report)
        finish_conversion(model_config, self.options, report, type(self).__name__)
        return model_config
