"""Expert parallelism as a strategy applied from outside.

Every MoE layer runs `mxmoe.models.routing.routed_experts` through the token dispatcher it holds
(`MoE.dispatch`, the seam `mxmoe.token_dispatch.TokenDispatcher`):
  - `LocalExperts` (the default, `mxmoe.models.routing`): all E experts here;
  - `ExpertParallel(group)`, installed by `apply_expert_parallel(model, group)` (as torchtitan's
    ExpertParallel ParallelStyle): each rank of `group` keeps E / ep experts, and tokens travel to
    them through the dispatcher of the transport chosen by name (`mxmoe.comm.transport`; "auto":
    symmetric memory between GPUs of one host where it runs, else the process group). For MX
    experts (`MXGroupedExperts`) the rows go as MXFP8 in the experts' recipe (used by the first
    grouped GEMM without requantizing) and come back in high precision with an MXFP8 gradient;
    otherwise (or with `mxfp8=False`) both ways in the rows' dtype. The same exchange serves MX
    experts whose recipe has expert_gemm="bf16" (the exchange only): they dequantize the received
    rows exactly and run bf16 grouped GEMMs; the gradient of the rows goes back in high precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mxmoe.comm.a2a_dispatcher import expert_major_index, make_dispatcher
from mxmoe.models.moe import MoE
from mxmoe.models.routing import LocalExperts, expert_rows
from mxmoe.token_dispatch import UNQUANTIZED, ExpertRows

__all__ = ["ExpertParallel", "apply_expert_parallel", "expert_major_index"]


class ExpertParallel:
    """Experts sharded over `group` (ep ranks, E / ep experts each), tokens moved by the token
    dispatcher of `transport` (a `TokenDispatcher` itself, by delegation).

    `apply(moe)` shards the layer's experts (rank r of the group keeps experts [r E/ep, (r+1) E/ep)
    of the full set, which must be identical on every rank) and installs this strategy as
    `moe.dispatch`. transport: "auto" or a registered transport (`mxmoe.comm.TRANSPORTS`), the same
    on every rank. mxfp8: send MX experts' rows (and the combine's gradient) as MXFP8 (False: in the
    rows' dtype). chunks: the NCCL pipeline's pieces (mxmoe.comm.to_mxfp8_a2a_dequant).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        transport: str = "auto",
        chunks: int | None = None,
        mxfp8: bool = True,
    ):
        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group gives a rank outside it
            raise ValueError(
                "ExpertParallel: this process is not a member of group (dist.new_group returned "
                "GroupMember.NON_GROUP_MEMBER on it): apply expert parallelism on the group's ranks only, "
                "with the group they share"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"ExpertParallel: group must be a torch.distributed.ProcessGroup (e.g. "
                f"mesh.get_group('ep')) or None for the default group, got {type(group).__name__}"
            )
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.transport, self.chunks, self.mxfp8 = transport, chunks, mxfp8
        self.dispatcher = make_dispatcher(group, transport=transport, mxfp8=mxfp8, chunks=chunks)
        """The transport's token dispatcher (resolved here, once, outside any compiled region)."""

    def check(self, moe: nn.Module, name: str = "") -> None:
        """The errors `apply(moe)` raises, before anything changes (`name`: the layer's, for them)."""
        where = f"{name}: " if name else ""
        if moe.num_experts % self.ep_size:
            raise ValueError(
                f"{where}num_experts={moe.num_experts} is not divisible by the expert-parallel degree "
                f"{self.ep_size}"
            )
        if moe.experts.num_experts != moe.num_experts or not isinstance(moe.dispatch, LocalExperts):
            raise RuntimeError(
                f"apply_expert_parallel: {where}the experts of this MoE layer are already sharded"
            )

    def apply(self, moe: nn.Module) -> None:
        """Shard `moe.experts` (call once per MoE layer, on every rank) and install this dispatch."""
        self.check(moe)
        ex, ep = moe.experts, self.ep_size
        n = moe.num_experts // ep
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                full = getattr(ex, name)
                setattr(ex, name, nn.Parameter(full[self.ep_rank * n : (self.ep_rank + 1) * n].clone()))
        ex.num_experts = n
        moe.dispatch = self

    def dispatch(
        self, x: Tensor, idx: Tensor, scores: Tensor, *, num_experts: int, rows_as: ExpertRows = UNQUANTIZED
    ):
        return self.dispatcher.dispatch(x, idx, scores, num_experts=num_experts, rows_as=rows_as)

    def combine(self, y: Tensor, handle) -> Tensor:
        return self.dispatcher.combine(y, handle)

    def __call__(self, x_sorted: Tensor, counts: Tensor, experts: nn.Module) -> Tensor:
        """The rows-level call: rows (N, D) grouped by global expert, counts (E,) -> the experts'
        outputs (N, D), the experts run on this rank's rows (a row transport's dispatcher)."""
        if not hasattr(self.dispatcher, "exchange_rows"):
            raise TypeError(
                f"transport={self.transport!r} moves tokens itself: call dispatch / combine, not the "
                "rows-level ExpertParallel(rows, counts, experts)"
            )
        rows, local_counts, h = self.dispatcher.exchange_rows(x_sorted, counts, rows_as=expert_rows(experts))
        return self.dispatcher.return_rows(experts(rows, local_counts), h)

    def __repr__(self) -> str:
        return (
            f"ExpertParallel(ep={self.ep_size}, rank={self.ep_rank}, transport={self.transport!r}, "
            f"mxfp8={self.mxfp8})"
        )


def apply_expert_parallel(
    model: nn.Module,
    group: dist.ProcessGroup,
    *,
    transport: str = "auto",
    chunks: int | None = None,
    mxfp8: bool = True,
) -> nn.Module:
    """Expert parallelism over `group` for every MoE layer of `model` (in place; returns `model`).

    Call on every rank of `group` after building the model identically (same seed), before or after
    `mxmoe.convert` (the dispatch reads the experts' type and recipe at each call). Each layer keeps
    experts [r E/ep, (r+1) E/ep) for group rank r; parameter names are unchanged. transport, chunks,
    mxfp8: as in `ExpertParallel` (the trainer passes `--mx.a2a_transport` and `--mx.mxfp8_a2a`).
    A layer it cannot shard (its experts not divisible by the group's size, or sharded already) is
    an error naming it, raised before any layer changes.
    """
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"apply_expert_parallel: {type(model).__name__} has no MoE layer")
    strategies = [ExpertParallel(group, transport=transport, chunks=chunks, mxfp8=mxfp8) for _ in layers]
    for (name, moe), ep in zip(layers, strategies, strict=True):  # every layer checked before any changes
        ep.check(moe, name)
    for (_, moe), ep in zip(layers, strategies, strict=True):
        ep.apply(moe)
    return model
