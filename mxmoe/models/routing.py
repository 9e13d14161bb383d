"""Token routing through the experts: what every MoE layer runs, whatever its parallelism.

`routed_experts` hands the tokens, their top-k expert ids and gate weights to the layer's token
dispatcher (the seam, `mxmoe.token_dispatch.TokenDispatcher`), runs the experts on the rows it
returns and combines their outputs back into the tokens. `LocalExperts` is the default dispatcher
(all E experts here): no host sync anywhere, so the step compiles with fullgraph=True and can be
captured in a CUDA graph (row counts are static: T * top_k). Expert parallelism installs another
(`mxmoe.models.expert_parallel.ExpertParallel`).
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from mxmoe.token_dispatch import (
    UNQUANTIZED,
    ExpertRows,
    LocalDispatcher,
    expert_counts,
    sort_by_expert,
    weighted_sum,
)

__all__ = ["LocalExperts", "expert_counts", "expert_rows", "routed_experts"]


class LocalExperts(LocalDispatcher):
    """The default dispatcher: every expert is on this rank (`LocalDispatcher`). Called as the
    rows-level strategy of before, `(rows (N, D) grouped by expert, counts (E,), experts)`, it runs
    the experts on them."""

    def __call__(self, x_sorted: Tensor, counts: Tensor, experts: nn.Module) -> Tensor:
        return experts(x_sorted, counts)


def expert_rows(experts: nn.Module) -> ExpertRows:
    """What `experts` take from a dispatch: MX experts (`MXGroupedExperts`) their recipe's MX rows,
    as an MXTensor; others rows in their own dtype."""
    from mxmoe.nn.mx_experts import MXGroupedExperts

    return ExpertRows(experts.recipe) if isinstance(experts, MXGroupedExperts) else UNQUANTIZED


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

    `dispatch`: the token dispatcher (`TokenDispatcher`; default `LocalExperts`: `experts` holds
    all E experts). No host sync with the default dispatcher.
    """
    d = LocalExperts() if dispatch is None else dispatch
    if not hasattr(d, "dispatch"):  # a strategy of the old API: d(rows sorted by expert, counts, experts)
        warnings.warn(
            f"{type(d).__name__}: a dispatch strategy called as (rows, counts, experts) is the old API; "
            "implement mxmoe.token_dispatch.TokenDispatcher (dispatch / combine)",
            DeprecationWarning,
            stacklevel=2,
        )
        rows, counts, h = sort_by_expert(x, idx, weights, num_experts)
        return weighted_sum(d(rows, counts, experts), h)
    rows, counts, h = d.dispatch(x, idx, weights, num_experts=num_experts, rows_as=expert_rows(experts))
    return d.combine(experts(rows, counts), h)
