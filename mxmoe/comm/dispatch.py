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

- `LocalDispatcher`: every expert here (one process, or FSDP only). No host sync, no collective.
- `AllToAllDispatcher`: expert parallelism over a process group; rows travel by all-to-all on a row
  transport chosen by name (`mxmoe.comm.transports`: "symm", "nccl", ...). The dispatched rows go
  as MXFP8 in the experts' recipe when the experts take MX rows (`ExpertRows.recipe`) and the
  MXFP8 exchange is on, and come back in the rows' dtype with an MXFP8 gradient; otherwise both
  ways in the rows' dtype. The collectives are custom ops (`mxmoe.comm.ops`): a compiled MoE layer
  traces through them without a graph break.
- a token-level transport (DeepEP's kind) returns its own from `Transport.dispatcher`.

Deterministic by construction (no accumulation whose order varies, forward or backward): rows move
by permutation gathers (whose backward adds one row into each zero row) and each token's k rows are
summed by a reduction over j in a fixed order, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm import ops
from mxmoe.comm.transports import check_transport, group_name
from mxmoe.quant.mx_tensor import MXTensor, make_grad_anchor, mx_tensor_trusted
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
    # A gather by token (backward: index_add of k rows per token) and an index_add combine would
    # add in the order the GPU's atomics land; permutation gathers add one row into each zero row.
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    counts = expert_counts(flat, num_experts)
    x_rep = x.unsqueeze(1).expand(T, k, D).reshape(T * k, D)  # row a = x[a // k]
    return x_rep.index_select(0, perm), counts, LocalHandle(inv, scores, x.dtype)


def weighted_sum(y: Tensor, h: LocalHandle) -> Tensor:
    """y (T*k, D) rows grouped by expert -> (T, D) in the tokens' dtype: each token's k rows, scaled
    by their gate weights and summed over j in fp32 (a fixed order: the same bits every run; for
    k = 2 the same bits as any order)."""
    T, k = h.scores.shape
    y = y.index_select(0, h.inverse).view(T, k, y.shape[-1]).float()  # back to assignment order
    return (y * h.scores.unsqueeze(-1)).sum(1).to(h.dtype)


class LocalDispatcher:
    """Every expert here (`TokenDispatcher`): the rows sorted by expert, no collective, no host sync
    (the step compiles with fullgraph=True and captures in a CUDA graph: T * k rows, static)."""

    def dispatch(self, x, idx, scores, *, num_experts, rows_as=UNQUANTIZED):
        return sort_by_expert(x, idx, scores, num_experts)

    def combine(self, y, handle):
        return weighted_sum(y, handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# --------------------------------------------------------------------------------------------
# Expert parallelism: rows by all-to-all
# --------------------------------------------------------------------------------------------


def expert_major_index(recv_counts: Tensor, n: int | None = None) -> Tensor:
    """recv_counts (ep, E_l) int64: rows received from source s for local expert e, laid out
    source-major; n: their total (computed with a host sync when None). Returns index (n,) int64 with
    `received[index]` grouped by local expert (and by source within an expert)."""
    ep, El = recv_counts.shape
    flat = recv_counts.reshape(-1)
    if n is None:
        n = int(flat.sum())
    starts = (torch.cumsum(flat, 0) - flat).view(ep, El).t().reshape(-1)  # segment start, src-major
    lens = recv_counts.t().reshape(-1)  # segment lengths in expert-major order
    out_starts = torch.cumsum(lens, 0) - lens
    shift = torch.repeat_interleave(starts - out_starts, lens, output_size=n)
    return torch.arange(n, device=recv_counts.device) + shift


@dataclass
class ExchangeHandle:
    """What `AllToAllDispatcher.return_rows` needs of one `exchange_rows`."""

    send: Tensor
    """(ep,) int64: rows sent to each rank."""
    recv: Tensor
    """(ep,) int64: rows received from each rank."""
    inverse: Tensor
    """(R,) int64: the expert-major row of each received row."""
    rows_in: int
    """Rows exchanged out (what comes back)."""
    recipe: MXRecipe | None
    """The MX recipe of the combine's gradient (None: it goes back unquantized)."""


@dataclass
class AllToAllHandle:
    local: LocalHandle
    exchange: ExchangeHandle


def _fmt(r: MXRecipe) -> tuple:
    return (r.elem_dtype, r.block_size, r.scaling_mode, r.dim0_kernel)


class _Rows(torch.autograd.Function):
    """Rows both ways in their own dtype."""

    @staticmethod
    def forward(ctx, x, send, recv, group, transport, out_rows):
        ctx.save_for_backward(send, recv)
        ctx.meta = (group, transport, x.shape[0])
        return ops.a2a_rows(x, send, recv, group, transport, out_rows)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.saved_tensors
        group, transport, rows = ctx.meta
        g = ops.a2a_rows(grad.contiguous(), recv, send, group, transport, rows)
        return g, None, None, None, None, None


class _DispatchMX(torch.autograd.Function):
    """MXFP8 rows forward (elements and scales, and a grad anchor carrying their gradient); the
    gradient goes back in its own dtype."""

    @staticmethod
    def forward(ctx, x, send, recv, group, transport, elem_dtype, block_size, scaling_mode, kernel, chunks):
        ctx.save_for_backward(send, recv)
        ctx.meta = (group, transport, x.shape[0])
        q, s = ops.a2a_mxfp8(
            x, send, recv, group, transport, elem_dtype, block_size, scaling_mode, kernel, chunks, None
        )
        ctx.mark_non_differentiable(q, s)
        return make_grad_anchor((q.shape[0], q.shape[1]), x.dtype, x.device), q, s

    @staticmethod
    def backward(ctx, grad, _gq, _gs):
        send, recv = ctx.saved_tensors
        group, transport, rows = ctx.meta
        g = ops.a2a_rows(grad.contiguous(), recv, send, group, transport, rows)
        return (g,) + (None,) * 9


class _CombineMX(torch.autograd.Function):
    """Rows forward in their own dtype; their gradient back as MXFP8 (dequantized on arrival)."""

    @staticmethod
    def forward(ctx, y, send, recv, group, transport, out_rows, elem_dtype, block_size, scaling_mode, kernel,
                chunks):
        ctx.save_for_backward(send, recv)
        ctx.meta = (group, transport, y.shape[0], elem_dtype, block_size, scaling_mode, kernel, chunks)
        return ops.a2a_rows(y, send, recv, group, transport, out_rows)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.saved_tensors
        group, transport, rows, elem_dtype, block_size, scaling_mode, kernel, chunks = ctx.meta
        g = ops.a2a_mxfp8_dequant(
            grad.contiguous(), recv, send, group, transport, elem_dtype, block_size, scaling_mode, kernel,
            chunks, rows,
        )
        return (g,) + (None,) * 10


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


class AllToAllDispatcher:
    """Expert parallelism over `group` (`TokenDispatcher`): rank r of the group holds experts
    [r E/ep, (r+1) E/ep); rows travel by all-to-all on a row transport (module docstring).

    group: the expert-parallel process group. transport: "auto" or a registered row transport
    (`mxmoe.comm.transports.TRANSPORTS`), the same on every rank. mxfp8: send MX experts' rows (and
    the combine's gradient) as MXFP8; False sends them in the rows' dtype. chunks: the NCCL
    pipeline's pieces (`mxmoe.comm.to_mxfp8_a2a_dequant`).

    Flow for T tokens, top-k, E experts (E_l = E / ep per rank): sort the T*k assignments by global
    expert (so also by destination rank); exchange the per-expert counts, then the rows; received
    rows are (source rank, local expert)-major and are permuted to local-expert-major; the experts
    run; rows are permuted back, returned, put back in assignment order and summed over the top-k.
    """

    def __init__(self, group, *, transport: str = "auto", mxfp8: bool = True, chunks: int | None = None):
        from mxmoe.comm.splits import check_chunks

        self.group = group
        self.group_name = group_name(group)
        initialized = dist.is_available() and dist.is_initialized()
        self.ep_size = dist.get_world_size(group) if initialized else 1
        self.ep_rank = dist.get_rank(group) if initialized else 0
        self.transport = check_transport(transport)
        self.chunks = check_chunks(chunks)
        if not isinstance(mxfp8, bool):
            raise TypeError(f"mxfp8={mxfp8!r}: expected a bool")
        self.mxfp8 = mxfp8

    def describe(self, rows_as: ExpertRows = UNQUANTIZED) -> str:
        """One line for a run's log: what crosses the wire for experts that take `rows_as`."""
        r = rows_as.recipe
        if r is not None and self.mxfp8:
            elem = "e4m3" if r.elem_dtype == torch.float8_e4m3fn else "e5m2"
            what = (
                f"the dispatch and the combine's gradient send MXFP8 rows ({elem} elements + e8m0 "
                f"scales per {r.block_size}, {r.scaling_mode.upper()}), the combine and the dispatch's "
                "gradient rows in the compute dtype"
            )
        elif r is not None:
            what = "rows in the compute dtype both ways (the MXFP8 exchange is off: mxfp8_a2a=False)"
        else:
            what = "rows in the compute dtype both ways (the experts are not MX)"
        ranks = f"{self.ep_size} rank" + ("s" if self.ep_size != 1 else "")
        return f"expert parallelism over {ranks}, transport {self.transport!r}: {what}"

    def dispatch(self, x, idx, scores, *, num_experts, rows_as=UNQUANTIZED):
        rows, counts, local = sort_by_expert(x, idx, scores, num_experts)
        out, local_counts, xh = self.exchange_rows(rows, counts, rows_as=rows_as)
        return out, local_counts, AllToAllHandle(local, xh)

    def combine(self, y, handle):
        return weighted_sum(self.return_rows(y, handle.exchange), handle.local)

    def exchange_rows(
        self, rows: Tensor, counts: Tensor, *, rows_as: ExpertRows = UNQUANTIZED
    ) -> tuple[Tensor | MXTensor, Tensor, ExchangeHandle]:
        """The rows stage: rows (N, D) grouped by global expert, counts (E,) rows per global expert
        (any numeric dtype) -> (rows (R, D) of this rank's experts grouped by local expert, counts
        (E / ep,) int64, handle for `return_rows`). A Tensor, or an MXTensor whose gradient flows
        to its grad anchor when `rows_as` asks for one and the MXFP8 exchange is on."""
        ep = self.ep_size
        E = counts.numel()
        if E % ep:
            raise ValueError(f"{E} experts are not divisible by the expert-parallel degree {ep}")
        counts = counts.to(torch.int64)
        recv = ops.a2a_counts(counts, self.group_name).view(ep, E // ep)  # row s: source s's counts
        send, recv_splits = counts.view(ep, E // ep).sum(1), recv.sum(1)
        if rows.is_cuda and torch.is_autocast_enabled("cuda"):  # exchange bf16, not fp32, rows
            rows = rows.to(torch.get_autocast_dtype("cuda"))
        r = rows_as.recipe if self.mxfp8 else None
        chunks = -1 if self.chunks is None else self.chunks
        if r is None:
            xr = _Rows.apply(rows, send, recv_splits, self.group_name, self.transport, None)
        else:
            anchor, q, s = _DispatchMX.apply(
                rows, send, recv_splits, self.group_name, self.transport, *_fmt(r), chunks
            )
            xr = mx_tensor_trusted(q, s, 1, r.block_size, r.scaling_mode, rows.dtype, anchor)
        n = xr.shape[0]
        index = expert_major_index(recv, n)
        inverse = torch.empty_like(index).scatter_(0, index, torch.arange(n, device=index.device))
        if isinstance(xr, MXTensor):
            if rows_as.as_mx:
                out = xr.index_rows(index)
            else:
                out = RowsFromAnchor.apply(xr.grad_anchor, xr.dequantize(recipe=r)).index_select(0, index)
        else:
            out = xr.index_select(0, index)
        return out, recv.sum(0), ExchangeHandle(send, recv_splits, inverse, rows.shape[0], r)

    def return_rows(self, y: Tensor, h: ExchangeHandle) -> Tensor:
        """y (R, D) in the order `exchange_rows` gave -> (N, D) back on the rows' ranks, in the order
        they were sent; the gradient comes back as MXFP8 when the dispatch went so."""
        y = y.index_select(0, h.inverse)
        if h.recipe is None:
            return _Rows.apply(y, h.recv, h.send, self.group_name, self.transport, h.rows_in)
        chunks = -1 if self.chunks is None else self.chunks
        return _CombineMX.apply(
            y, h.recv, h.send, self.group_name, self.transport, h.rows_in, *_fmt(h.recipe), chunks
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ep={self.ep_size}, rank={self.ep_rank}, transport={self.transport!r}, "
            f"mxfp8={self.mxfp8})"
        )
