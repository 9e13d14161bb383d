"""The dispatch seam of a MoE layer: tokens, their top-k expert ids and gate scores in; rows grouped
by expert and per-expert counts out, for the experts; a combine back to the tokens.

    rows, counts, handle = dispatcher.dispatch(x, idx, scores, num_experts=E, rows_as=ExpertRows(...))
    y = experts(rows, counts)
    out = dispatcher.combine(y, handle)

x (T, D) tokens; idx (T, k) int64 global expert ids; scores (T, k) gate weights (fp32). rows
(R, D) grouped by the experts held here (all E, or this rank's E / ep), a Tensor or, for MX experts
that take them, an `MXTensor`; counts (E_here,) int64 rows per expert; y (R, D) the experts'
outputs; out (T, D) in x's dtype: sum_j scores[t, j] * expert_{idx[t, j]}(x[t]).

Every implementation of `TokenDispatcher` serves every MoE layer: mxmoe's own (`mxmoe.models`),
and the exchanges of the torchtitan adapters (which keep their framework's own token ordering and
combine and enter at the rows stage, `AllToAllDispatcher.exchange_rows` / `return_rows`):

- `LocalDispatcher` (here): every expert here (one process, or FSDP only). No host sync, no
  collective.
- `mxmoe.comm.a2a_dispatcher.AllToAllDispatcher`: expert parallelism over a process group; rows
  travel by all-to-all on a row transport chosen by name (`mxmoe.comm.transport.TRANSPORTS`).
- a token-level transport (DeepEP's kind) returns its own from `Transport.dispatcher`.

This module stands below `mxmoe.comm` and `mxmoe.models`: the model's MoE code and the
expert-parallel dispatchers both build on it, and it communicates nothing.

Deterministic by construction (no accumulation whose order varies, forward or backward): rows move
by gathers whose backward is the gather back (each token's k gradients then summed over j in a
fixed order), and each token's k rows are summed by a reduction over j in a fixed order, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.recipe import MXRecipe


@dataclass(frozen=True)
class ExpertRows:
    """What a MoE layer's experts take from a dispatch: rows in their own dtype (`recipe` None), or
    rows quantized with `recipe` (the MX experts' own), handed over as an `MXTensor` (`as_mx`: the
    experts' GEMMs use them without a cast) or dequantized. With expert parallelism and the MXFP8
    exchange on, MX rows cross the wire quantized, and so does the gradient of the experts' output."""

    recipe: MXRecipe | None = None
    as_mx: bool = True


UNQUANTIZED = ExpertRows()
"""Rows in their own dtype (high-precision experts)."""


class TokenDispatcher(Protocol):
    """The seam (module docstring)."""

    def dispatch(
        self, x: Tensor, idx: Tensor, scores: Tensor, *, num_experts: int, rows_as: ExpertRows = UNQUANTIZED
    ) -> tuple[Tensor | MXTensor, Tensor, Any]:
        """x (T, D), idx (T, k) int64, scores (T, k) -> (rows (R, D) grouped by the experts held here,
        counts (E_here,) int64, handle for `combine`)."""
        ...

    def combine(self, y: Tensor, handle: Any) -> Tensor:
        """y (R, D) the experts' outputs, in the dispatched rows' order -> (T, D) in x's dtype."""
        ...


def describe_exchange(dispatcher: TokenDispatcher, rows_as: ExpertRows = UNQUANTIZED) -> str:
    """One line for a run's log: what `dispatcher` sends for experts that take `rows_as` (its own
    `describe` where it has one, as mxmoe's all-to-all does; else its type)."""
    describe = getattr(dispatcher, "describe", None)
    if callable(describe):
        return describe(rows_as)
    return f"expert parallelism through {type(dispatcher).__name__}"


# --------------------------------------------------------------------------------------------
# The seam's argument checks
# --------------------------------------------------------------------------------------------


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_num_experts(num_experts: Any, where: str = "dispatch") -> int:
    """num_experts: an int >= 1; TypeError / ValueError naming it otherwise."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(
            f"{where}: num_experts={num_experts!r} ({type(num_experts).__name__}); expected an int >= 1"
        )
    if num_experts < 1:
        raise ValueError(f"{where}: num_experts={num_experts}; expected an int >= 1")
    return num_experts


def check_dispatch_args(
    x: Any,
    idx: Any,
    scores: Any,
    num_experts: Any,
    rows_as: ExpertRows = UNQUANTIZED,
    *,
    where: str = "dispatch",
    check_ids: bool | None = None,
) -> None:
    """The seam's inputs, checked before any work: x (T, D) floating, idx (T, k) int64, scores
    shaped like idx and floating, num_experts an int >= 1, D a multiple of the block size when the
    experts take MX rows, and (`check_ids`) every id in [0, num_experts). TypeError / ValueError
    naming the argument, the value received and what is expected.

    check_ids None: checked where it costs no device-to-host sync (tensors on the CPU, not while
    torch.compile traces); True: checked (a sync on a GPU); False: not checked.
    """
    E = check_num_experts(num_experts, where)
    for name, t in (("x", x), ("idx", idx), ("scores", scores)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{where}: x has shape {_shape(x)}; expected 2-D (tokens T, dim D)")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{where}: x has dtype {x.dtype}; expected a floating dtype (bf16, fp32, ...)")
    if idx.dtype != torch.int64:
        raise TypeError(f"{where}: idx has dtype {idx.dtype}; expected torch.int64 expert ids")
    if idx.ndim != 2 or idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"{where}: idx has shape {_shape(idx)}; expected 2-D (T, top_k) with T={x.shape[0]} "
            f"(x has shape {_shape(x)})"
        )
    if _shape(scores) != _shape(idx):
        raise ValueError(f"{where}: scores has shape {_shape(scores)}; expected idx's shape {_shape(idx)}")
    if not scores.dtype.is_floating_point:
        raise TypeError(f"{where}: scores has dtype {scores.dtype}; expected floating gate weights")
    if not isinstance(rows_as, ExpertRows):
        raise TypeError(f"{where}: rows_as must be an ExpertRows, got {type(rows_as).__name__}")
    r = rows_as.recipe
    if r is not None and x.shape[1] % r.block_size:
        raise ValueError(
            f"{where}: x has D={x.shape[1]} columns; the experts take MX rows, which need D a "
            f"multiple of the block size {r.block_size}"
        )
    if check_ids is None:
        check_ids = not idx.is_cuda and not torch.compiler.is_compiling()
    if check_ids and idx.numel():
        lo, hi = torch.aminmax(idx)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= E:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{where}: idx holds expert id {bad}; expected ids in [0, num_experts={E})"
            )


def check_combine_rows(y: Any, rows: int, where: str = "combine") -> None:
    """y, the experts' outputs for `rows` dispatched rows: a 2-D tensor of `rows` rows, else a
    TypeError / ValueError naming it (fewer rows failed in a gather, more were dropped silently).
    Eager calls only (its shapes are checked where torch.compile traces nothing)."""
    if not isinstance(y, Tensor):
        raise TypeError(f"{where}: y must be a torch.Tensor (the experts' outputs), got {type(y).__name__}")
    if torch.compiler.is_compiling():
        return
    if y.ndim != 2 or y.shape[0] != rows:
        raise ValueError(
            f"{where}: y has shape {_shape(y)}; expected ({rows}, D): one output row per row the "
            "dispatch gave, in its order"
        )


# --------------------------------------------------------------------------------------------
# Local ordering and combine (every expert here; also the token side of expert parallelism)
# --------------------------------------------------------------------------------------------


def expert_counts(idx: Tensor, num_experts: int) -> Tensor:
    """idx (...) int64 expert ids in [0, num_experts) -> (num_experts,) int64 counts. A scatter-add
    with a static output size: no host sync (torch.bincount syncs on CUDA), compiles fullgraph."""
    flat = idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


@dataclass
class LocalHandle:
    """What `combine` needs of a local ordering: where each assignment's row went, the scores."""

    inverse: Tensor
    """(T*k,) int64: sorted row of assignment a = t * k + j."""
    perm: Tensor
    """(T*k,) int64: assignment of sorted row r (`inverse`'s inverse)."""
    scores: Tensor
    """(T, k) gate weights."""
    dtype: torch.dtype
    """The tokens' dtype (the combine's output dtype)."""


def sort_by_expert(x: Tensor, idx: Tensor, scores: Tensor, num_experts: int):
    """x (T, D), idx (T, k) int64 -> (rows (T*k, D) grouped by expert, counts (E,) int64,
    LocalHandle). No host sync."""
    T, D = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)  # assignment a = t * k + j
    perm = torch.argsort(flat, stable=True)  # (T*k,) assignment order grouped by expert
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    counts = expert_counts(flat, num_experts)
    return _ToExpertRows.apply(x, perm, inv, k), counts, LocalHandle(inv, perm, scores, x.dtype)


def weighted_sum(y: Tensor, h: LocalHandle) -> Tensor:
    """y (T*k, D) rows grouped by expert -> (T, D) in the tokens' dtype: each token's k rows, scaled
    by their gate weights and summed over j in fp32 (a fixed order: the same bits every run; for
    k = 2 the same bits as any order)."""
    T, k = h.scores.shape
    y = _Permute.apply(y, h.inverse, h.perm).view(T, k, y.shape[-1]).float()  # back to assignment order
    return (y * h.scores.unsqueeze(-1)).sum(1).to(h.dtype)


# Rows move by gathers both ways. A gather's autograd backward is an index_add (which adds in the
# order the GPU's atomics land, and which the deterministic mode runs as a sort and an ordered
# scatter); a permutation's backward is the gather by its inverse, exact and in a fixed order.


class _ToExpertRows(torch.autograd.Function):
    """x (T, D), perm (T*k,) assignment a = t * k + j of each sorted row, inv its inverse, k ->
    rows (T*k, D), rows[r] = x[perm[r] // k]. Backward: each token's gradient is the sum over j of
    its k rows' (gathered back by inv, summed over j as an expand's backward sums: the same bits)."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inv: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, torch.div(perm, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inv,) = ctx.saved_tensors
        g = grad.index_select(0, inv)
        return g.view(inv.numel() // ctx.k, ctx.k, g.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """rows[perm] for a permutation perm of the rows, inv its inverse; backward grad[inv]."""

    @staticmethod
    def forward(ctx, rows: Tensor, perm: Tensor, inv: Tensor) -> Tensor:
        ctx.save_for_backward(inv)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


class LocalDispatcher:
    """Every expert here (`TokenDispatcher`): the rows sorted by expert, no collective, no host sync
    (the step compiles with fullgraph=True and captures in a CUDA graph: T * k rows, static). Its
    inputs are checked (`check_dispatch_args`); the expert ids' range where that costs no sync."""

    def dispatch(self, x, idx, scores, *, num_experts, rows_as=UNQUANTIZED):
        check_dispatch_args(x, idx, scores, num_experts, rows_as, where=f"{type(self).__name__}.dispatch")
        return sort_by_expert(x, idx, scores, num_experts)

    def combine(self, y, handle):
        check_combine_rows(y, handle.perm.numel(), f"{type(self).__name__}.combine")
        return weighted_sum(y, handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RowsFromAnchor(torch.autograd.Function):
    """`rows` (an MXTensor's dequantized value, e.g. the MXFP8 dispatch's) as a function of its grad
    anchor, identity gradient: `RowsFromAnchor.apply(anchor, rows)` sends the rows' gradient back
    through the dispatch in its own dtype."""

    @staticmethod
    def forward(ctx, anchor: Tensor, rows: Tensor) -> Tensor:
        return rows

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None
