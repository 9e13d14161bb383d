"""Expert parallelism as a strategy applied from outside.

Every MoE layer runs `mxmoe.models.routing.routed_experts`; which experts run where is the
`dispatch` strategy the MoE layer holds (`MoE.dispatch`):
  - `LocalExperts` (the default, `mxmoe.models.routing`): all E experts here;
  - `ExpertParallel(group)`, installed by `apply_expert_parallel(model, group)` (as torchtitan's
    ExpertParallel ParallelStyle): each rank of `group` keeps E / ep experts, and tokens travel to
    them by all-to-all. For MX experts (`MXGroupedExperts`) the rows go as MXFP8 in the experts'
    recipe (`a2a_dispatch_mxfp8`, used by the first grouped GEMM without requantizing) and come back
    in high precision with an MXFP8 gradient (`a2a_combine`); otherwise both ways in high precision
    (`all_to_all_hp`). The same exchange serves MX experts whose recipe has expert_gemm="bf16" (the
    exchange only): they dequantize the received rows exactly and run bf16 grouped GEMMs, the
    gradient of the rows goes back in high precision.

Flow for T tokens, top-k, E experts, EP degree `ep` (E_l = E / ep experts per rank):
  1. sort the T*k assignments by global expert id (so also by destination rank);
  2. ep > 1: exchange the per-expert counts (all_to_all_single on E int64), then the token rows;
     received rows are (source rank, local expert)-major and get permuted to local-expert-major;
  3. the grouped experts run on rows grouped by expert;
  4. ep > 1: rows are permuted back and returned;
  5. rows go back to assignment order (the inverse permutation), are scaled by their gate weights
     and summed over the top-k in fp32 in a fixed order (deterministic: no atomics, see below).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mxmoe.models.moe import MoE
from mxmoe.models.routing import LocalExperts
from mxmoe.nn.mx_experts import MXGroupedExperts


def expert_major_index(recv_counts: Tensor) -> Tensor:
    """recv_counts (ep, E_l) int64: rows received from source s for local expert e, laid out
    source-major. Returns index (N,) int64 with `received[index]` grouped by local expert (and by
    source within an expert)."""
    ep, El = recv_counts.shape
    flat = recv_counts.reshape(-1)
    n = int(flat.sum())
    starts = (torch.cumsum(flat, 0) - flat).view(ep, El).t().reshape(-1)  # segment start, src-major
    lens = recv_counts.t().reshape(-1)  # segment lengths in expert-major order
    out_starts = torch.cumsum(lens, 0) - lens
    shift = torch.repeat_interleave(starts - out_starts, lens, output_size=n)
    return torch.arange(n, device=recv_counts.device) + shift


class ExpertParallel:
    """Experts sharded over `group` (ep ranks, E / ep experts each), tokens moved by all-to-all.

    `apply(moe)` shards the layer's experts (rank r of the group keeps experts [r E/ep, (r+1) E/ep)
    of the full set, which must be identical on every rank) and installs this strategy as
    `moe.dispatch`. transport, chunks: of the MXFP8 exchanges (mxmoe.comm.to_mxfp8_a2a_dequant).
    """

    def __init__(self, group: dist.ProcessGroup, *, transport: str = "auto", chunks: int | None = None):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.transport, self.chunks = transport, chunks

    def apply(self, moe: nn.Module) -> None:
        """Shard `moe.experts` (call once per MoE layer, on every rank) and install this dispatch."""
        ex, ep = moe.experts, self.ep_size
        if moe.num_experts % ep:
            raise ValueError(
                f"num_experts={moe.num_experts} is not divisible by the expert-parallel degree {ep}"
            )
        if ex.num_experts != moe.num_experts or not isinstance(moe.dispatch, LocalExperts):
            raise RuntimeError("apply_expert_parallel: the experts of this MoE layer are already sharded")
        n = moe.num_experts // ep
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                full = getattr(ex, name)
                setattr(ex, name, nn.Parameter(full[self.ep_rank * n : (self.ep_rank + 1) * n].clone()))
        ex.num_experts = n
        moe.dispatch = self

    def __call__(self, x_sorted: Tensor, counts: Tensor, experts: nn.Module) -> Tensor:
        """Rows (N, D) grouped by global expert, counts (E,) int64 -> expert outputs (N, D)."""
        from mxmoe.comm import a2a_combine, a2a_dispatch_mxfp8, all_to_all_hp

        group, ep = self.group, self.ep_size
        E = counts.numel()
        El = E // ep
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # chunk s: counts of source s for my experts
        recv = recv_counts.view(ep, El)
        input_splits = counts.view(ep, El).sum(1).tolist()
        output_splits = recv.sum(1).tolist()
        index = expert_major_index(recv)
        inverse = torch.empty_like(index)
        inverse[index] = torch.arange(index.numel(), device=index.device)
        local_counts = recv.sum(0)
        if x_sorted.is_cuda and torch.is_autocast_enabled("cuda"):  # exchange bf16, not fp32, rows
            x_sorted = x_sorted.to(torch.get_autocast_dtype("cuda"))
        # The splits come from the counts exchange above, so they agree across ranks by construction:
        # skip the exchanges' own cross-rank check (one all_gather and a host sync per call).
        if isinstance(experts, MXGroupedExperts):
            kw = {"check": False, "transport": self.transport, "chunks": self.chunks}
            r = experts.recipe
            xr = a2a_dispatch_mxfp8(x_sorted, output_splits, input_splits, group, recipe=r, **kw)
            y = experts(xr.index_rows(index), local_counts)  # an MXTensor, source-major -> expert-major
            return a2a_combine(y.index_select(0, inverse), input_splits, output_splits, group, recipe=r, **kw)
        xr = all_to_all_hp(x_sorted, output_splits, input_splits, group, check=False)
        y = experts(xr.index_select(0, index), local_counts)
        return all_to_all_hp(y.index_select(0, inverse), input_splits, output_splits, group, check=False)

    def __repr__(self) -> str:
        return f"ExpertParallel(ep={self.ep_size}, rank={self.ep_rank}, transport={self.transport!r})"


def apply_expert_parallel(
    model: nn.Module, group: dist.ProcessGroup, *, transport: str = "auto", chunks: int | None = None
) -> nn.Module:
    """Expert parallelism over `group` for every MoE layer of `model` (in place; returns `model`).

    Call on every rank of `group` after building the model identically (same seed), before or after
    `mxmoe.convert` (the dispatch reads the experts' type and recipe at each call). Each layer keeps
    experts [r E/ep, (r+1) E/ep) for group rank r; parameter names are unchanged.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"apply_expert_parallel: {type(model).__name__} has no MoE layer")
    for moe in layers:
        ExpertParallel(group, transport=transport, chunks=chunks).apply(moe)
    return model
