"""Token routing through the experts, locally or with expert parallelism (all-to-all).

Flow for T tokens, top-k, E experts, EP degree `ep` (E_l = E / ep experts per rank):
  1. sort the T*k assignments by global expert id (so also by destination rank);
  2. ep > 1: exchange the per-expert counts (all_to_all_single on E int64), then the token rows
     (MXFP8 `a2a_dispatch_mxfp8` when the experts take MX input, else the bf16 `all_to_all_hp`);
     received rows are (source rank, local expert)-major and get permuted to local-expert-major;
  3. the grouped experts run on rows grouped by expert;
  4. ep > 1: rows are permuted back and returned by `a2a_combine` / `all_to_all_hp`;
  5. each output row is scaled by its gate weight and summed into its token (index_add, fp32).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn


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


def routed_experts(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    experts: nn.Module,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    ep_size: int = 1,
) -> Tensor:
    """x (T, D) tokens, idx (T, k) int64 global expert ids, weights (T, k) fp32 gate weights ->
    (T, D) in x's dtype: sum_j weights[t, j] * expert_{idx[t, j]}(x[t]).

    `experts` holds all E experts (group None / ep_size 1) or this rank's E / ep_size of them.
    `experts(rows, counts)` evaluates the experts on rows grouped by expert.
    """
    T, D = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)
    perm = torch.argsort(flat, stable=True)  # (T*k,) assignment order grouped by expert
    token_of = perm // k
    counts = torch.bincount(flat, minlength=num_experts)  # (E,) int64
    x_sorted = x.index_select(0, token_of)  # (T*k, D)
    if group is None or ep_size == 1:
        y = experts(x_sorted, counts)
    else:
        y = _ep_experts(x_sorted, counts, experts, group, ep_size)
    y = y.float() * weights.reshape(-1).index_select(0, perm).unsqueeze(-1)
    return y.new_zeros(T, D).index_add_(0, token_of, y).to(x.dtype)


def _ep_experts(x_sorted: Tensor, counts: Tensor, experts: nn.Module, group, ep: int) -> Tensor:
    """Rows (N, D) grouped by global expert -> expert outputs (N, D), experts sharded over `group`."""
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
    if getattr(experts, "accepts_mx_input", False):
        from mxmoe.comm import a2a_combine, a2a_dispatch_mxfp8

        # MXTensor, source-major
        xr = a2a_dispatch_mxfp8(x_sorted, output_splits, input_splits, group, check=False)
        y = experts(xr.index_rows(index), local_counts)
        return a2a_combine(y.index_select(0, inverse), input_splits, output_splits, group, check=False)
    from mxmoe.comm import all_to_all_hp

    xr = all_to_all_hp(x_sorted, output_splits, input_splits, group, check=False)
    y = experts(xr.index_select(0, index), local_counts)
    return all_to_all_hp(y.index_select(0, inverse), input_splits, output_splits, group, check=False)
