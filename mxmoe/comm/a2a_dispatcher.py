"""Expert parallelism's token dispatcher (`AllToAllDispatcher`, the seam
`mxmoe.token_dispatch.TokenDispatcher`) over a process group: rows travel by all-to-all on a row
transport chosen by name (`mxmoe.comm.transport.TRANSPORTS`: "symm", "nccl", ...). The dispatched
rows go as MXFP8 in the experts' recipe when the experts take MX rows (`ExpertRows.recipe`) and the
MXFP8 exchange is on, and come back in the rows' dtype with an MXFP8 gradient; otherwise both ways
in the rows' dtype. The collectives are custom ops (`mxmoe.comm.custom_ops`): a compiled MoE layer
traces through them without a graph break. `make_dispatcher` builds the dispatcher of an
expert-parallel group from the transport's name (a token-level transport brings its own).

Before its first exchange (and again whenever a rank's D, dtype, expert count or MX rows' format
changes), the dispatcher's ranks agree on them with one small all_gather: a rank whose inputs are bad, or that
disagrees with its peers, makes every rank raise an error naming it and the mismatch, before any
split size is exchanged (the process group's timeout bounds the wait).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm import custom_ops as ops
from mxmoe.comm.splits import check_chunks, gather_rows
from mxmoe.comm.transport import (
    AUTO,
    ExchangeSite,
    check_transport,
    group_name,
    load_transport,
    resolve_transport,
)
from mxmoe.formats import MODE_IDS
from mxmoe.ops.gemm import first_order
from mxmoe.quant.backends import cast_kernel
from mxmoe.quant.mx_tensor import MXTensor, make_grad_anchor, mx_tensor_trusted
from mxmoe.recipe import MXRecipe
from mxmoe.token_dispatch import (
    UNQUANTIZED,
    ExpertRows,
    LocalHandle,
    RowsFromAnchor,
    check_combine_rows,
    check_dispatch_args,
    sort_by_expert,
    weighted_sum,
)


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


def _fmt(r: MXRecipe, device: torch.device) -> tuple[str, str]:
    """What the exchange's custom ops take of a recipe: its format's registered name and its
    concrete dim0 cast kernel (chosen here: an error names the recipe field, outside the op)."""
    return (r.fmt.name, cast_kernel(r, device, "dim0"))


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
    """MX rows forward (elements and scales, and a grad anchor carrying their gradient); the
    gradient goes back in its own dtype."""

    @staticmethod
    def forward(ctx, x, send, recv, group, transport, fmt, kernel, chunks):
        ctx.save_for_backward(send, recv)
        ctx.meta = (group, transport, x.shape[0])
        q, s = ops.a2a_mxfp8(x, send, recv, group, transport, fmt, kernel, chunks, None)
        ctx.mark_non_differentiable(q, s)
        return make_grad_anchor((q.shape[0], q.shape[1]), x.dtype, x.device), q, s

    @staticmethod
    def backward(ctx, grad, _gq, _gs):
        send, recv = ctx.saved_tensors
        group, transport, rows = ctx.meta
        g = ops.a2a_rows(grad.contiguous(), recv, send, group, transport, rows)
        return (g,) + (None,) * 7


class _CombineMX(torch.autograd.Function):
    """Rows forward in their own dtype; their gradient back as MX rows (dequantized on arrival)."""

    @staticmethod
    def forward(ctx, y, send, recv, group, transport, out_rows, fmt, kernel, chunks):
        ctx.save_for_backward(send, recv)
        ctx.meta = (group, transport, y.shape[0], fmt, kernel, chunks)
        return ops.a2a_rows(y, send, recv, group, transport, out_rows)

    @staticmethod
    @first_order("AllToAllDispatcher.combine")
    def backward(ctx, grad):
        send, recv = ctx.saved_tensors
        group, transport, rows, fmt, kernel, chunks = ctx.meta
        g = ops.a2a_mxfp8_dequant(grad.contiguous(), recv, send, group, transport, fmt, kernel, chunks, rows)
        return (g,) + (None,) * 8


class AllToAllDispatcher:
    """Expert parallelism over `group` (`TokenDispatcher`): rank r of the group holds experts
    [r E/ep, (r+1) E/ep); rows travel by all-to-all on a row transport (module docstring).

    group: the expert-parallel process group. transport: "auto" or a registered row transport
    (`mxmoe.comm.transport.TRANSPORTS`), the same on every rank. mxfp8: send MX experts' rows (and
    the combine's gradient) as MXFP8; False sends them in the rows' dtype. chunks: the NCCL
    pipeline's pieces (`mxmoe.comm.to_mxfp8_a2a_dequant`).

    Flow for T tokens, top-k, E experts (E_l = E / ep per rank): sort the T*k assignments by global
    expert (so also by destination rank); exchange the per-expert counts, then the rows; received
    rows are (source rank, local expert)-major and are permuted to local-expert-major; the experts
    run; rows are permuted back, returned, put back in assignment order and summed over the top-k.
    """

    def __init__(self, group, *, transport: str = "auto", mxfp8: bool = True, chunks: int | None = None):
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
        self._agreed: tuple | None = None
        self._agreed_device: torch.device | None = None

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
        where = f"{type(self).__name__}.dispatch"
        if torch.compiler.is_compiling():  # traced: the checks on metadata only (no collective)
            check_dispatch_args(x, idx, scores, num_experts, rows_as, where=where, check_ids=False)
        else:
            self._check_and_agree(x, idx, scores, num_experts, rows_as, where)
        rows, counts, local = sort_by_expert(x, idx, scores, num_experts)
        out, local_counts, xh = self.exchange_rows(rows, counts, rows_as=rows_as)
        return out, local_counts, AllToAllHandle(local, xh)

    def combine(self, y, handle):
        return weighted_sum(self.return_rows(y, handle.exchange), handle.local)

    def _check_and_agree(self, x, idx, scores, num_experts, rows_as: ExpertRows, where: str) -> None:
        """The seam's checks on this rank; then, before the first exchange and whenever this rank's
        (D, dtype, num_experts, MX rows' format) change, one all_gather shares every rank's outcome and
        those values, so that a bad rank or a mismatch raises on every rank, naming the rank."""
        err: Exception | None = None
        first = self._agreed is None
        try:  # the ids' range: at the first exchange on any device (one sync), later where it is free
            check_dispatch_args(
                x, idx, scores, num_experts, rows_as, where=where, check_ids=True if first else None
            )
            if num_experts % self.ep_size:
                raise ValueError(
                    f"{where}: num_experts={num_experts} is not divisible by the expert-parallel degree "
                    f"{self.ep_size}"
                )
        except (TypeError, ValueError) as e:
            err = e
        if self.ep_size == 1 or (err is not None and not first):
            # After the agreement a bad call (found where the check is free: ids on the CPU, shapes)
            # still joins the counts' exchange, with counts of -1, and raises; its peers raise on
            # reading them, before any row moves (no extra collective on good calls).
            if err is not None:
                if self.ep_size > 1:
                    E, device = self._agreed[2], self._agreed_device
                    ops.a2a_counts(torch.full((E,), -1, dtype=torch.int64, device=device), self.group_name)
                raise type(err)(f"rank {self.ep_rank}: {err}") from err
            return
        sig = None if err is not None else _signature(x, num_experts, rows_as, self.mxfp8)
        if err is None and sig == self._agreed:
            return
        self._agreed = agree_across_ranks(self.group, self.ep_rank, self.ep_size, sig, err)
        self._agreed_device = x.device

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
                rows, send, recv_splits, self.group_name, self.transport, *_fmt(r, rows.device), chunks
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
        check_combine_rows(y, h.inverse.numel(), f"{type(self).__name__}.combine")
        y = y.index_select(0, h.inverse)
        if h.recipe is None:
            return _Rows.apply(y, h.recv, h.send, self.group_name, self.transport, h.rows_in)
        chunks = -1 if self.chunks is None else self.chunks
        return _CombineMX.apply(
            y, h.recv, h.send, self.group_name, self.transport, h.rows_in, *_fmt(h.recipe, y.device), chunks
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ep={self.ep_size}, rank={self.ep_rank}, transport={self.transport!r}, "
            f"mxfp8={self.mxfp8})"
        )


# --------------------------------------------------------------------------------------------
# The ranks' agreement before the first exchange
# --------------------------------------------------------------------------------------------

_AGREED_FIELDS = (
    "D (x.shape[1])", "x's dtype", "num_experts", "the MX rows' block size (0: rows unquantized)",
    "the MX rows' element dtype", "the MX rows' scaling mode",
)
_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float64)
_ELEM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _signature(x: Tensor, num_experts: int, rows_as: ExpertRows, mxfp8: bool) -> tuple[int, ...]:
    """What every rank of an exchange must share: (D, dtype code, num_experts, and the MX rows'
    format: block size, element dtype code, scaling mode id; 0, -1, -1 for rows unquantized)."""
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    r = rows_as.recipe if mxfp8 else None
    if r is None:
        return (x.shape[1], code, num_experts, 0, -1, -1)
    elem = _ELEM_DTYPES.index(r.elem_dtype) if r.elem_dtype in _ELEM_DTYPES else len(_ELEM_DTYPES)
    return (x.shape[1], code, num_experts, r.block_size, elem, MODE_IDS[r.fmt.scaling_mode])


def _field_value(i: int, v: int) -> str:
    if i == 1:
        return str(_DTYPES[v]) if v < len(_DTYPES) else "another dtype"
    if i in (4, 5) and v < 0:
        return "none (rows unquantized)"
    if i == 4:
        return str(_ELEM_DTYPES[v]) if v < len(_ELEM_DTYPES) else "another dtype"
    if i == 5:
        return next((m.value for m, k in MODE_IDS.items() if k == v), "another scaling mode")
    return str(v)


def agree_across_ranks(group, rank: int, world: int, sig: tuple | None, err: Exception | None) -> tuple:
    """One all_gather of (error?, *sig) over `group`. Raises on every rank when a rank's inputs were
    bad (its own error on a bad rank, "rank r rejected its inputs: ..." on the others) or when the
    ranks' signatures differ (naming the field, the ranks and their values); returns `sig` else."""
    n = len(_AGREED_FIELDS)
    row = [1] + [-1] * n if sig is None else [0, *sig]
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    meta, bad, msgs = gather_rows(group, world, row, err, device)
    if bad:
        if err is not None:  # this rank's own error first
            raise type(err)(f"rank {rank}: {err}") from err
        kind, msg = msgs[bad[0]]
        exc = TypeError if kind == "TypeError" else ValueError
        raise exc(f"expert-parallel dispatch: rank {bad[0]} rejected its inputs: {msg}")
    for i, name in enumerate(_AGREED_FIELDS):
        values = [m[1 + i] for m in meta]
        if len(set(values)) > 1:
            r = next(r for r in range(world) if values[r] != values[0])
            raise ValueError(
                f"expert-parallel dispatch: the ranks disagree on {name}: rank {r} has "
                f"{_field_value(i, values[r])}, rank 0 has {_field_value(i, values[0])}; every rank of "
                "the expert-parallel group must dispatch the same"
            )
    return tuple(sig)


def make_dispatcher(group, *, transport: str = AUTO, mxfp8: bool = True, chunks: int | None = None):
    """The token dispatcher of expert-parallel group `group`: the transport `transport` names
    ("auto": the available one of lowest rank, refined per exchange for row transports) makes it
    (a row transport: `AllToAllDispatcher`). mxfp8: send the dispatched rows (and the combine's
    gradient) as MXFP8 where the experts take an MX recipe; chunks: the NCCL pipeline's pieces
    (mxmoe.comm.to_mxfp8_a2a_dequant)."""
    check_transport(transport)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() and _backend_is_nccl(group) else "cpu"
    site = ExchangeSite(device, group_name(group), world, None, chunks is not None, False, group)
    name = resolve_transport(transport, site)
    own = load_transport(name).dispatcher(group, transport=transport, mxfp8=mxfp8, chunks=chunks)
    if own is None:
        own = AllToAllDispatcher(group, transport=transport, mxfp8=mxfp8, chunks=chunks)
    return own


def _backend_is_nccl(group) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend(group))
