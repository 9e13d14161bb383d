"""The MXFP8 exchange over the process group (NCCL on GPUs, gloo on CPU): the simple path and the
overlapped pipeline.

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
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.mx_rows import _dequantize, _dequantize_into, _qdq_into, _quantize
from mxmoe.comm.transport import TRANSPORTS, Plan, Transport, offsets
from mxmoe.formats import MXFormat
from mxmoe.registry import Backend

# Auto policy: two pieces beat the simple path at 16x8192x5120 bf16 (fwd+bwd, 2 GPUs), more pieces
# lost, and below ~100 MB per peer every pipelined variant lost to the simple path. So on CUDA,
# pipeline only when the group's mean elements per rank reach PIPELINE_MIN_ELEMS (from the checked
# plan: every rank decides alike), in ceil(fp8 bytes / MIN_PIECE_BYTES) pieces, at most MAX_CHUNKS per pair.
PIPELINE_MIN_ELEMS = 512 << 20
MIN_PIECE_BYTES = 128 << 20
MAX_CHUNKS = 2


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


def _simple_mx_exchange(x: Tensor, plan: Plan, group, r: MXFormat, k: str, dequant: bool):
    dim = x.shape[1]
    q, s = _quantize(x, r, k)
    rows_out = sum(plan.output_splits)
    q_out = torch.empty((rows_out, dim), dtype=torch.uint8, device=x.device)
    s_out = torch.empty((rows_out, dim // r.block_size), dtype=torch.uint8, device=x.device)
    all_to_all_rows(q_out, q.view(torch.uint8), plan.output_splits, plan.input_splits, group)
    all_to_all_rows(s_out, s.view(torch.uint8), plan.output_splits, plan.input_splits, group)
    q_out, s_out = q_out.view(r.elem_dtype), s_out.view(r.scale_dtype)
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
    x: Tensor, plan: Plan, group, r: MXFormat, k: str, dequant: bool, chunks: int | None
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
    return q_dst.view(r.elem_dtype), s_dst.view(r.scale_dtype)


class NCCLTransport(Transport):
    """The process group's all-to-all (NCCL on GPUs, gloo on CPU): the simple path, or the
    pipeline above when `chunks` asks for pieces (or the rows are large enough, on CUDA)."""

    name = "nccl"

    def mx_exchange(self, x, plan, group, fmt, kernel, dequant, chunks):
        pipelined = _use_pipeline(x.is_cuda, plan, chunks)
        if plan.world == 1 and not pipelined:  # one rank: the exchange's rounding, nothing moved
            q, s = _quantize(x, fmt, kernel)
            return _dequantize(q, s, x.dtype, fmt, kernel) if dequant else (q, s)
        if pipelined:
            return _pipelined_mx_exchange(x, plan, group, fmt, kernel, dequant, chunks)
        return _simple_mx_exchange(x, plan, group, fmt, kernel, dequant)

    def exchange(self, x, plan, group):
        out = x.new_empty((sum(plan.output_splits), *x.shape[1:]))
        return all_to_all_rows(out, x, plan.output_splits, plan.input_splits, group)


TRANSPORT = NCCLTransport()
BACKEND = Backend(
    "nccl",
    __name__,
    why_unavailable=lambda site: None,  # any process group, any device, any format
    auto_rank=lambda site: 1,
)
"""Runs everywhere; "auto" takes it where symmetric memory cannot run."""
TRANSPORTS.register(BACKEND)
