"""Token routing through the experts: what every MoE layer runs, whatever its parallelism.

`routed_experts` sorts the token->expert assignments by expert, runs the experts on the sorted rows
through the layer's `dispatch` strategy, scales by the gate weights and sums back into the tokens.
`LocalExperts` is the default dispatch (all E experts here): no host sync anywhere, so the step
compiles with fullgraph=True and can be captured in a CUDA graph (row counts are static: T * top_k).
Expert parallelism installs another dispatch (`mxmoe.models.expert_parallel.ExpertParallel`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def expert_counts(idx: Tensor, num_experts: int) -> Tensor:
    """idx (...) int64 expert ids in [0, num_experts) -> (num_experts,) int64 counts. A scatter-add
    with a static output size: no host sync (torch.bincount syncs on CUDA), compiles fullgraph."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


class LocalExperts:
    """The default dispatch: every expert is on this rank. __call__(rows (N, D) grouped by expert,
    counts (E,) int64, experts) -> (N, D) experts(rows, counts)."""

    def __call__(self, x_sorted: Tensor, counts: Tensor, experts: nn.Module) -> Tensor:
        return experts(x_sorted, counts)

    def __repr__(self) -> str:
        return "LocalExperts()"


def routed_experts(
    x: Tensor,
    idx: Tensor,
    weights: Tensor,
    experts: nn.Module,
    num_experts: int,
    dispatch=None,
) -> Tensor:
    """x (T, D) tokens, idx (T, k) int64 global expert ids, weights (T, k) fp32 gate weights ->
    (T, D) in x's dtype: sum_j weights[t, j] * expert_{idx[t, j]}(x[t]).

    `dispatch(rows, counts, experts)` runs the experts on the rows grouped by global expert
    (default `LocalExperts`: `experts` holds all E experts). No host sync with the default dispatch.
    """
    T, D = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)  # assignment a = t * k + j
    perm = torch.argsort(flat, stable=True)  # (T*k,) assignment order grouped by expert
    # Deterministic by construction (no accumulation whose order varies, forward or backward): the
    # rows move by permutation gathers, whose backward adds one row into each zero row, and each
    # token's k rows are summed by a reduction over j in a fixed order. A gather by token (backward:
    # index_add of k rows per token) and an index_add combine would add in the order the GPU's atomics
    # land. For k = 2 the sums are the same bits either way (a + b == b + a).
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    counts = expert_counts(flat, num_experts)  # (E,) int64
    x_rep = x.unsqueeze(1).expand(T, k, D).reshape(T * k, D)  # (T*k, D) row a = x[a // k]
    x_sorted = x_rep.index_select(0, perm)  # (T*k, D) grouped by expert
    y = (LocalExperts() if dispatch is None else dispatch)(x_sorted, counts, experts)
    y = y.index_select(0, inv).view(T, k, D).float()  # back to assignment order
    return (y * weights.unsqueeze(-1)).sum(1).to(x.dtype)
