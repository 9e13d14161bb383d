"""All-to-alls for expert parallelism: MXFP8 (exact, overlapped) and plain high precision.

Every function exchanges *rows*: x is (rows_in, ...) ordered by destination rank, `input_splits[p]`
rows go to rank p, and the result is (sum(output_splits), ...) ordered by source rank. Splits are
lists of ints or 1D integer tensors (any device); they may be uneven or zero.

MXFP8 exchanges quantize rows along the last dim with an `MXRecipe` (its elem dtype, block size,
scaling mode and dim0 kernel; default `DEFAULT_RECIPE`: e4m3, blocks of 32, RCEIL) and move the element
bytes plus the E8M0 scale bytes (1 + 1/32 bytes per element instead of 2 for bf16). The result is
bit-for-bit what `reference_mxfp8_a2a` computes (quantize -> all_to_all_single -> dequantize). The
fused kernels (own rows' quantize+dequantize, symmetric memory) serve the default format; other
recipes take the same paths with the generic cast kernels (NCCL/gloo transport).

Transports. On GPUs of one host (transport "auto" or "symm") one kernel per exchange quantizes each
peer's rows straight into that peer's symmetric-memory buffer, does the own rows meanwhile, and
dequantizes each received tile as soon as its flag says it has landed: `mxmoe.comm.symm` explains
it. Otherwise ("nccl", or "auto" with `chunks` given) NCCL moves the bytes, as follows.

How the NCCL exchange is overlapped (CUDA, `chunks` an int >= 1, or `None` for tensors of at least
PIPELINE_MIN_ELEMS elements; smaller ones take the simple path, which measured faster there):
  * The rank's own slice never goes through the network: one fused Triton pass (`qdq_into`)
    quantizes and dequantizes it locally, straight into its rows of the output.
  * The rows for each peer are cut into `k` pieces (k from the pair's size, same on both sides). Round
    c quantizes piece c for every peer on a *producer* stream and posts the sends/receives of round c
    (one NCCL group: batch_isend_irecv of elements and scales) from that stream, so NCCL starts as soon
    as the round is quantized while the producer goes on with round c+1 and then a piece of the local
    slice. A *consumer* stream waits for round c's transfer and dequantizes each received piece into its
    final rows of the output (`mxmoe.comm.kernels.dequantize_into`, no copies).
  * The caller's stream waits for both side streams at the end; every temporary is kept alive until
    then, and side streams first wait for the caller's stream, so the caching allocator cannot hand a
    buffer to new work while a side stream or NCCL still uses it.
On CPU (gloo) the same rounds run one after another (`chunks` >= 1) or, by default, the simple path:
one quantize, one all_to_all_single of elements and of scales, one dequantize. Both give identical
results (quantization is row-local and deterministic).

Timeouts: nothing here waits without a bound; a peer that never joins is reported by the process
group's timeout (`init_process_group(timeout=...)`; NCCL's watchdog aborts the collective).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.splits import BLOCK_SIZE, Plan, check_and_plan, offsets
from mxmoe.comm.symm import SymmWorkspace, symm_mx_exchange, symm_usable
from mxmoe.quant import custom_ops
from mxmoe.quant.backends import backend, cast_kernel
from mxmoe.quant.checks import spec_of
from mxmoe.quant.mx_tensor import MXTensor, make_grad_anchor, to_mx
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe

# The format the fused kernels (own rows' quantize+dequantize, symmetric memory) are written for.
ELEM_DTYPE = torch.float8_e4m3fn
SCALING_MODE = "rceil"
# Auto policy: two pieces beat the simple path at 16x8192x5120 bf16 (fwd+bwd, 2 GPUs), more pieces
# lost, and below ~100 MB per peer every pipelined variant lost to the simple path. So on CUDA,
# pipeline only when the group's mean elements per rank reach PIPELINE_MIN_ELEMS (from the checked
# plan: every rank decides alike), in ceil(fp8 bytes / MIN_PIECE_BYTES) pieces, at most MAX_CHUNKS per pair.
PIPELINE_MIN_ELEMS = 512 << 20
MIN_PIECE_BYTES = 128 << 20
MAX_CHUNKS = 2


# --------------------------------------------------------------------------------------------
# Building blocks (also used by the benchmark)
# --------------------------------------------------------------------------------------------


def _recipe(recipe: MXRecipe | None, fn: str) -> MXRecipe:
    """The exchange's recipe (None: DEFAULT_RECIPE); a TypeError naming `fn` for anything else."""
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, MXRecipe):
        raise TypeError(f"{fn}: recipe must be an mxmoe.MXRecipe or None, got {type(recipe).__name__}")
    return recipe


def _fast(r: MXRecipe) -> bool:
    """Whether the fused default-format kernels (own rows' qdq, symmetric memory) take r's format."""
    return (r.elem_dtype, r.block_size, r.scaling_mode) == (ELEM_DTYPE, BLOCK_SIZE, SCALING_MODE)


def _kernel(r: MXRecipe, device: torch.device) -> str:
    """The exchange's concrete cast kernel (its quantize and dequantize run along the rows: the
    recipe's dim0_kernel); a clear error for a kernel that cannot run here."""
    return cast_kernel(r, device, "dim0")


def quantize_rows(x: Tensor, *, recipe: MXRecipe | None = None) -> tuple[Tensor, Tensor]:
    """x (R, C) bf16/fp32 contiguous, C % block_size == 0 -> (q (R, C) elem_dtype, s (R, C //
    block_size) float8_e8m0fnu), with the recipe's format and dim0_kernel (default DEFAULT_RECIPE:
    e4m3, RCEIL, blocks of 32): the exchange's quantize."""
    r = _recipe(recipe, "quantize_rows")
    return _quantize(x, r, _kernel(r, x.device))


def _quantize(x: Tensor, r: MXRecipe, k: str) -> tuple[Tensor, Tensor]:
    # `k` is concrete. The backend is called directly: the same kernel as the custom op, without
    # the dispatcher's per-call cost (the pipeline makes several calls per round).
    if x.numel() == 0:
        return custom_ops.quantize_dim0(x, r.block_size, r.scaling_mode, r.elem_dtype, k)
    return backend(k).quantize_dim0(x, spec_of(r.block_size, r.scaling_mode, r.elem_dtype))


def _dequantize(q: Tensor, s: Tensor, dtype: torch.dtype, r: MXRecipe, k: str) -> Tensor:
    """q (R, C) elements (or uint8 view), s (R, C // block) scales (or uint8 view) -> (R, C) dtype."""
    return custom_ops.dequantize(q.view(r.elem_dtype), s.view(torch.float8_e8m0fnu), r.block_size, dtype, k)


def _dequantize_into(q: Tensor, s: Tensor, out: Tensor, r: MXRecipe, k: str) -> None:
    if _fast(r):
        dequantize_into(q, s, out, k)
    elif q.numel():
        out.copy_(_dequantize(q, s, out.dtype, r, k))


def _qdq_into(x: Tensor, out: Tensor, r: MXRecipe, k: str) -> None:
    """out = dequantize(quantize(x)): one fused pass for the default format."""
    if _fast(r):
        qdq_into(x, out, k)
    elif x.numel():
        out.copy_(_dequantize(*_quantize(x, r, k), out.dtype, r, k))


def all_to_all_rows(out: Tensor, inp: Tensor, output_splits, input_splits, group=None) -> Tensor:
    """all_to_all_single of row-major tensors of any dtype (moved as bytes, so gloo and NCCL accept
    every dtype). out: (sum(output_splits), ...) contiguous; inp: (sum(input_splits), ...)."""
    if not (dist.is_available() and dist.is_initialized()):
        return out.copy_(inp)
    o = out.view(out.shape[0], -1).view(torch.uint8) if out.numel() else out.view(torch.uint8)
    i = inp.view(inp.shape[0], -1).view(torch.uint8) if inp.numel() else inp.view(torch.uint8)
    dist.all_to_all_single(o, i, list(output_splits), list(input_splits), group=group)
    return out


def _pieces(n: int, k: int) -> list[tuple[int, int]]:
    """Cut n rows into k near-equal (start, length) pieces (both sides compute the same)."""
    return [((n * c) // k, (n * (c + 1)) // k - (n * c) // k) for c in range(k)]


def _num_chunks(n: int, dim: int, chunks: int | None) -> int:
    if chunks is not None:
        return max(1, min(chunks, n)) if n else 1
    return max(1, min(MAX_CHUNKS, math.ceil(n * dim / MIN_PIECE_BYTES)))


def _use_pipeline(is_cuda: bool, plan: Plan, chunks: int | None) -> bool:
    """Pipelined path or simple one: the same answer on every rank (and for forward and backward),
    since auto decides from the group-wide row count of the checked plan. Unchecked plans
    (check=False, several ranks) take the simple path unless `chunks` asks for pieces."""
    if chunks is not None:
        return chunks >= 1
    if not is_cuda or plan.global_rows is None:
        return False
    row_numel = math.prod(plan.row_shape)
    return plan.global_rows * row_numel >= PIPELINE_MIN_ELEMS * plan.world


# --------------------------------------------------------------------------------------------
# The MXFP8 exchange
# --------------------------------------------------------------------------------------------


def _simple_mx_exchange(x: Tensor, plan: Plan, group, r: MXRecipe, k: str, dequant: bool):
    dim = x.shape[1]
    q, s = _quantize(x, r, k)
    rows_out = sum(plan.output_splits)
    q_out = torch.empty((rows_out, dim), dtype=torch.uint8, device=x.device)
    s_out = torch.empty((rows_out, dim // r.block_size), dtype=torch.uint8, device=x.device)
    all_to_all_rows(q_out, q.view(torch.uint8), plan.output_splits, plan.input_splits, group)
    all_to_all_rows(s_out, s.view(torch.uint8), plan.output_splits, plan.input_splits, group)
    q_out, s_out = q_out.view(r.elem_dtype), s_out.view(torch.float8_e8m0fnu)
    if not dequant:
        return q_out, s_out
    return _dequantize(q_out, s_out, x.dtype, r, k)


class _Streams:
    """Producer / consumer side streams per device, created once."""

    _by_device: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    @classmethod
    def get(cls, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in cls._by_device:
            cls._by_device[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Stream(device=idx))
        return cls._by_device[idx]


def _pipelined_mx_exchange(
    x: Tensor, plan: Plan, group, r: MXRecipe, k: str, dequant: bool, chunks: int | None
):
    dim = x.shape[1]
    sdim = dim // r.block_size
    dev = x.device
    me, world = plan.rank, plan.world
    in_off, out_off = plan.in_offsets, plan.out_offsets
    rows_out = sum(plan.output_splits)
    # Peers in a staggered order (me+1, me+2, ...) so ranks do not all hit the same peer first.
    peers = [(me + i) % world for i in range(1, world)]
    # P2POp takes global ranks.
    peer_id = {p: p if group is None else dist.get_global_rank(group, p) for p in peers}

    def cut(n: int) -> list[tuple[int, int]]:
        return _pieces(n, _num_chunks(n, dim, chunks))

    send_pieces = {p: cut(plan.input_splits[p]) for p in peers}
    recv_pieces = {p: cut(plan.output_splits[p]) for p in peers}
    rounds = max([len(v) for v in send_pieces.values()] + [len(v) for v in recv_pieces.values()] + [1])
    n_self = plan.input_splits[me]
    self_pieces = _pieces(n_self, rounds if peers else _num_chunks(n_self, dim, chunks))

    cuda = x.is_cuda
    if cuda:
        cur = torch.cuda.current_stream(dev)
        prod, cons = _Streams.get(dev)
        prod.wait_stream(cur)
        cons.wait_stream(cur)

        def on(stream):
            return torch.cuda.stream(stream)
    else:
        cur = prod = cons = None

        def on(stream):
            return contextlib.nullcontext()

    # Outputs and receive buffers live on the caller's stream.
    y = torch.empty((rows_out, dim), dtype=x.dtype, device=dev) if dequant else None
    # Received elements and scales: at their output rows (dispatch), or packed peer after peer
    # without the own rows (dequantize; the buffer is temporary).
    if dequant:
        recv_rows = [0 if p == me else n for p, n in enumerate(plan.output_splits)]
        dst_off = offsets(recv_rows)
    else:
        recv_rows, dst_off = plan.output_splits, out_off
    q_dst = torch.empty((sum(recv_rows), dim), dtype=torch.uint8, device=dev)
    s_dst = torch.empty((sum(recv_rows), sdim), dtype=torch.uint8, device=dev)
    keep: list = []  # temporaries kept alive until the caller's stream has waited for everything

    def self_piece(c: int) -> None:
        start, n = self_pieces[c]
        if n == 0:
            return
        r0, o0 = in_off[me] + start, out_off[me] + start
        if dequant:  # one fused pass on CUDA: read x once, write y once
            _qdq_into(x[r0 : r0 + n], y[o0 : o0 + n], r, k)
        else:
            q, s = _quantize(x[r0 : r0 + n], r, k)
            keep.append((q, s))
            q_dst[o0 : o0 + n].copy_(q.view(torch.uint8))
            s_dst[o0 : o0 + n].copy_(s.view(torch.uint8))

    works_of_round: list[tuple[list, list]] = []
    for c in range(rounds):
        ops, received = [], []
        with on(prod):
            for p in peers:
                if c < len(send_pieces[p]):
                    start, n = send_pieces[p][c]
                    if n:
                        r0 = in_off[p] + start
                        q, s = _quantize(x[r0 : r0 + n], r, k)
                        keep.append((q, s))
                        ops.append(dist.P2POp(dist.isend, q.view(torch.uint8), peer_id[p], group, tag=2 * c))
                        ops.append(
                            dist.P2POp(dist.isend, s.view(torch.uint8), peer_id[p], group, tag=2 * c + 1)
                        )
                if c < len(recv_pieces[p]):
                    start, n = recv_pieces[p][c]
                    if n:
                        o0, d0 = out_off[p] + start, dst_off[p] + start
                        qv, sv = q_dst[d0 : d0 + n], s_dst[d0 : d0 + n]
                        ops.append(dist.P2POp(dist.irecv, qv, peer_id[p], group, tag=2 * c))
                        ops.append(dist.P2POp(dist.irecv, sv, peer_id[p], group, tag=2 * c + 1))
                        received.append((qv, sv, o0, n))
            works = dist.batch_isend_irecv(ops) if ops else []
            keep.append(works)
            # The local slice fills the producer stream while round c travels (one round behind,
            # so that round c+1 is quantized before the local piece c-1).
            if c >= 1:
                self_piece(c - 1)
        works_of_round.append((works, received))
        if dequant:
            with on(cons):
                for w in works:
                    w.wait()
                for qv, sv, o0, n in received:
                    _dequantize_into(qv, sv, y[o0 : o0 + n], r, k)
    with on(prod):
        self_piece(rounds - 1)
        for c in range(rounds, len(self_pieces)):
            self_piece(c)
    if not dequant:
        with on(cons):
            for works, _ in works_of_round:
                for w in works:
                    w.wait()
    if cuda:
        cur.wait_stream(prod)
        cur.wait_stream(cons)
    keep.clear()
    if dequant:
        return y
    return q_dst.view(r.elem_dtype), s_dst.view(torch.float8_e8m0fnu)


def _pick_transport(x: Tensor, plan: Plan, group, chunks: int | None, transport: str, r: MXRecipe) -> str:
    """Returns "symm" or "nccl" (NCCL, or gloo on CPU): the same on every rank, from facts every rank
    shares. auto: symmetric memory when it can run here, the format is the default one and no `chunks`
    asks for the NCCL pipeline."""
    if transport == "nccl" or plan.world == 1:
        return "nccl"
    usable = symm_usable(group, x.device)
    if transport == "symm":
        if not usable:
            raise RuntimeError(
                "transport='symm' needs CUDA tensors, an NCCL process group of GPUs on one host, "
                "torch.distributed._symmetric_memory and triton; use transport='nccl' or 'auto'"
            )
        if not _fast(r):
            raise ValueError(
                f"transport='symm' exchanges the default format only (RCEIL, e4m3, blocks of 32); the "
                f"recipe asks for {r.scaling_mode}, {r.elem_dtype}, blocks of {r.block_size}: use "
                "transport='nccl' or 'auto'"
            )
        return "symm"
    return "symm" if usable and chunks is None and _fast(r) else "nccl"


def _mx_exchange(
    x: Tensor,
    plan: Plan,
    group,
    r: MXRecipe,
    dequant: bool,
    chunks: int | None,
    transport: str = "nccl",
):
    """Quantize x's rows in r's format, exchange per plan, and (if dequant) dequantize: y (rows_out,
    dim) x.dtype, else (q (rows_out, dim) r.elem_dtype, s (rows_out, dim // r.block_size) e8m0)."""
    x = x.contiguous()
    k = _kernel(r, x.device)
    if _pick_transport(x, plan, group, chunks, transport, r) == "symm":
        ws = SymmWorkspace.get(group, x.device)
        return symm_mx_exchange(x, plan.input_splits, plan.output_splits, plan.rank, ws, k, dequant)
    pipelined = _use_pipeline(x.is_cuda, plan, chunks)
    if plan.world == 1 and not pipelined:
        q, s = _quantize(x, r, k)
        return _dequantize(q, s, x.dtype, r, k) if dequant else (q, s)
    if pipelined:
        return _pipelined_mx_exchange(x, plan, group, r, k, dequant, chunks)
    return _simple_mx_exchange(x, plan, group, r, k, dequant)


def _hp_exchange(x: Tensor, plan: Plan, group) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(plan.output_splits), *x.shape[1:]))
    return all_to_all_rows(out, x, plan.output_splits, plan.input_splits, group)


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


class _MXA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _mx_exchange(x, plan, group, r, True, chunks, transport)

    @staticmethod
    def backward(ctx, grad):
        plan, group, r, chunks, transport = ctx.args
        y = _mx_exchange(grad, plan.reversed(), group, r, True, chunks, transport)
        return y, None, None, None, None, None


class _HPA2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        ctx.args = (plan, group)
        return _hp_exchange(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        plan, group = ctx.args
        return _hp_exchange(grad, plan.reversed(), group), None, None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group)
        q, s = _mx_exchange(x, plan, group, r, False, chunks, transport)
        anchor = make_grad_anchor((q.shape[0], q.shape[1]), x.dtype, x.device)
        ctx.mark_non_differentiable(q, s)
        return anchor, q, s

    @staticmethod
    def backward(ctx, grad, _gq, _gs):
        plan, group = ctx.args
        return _hp_exchange(grad, plan.reversed(), group), None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group, r, chunks, transport):
        ctx.args = (plan, group, r, chunks, transport)
        return _hp_exchange(x, plan, group)

    @staticmethod
    def backward(ctx, grad):
        plan, group, r, chunks, transport = ctx.args
        y = _mx_exchange(grad, plan.reversed(), group, r, True, chunks, transport)
        return y, None, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _recipe_and_plan(
    fn: str, x: Tensor, output_splits, input_splits, group, check: bool, chunks: int | None,
    transport: str, recipe: MXRecipe | None,
) -> tuple[MXRecipe, Plan]:
    """The recipe and the checked plan of one MX exchange call `fn` (its arguments, checked once)."""
    r = _recipe(recipe, fn)
    plan = check_and_plan(
        fn, x, output_splits, input_splits, group,
        check=check, chunks=chunks, transport=transport, block_size=r.block_size,
    )
    return r, plan


def to_mxfp8_a2a_dequant(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> Tensor:
    """MXFP8 all-to-all of rows, dequantized on arrival; differentiable (backward: the same MXFP8
    exchange of the gradient, in reverse).

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0, rows ordered by destination.
    Returns (sum(output_splits), dim), x.dtype, contiguous, rows ordered by source rank; bit for bit
    `reference_mxfp8_a2a` with the same recipe. check: one small all_gather validating every rank's
    arguments (every rank raises if one is bad). chunks: None = auto (pipelined on CUDA for large
    tensors, else simple), 0 = simple, k >= 1 = pipelined with up to k pieces per pair of ranks (must
    be equal on all ranks). recipe: the `MXRecipe` whose elem_dtype, block_size, scaling_mode and
    dim0_kernel (the cast kernel of the quantize and dequantize; "auto": the fastest available) the
    exchange uses (None: DEFAULT_RECIPE, RCEIL e4m3 blocks of 32, "auto"); give the model's recipe
    so that EP and EP=1 quantize alike. transport: "symm" (quantize straight into the peers' symmetric-memory
    buffers: `mxmoe.comm.symm`; CUDA, NCCL group on one host, default format), "nccl" (the process
    group's all-to-all or the `chunks` pipeline) or "auto" (symm where it can run, the format is the
    default and chunks is None, else nccl); equal on all ranks.
    """
    r, plan = _recipe_and_plan(
        "to_mxfp8_a2a_dequant", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    return _MXA2A.apply(x, plan, group, r, chunks, transport)


def a2a_dispatch_mxfp8(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> MXTensor:
    """MXFP8 all-to-all of rows without dequantizing, for an MX expert GEMM.

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0. Returns a 2D MXTensor
    quantized along axis=1 with the recipe (default RCEIL, e4m3, blocks of 32): storage qdata
    (sum(output_splits), dim) elem_dtype, scale (rows, dim // block_size) e8m0, orig_dtype x.dtype, and
    `grad_anchor`, a zero-stride (rows, dim) tensor whose gradient (the high-precision gradient of the
    dequantized rows) is sent back to x's rows with a plain high-precision all-to-all. Consumers take
    `mx.grad_anchor` as their differentiable input.
    check, chunks, transport, recipe: as in `to_mxfp8_a2a_dequant`.
    """
    r, plan = _recipe_and_plan(
        "a2a_dispatch_mxfp8", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    anchor, q, s = _Dispatch.apply(x, plan, group, r, chunks, transport)
    return MXTensor(q, s, 1, r.block_size, r.scaling_mode, x.dtype, anchor)


def a2a_combine(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    recipe: MXRecipe | None = None,
) -> Tensor:
    """High-precision all-to-all of rows whose backward exchanges the gradient in MXFP8.

    x: (sum(input_splits), dim) bfloat16 or float32, dim % block_size == 0. Returns
    (sum(output_splits), dim), x.dtype. Backward: the gradient (rows_out, dim) is quantized with the
    recipe (default RCEIL, e4m3, blocks of 32), sent back with the splits swapped and dequantized to
    x.dtype, exactly like `to_mxfp8_a2a_dequant`'s forward.
    check, chunks, transport, recipe: as in `to_mxfp8_a2a_dequant`.
    """
    r, plan = _recipe_and_plan(
        "a2a_combine", x, output_splits, input_splits, group, check, chunks, transport, recipe
    )
    return _Combine.apply(x, plan, group, r, chunks, transport)


def all_to_all_hp(x: Tensor, output_splits, input_splits, group=None, *, check: bool = True) -> Tensor:
    """Plain differentiable all-to-all of rows in x's own dtype (bf16 expert parallelism).

    x: (sum(input_splits), ...) any dtype. Returns (sum(output_splits), ...), contiguous. Backward:
    the same exchange of the gradient in reverse.
    """
    plan = check_and_plan("all_to_all_hp", x, output_splits, input_splits, group, check=check, mx=False)
    return _HPA2A.apply(x, plan, group)


class _Reference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, outs, ins, group, r):
        ctx.args = (outs, ins, group, r)
        return _reference_once(x, outs, ins, group, r)

    @staticmethod
    def backward(ctx, grad):
        outs, ins, group, r = ctx.args
        return _reference_once(grad.contiguous(), ins, outs, group, r), None, None, None, None


def _reference_once(x: Tensor, outs: list[int], ins: list[int], group, r: MXRecipe) -> Tensor:
    mx = to_mx(x, axis=-1, recipe=r)
    rows, dim = sum(outs), x.shape[1]
    q = torch.empty((rows, dim), dtype=torch.uint8, device=x.device)
    s = torch.empty((rows, dim // r.block_size), dtype=torch.uint8, device=x.device)
    all_to_all_rows(q, mx.qdata_blocked.view(torch.uint8), outs, ins, group)
    all_to_all_rows(s, mx.scale_blocked.view(torch.uint8), outs, ins, group)
    out = MXTensor(
        q.view(r.elem_dtype), s.view(torch.float8_e8m0fnu), 1, r.block_size, r.scaling_mode, x.dtype
    )
    return out.dequantize(recipe=r)


def reference_mxfp8_a2a(
    x: Tensor,
    output_splits,
    input_splits,
    group=None,
    *,
    recipe: MXRecipe | None = None,
) -> Tensor:
    """The definition the MXFP8 all-to-all must match: quantize (to_mx with the recipe, default
    DEFAULT_RECIPE: RCEIL, e4m3, along dim) -> plain all_to_all_single of element and scale bytes ->
    dequantize to x.dtype, both with the recipe's dim0_kernel. Differentiable: backward does the
    same to the gradient with the splits swapped. No overlap, no checks."""
    r = _recipe(recipe, "reference_mxfp8_a2a")
    outs = list(output_splits.tolist() if isinstance(output_splits, Tensor) else output_splits)
    ins = list(input_splits.tolist() if isinstance(input_splits, Tensor) else input_splits)
    return _Reference.apply(x, outs, ins, group, r)
