"""Argument checks for the all-to-alls: splits, shapes, dtypes, and the optional cross-rank check.

Local checks (types, lengths, sums, dtype, dim, chunks, the rows a rank sends itself) run on every
rank. With `check=True` their outcome and a few ints per rank (dim, dtype, chunks, the MX format,
both split lists) are exchanged with one small all_gather, so a bad argument on one rank raises on
*every* rank instead of leaving the others waiting in the exchange, and mismatches between ranks
(dims, dtypes, MX formats, output_splits that disagree with what the peers send) are caught. With
`check=False` only the local checks run, and a mismatch between ranks surfaces as the process
group's timeout.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm.transport import Plan, check_transport, choices, group_rank_world
from mxmoe.formats import DEFAULT_FORMAT, MODE_IDS, MXFormat

BLOCK_SIZE = DEFAULT_FORMAT.block_size
MX_DTYPES = (torch.bfloat16, torch.float32)
_DTYPE_CODES = [
    torch.bfloat16,
    torch.float32,
    torch.float16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
]


def normalize_splits(name: str, splits, world: int) -> tuple[int, ...]:
    """A list/tuple of ints or a 1D integer tensor (any device) -> tuple of `world` ints >= 0."""
    if isinstance(splits, Tensor):
        if (
            splits.ndim != 1
            or splits.dtype.is_floating_point
            or splits.dtype.is_complex
            or (splits.dtype == torch.bool)
        ):
            raise TypeError(
                f"{name} must be a list of ints or a 1D integer tensor, got a tensor of shape "
                f"{tuple(splits.shape)} and dtype {splits.dtype}"
            )
        values = splits.tolist()
    elif isinstance(splits, list | tuple):
        values = []
        for i, v in enumerate(splits):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"{name}[{i}]={v!r} is not an int; {name} must be a list of ints")
            values.append(int(v))
    else:
        raise TypeError(f"{name} must be a list of ints or a 1D integer tensor, got {type(splits).__name__}")
    if len(values) != world:
        raise ValueError(
            f"{name} has {len(values)} entries but the group has {world} ranks; expected one per rank"
        )
    neg = [(i, v) for i, v in enumerate(values) if v < 0]
    if neg:
        raise ValueError(f"{name}[{neg[0][0]}]={neg[0][1]} is negative; splits are row counts >= 0")
    return tuple(values)


def _local_plan(
    fn: str, x, output_splits, input_splits, rank: int, world: int, mx: bool, block_size: int = BLOCK_SIZE
) -> Plan:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if mx:
        if x.dtype not in MX_DTYPES:
            raise TypeError(f"{fn}: x has dtype {x.dtype}; expected torch.bfloat16 or torch.float32")
        if x.ndim != 2:
            raise ValueError(f"{fn}: x must be 2D (tokens, dim), got shape {tuple(x.shape)}")
        if x.shape[1] % block_size:
            raise ValueError(
                f"{fn}: x.shape[1]={x.shape[1]} (dim) is not divisible by the MX block size {block_size}"
            )
    elif x.ndim < 1:
        raise ValueError(f"{fn}: x must have at least one dim (rows first), got a 0-dim tensor")
    ins = normalize_splits("input_splits", input_splits, world)
    outs = normalize_splits("output_splits", output_splits, world)
    if sum(ins) != x.shape[0]:
        raise ValueError(
            f"{fn}: input_splits {list(ins)} sum to {sum(ins)} but x.shape[0]={x.shape[0]}; they must "
            "split the rows of x"
        )
    if outs[rank] != ins[rank]:  # the rows this rank sends itself: known here, whatever `check`
        raise ValueError(
            f"{fn}: output_splits[{rank}]={outs[rank]} but input_splits[{rank}]={ins[rank]}: rank {rank} "
            f"(this rank) sends itself {ins[rank]} rows; output_splits must equal what each peer sends"
        )
    return Plan(rank, world, ins, outs, tuple(x.shape[1:]))


def gather_rows(
    group, world: int, row: list[int], err: Exception | None, device: torch.device
) -> tuple[list[list[int]], list[int], list | None]:
    """One all_gather of every rank's int row (the same length on every rank; row[0] nonzero where
    that rank's own checks failed with `err`): (the rows, the ranks whose checks failed, and, only
    when there are such ranks, every rank's (error type name, message) or None, gathered so that
    every rank can report the actual problem)."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    meta = torch.stack(gathered).cpu().tolist()
    bad = [r for r in range(world) if meta[r][0]]
    if not bad:
        return meta, bad, None
    msgs: list = [None] * world
    dist.all_gather_object(msgs, None if err is None else (type(err).__name__, str(err)), group=group)
    return meta, bad, msgs


def check_chunks(chunks) -> int | None:
    """`chunks` of the MXFP8 all-to-alls: None (auto), 0 (no pipelining) or an int >= 1."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0):
        raise ValueError(f"chunks={chunks!r}; expected None (auto), 0 (no pipelining) or an int >= 1")
    return chunks


def _meta_device(group, x) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        if "gloo" in backend and not (isinstance(x, Tensor) and x.is_cuda):
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_and_plan(
    fn: str,
    x,
    output_splits,
    input_splits,
    group=None,
    *,
    check: bool = True,
    mx: bool = True,
    chunks: int | None = None,
    transport: str = "auto",
    block_size: int = BLOCK_SIZE,
    fmt: MXFormat | None = None,
) -> Plan:
    """Validate the arguments of an all-to-all and return its Plan.

    Raises TypeError / ValueError naming the argument. With check=True (and more than one rank)
    every rank raises when any rank's arguments are bad or inconsistent with its peers' (fmt: the
    MX format the rows are quantized in, which every rank must share; its block size is the one
    checked against x's dim, else `block_size`).
    """
    if fmt is not None:
        block_size = fmt.block_size
    rank, world = group_rank_world(group)
    err: Exception | None = None
    plan = None
    try:
        if not isinstance(check, bool):  # ("no" was taken as true; the peers still hear of it below)
            raise TypeError(f"{fn}: check={check!r}: expected a bool")
        check_chunks(chunks)
        check_transport(transport)
        plan = _local_plan(fn, x, output_splits, input_splits, rank, world, mx, block_size)
    except (TypeError, ValueError) as e:
        err = e
    if not check or world == 1:
        if err is not None:
            raise err
        return replace(plan, global_rows=sum(plan.input_splits)) if world == 1 else plan

    # One all_gather of [error, dtype, row numel, ndim, chunks, transport, MX element dtype, block
    # size, scaling mode, input_splits..., output_splits...].
    device = _meta_device(group, x)
    if plan is None:
        row = [1] + [-1] * (8 + 2 * world)
    else:
        numel = 1
        for d in plan.row_shape:
            numel *= d
        code = _DTYPE_CODES.index(x.dtype) if x.dtype in _DTYPE_CODES else len(_DTYPE_CODES)
        names = choices()
        row = [0, code, numel, x.ndim, -1 if chunks is None else int(chunks), names.index(transport)]
        row += _format_codes(fmt) + list(plan.input_splits) + list(plan.output_splits)
    meta, bad, msgs = gather_rows(group, world, row, err, device)
    if bad:
        kind, msg = msgs[bad[0]]
        exc = TypeError if kind == "TypeError" else ValueError
        if rank == bad[0]:
            raise exc(f"rank {rank}: {msg}") from err
        raise exc(f"rank {bad[0]} rejected its arguments: {msg}")

    for r in range(1, world):
        if meta[r][1] != meta[0][1]:
            raise TypeError(
                f"{fn}: x has dtype {_name(meta[r][1])} on rank {r} but {_name(meta[0][1])} on rank 0; "
                "all ranks must exchange the same dtype"
            )
        if meta[r][2] != meta[0][2] or meta[r][3] != meta[0][3]:
            raise ValueError(
                f"{fn}: x has {meta[r][2]} elements per row ({meta[r][3]}D) on rank {r} but "
                f"{meta[0][2]} ({meta[0][3]}D) on rank 0; every rank must send rows of the same shape "
                "(dim)"
            )
        if meta[r][4] != meta[0][4]:
            raise ValueError(
                f"{fn}: chunks={_chunks_name(meta[r][4])} on rank {r} but {_chunks_name(meta[0][4])} "
                "on rank 0; all ranks must pass the same chunks"
            )
        if meta[r][5] != meta[0][5]:
            names = choices()
            raise ValueError(
                f"{fn}: transport={names[meta[r][5]]!r} on rank {r} but {names[meta[0][5]]!r} "
                "on rank 0; all ranks must pass the same transport"
            )
        if meta[r][6:9] != meta[0][6:9]:
            raise ValueError(
                f"{fn}: the rows are quantized in {_format_name(meta[r][6:9])} on rank {r} but in "
                f"{_format_name(meta[0][6:9])} on rank 0; all ranks must pass recipes of the same MX "
                "format (element dtype, block size, scaling mode)"
            )
    ins_of = [m[9 : 9 + world] for m in meta]
    outs_of = [m[9 + world : 9 + 2 * world] for m in meta]
    for r in range(world):
        for p in range(world):
            if outs_of[r][p] != ins_of[p][r]:
                raise ValueError(
                    f"{fn}: output_splits[{p}]={outs_of[r][p]} on rank {r}, but rank {p} sends "
                    f"{ins_of[p][r]} rows to rank {r} (its input_splits[{r}]); output_splits must "
                    "equal what each peer sends"
                )
    return replace(plan, global_rows=sum(sum(ins) for ins in ins_of))


def _format_codes(fmt: MXFormat | None) -> list[int]:
    """[element dtype code, block size, scaling mode id] of an MX format; [-1, -1, -1] for none."""
    if fmt is None:
        return [-1, -1, -1]
    code = _DTYPE_CODES.index(fmt.elem_dtype) if fmt.elem_dtype in _DTYPE_CODES else len(_DTYPE_CODES)
    return [code, fmt.block_size, MODE_IDS[fmt.scaling_mode]]


def _format_name(codes: list[int]) -> str:
    if codes[0] < 0:
        return "no MX format"
    mode = next((m.value for m, i in MODE_IDS.items() if i == codes[2]), "another scaling mode")
    return f"{_name(codes[0])} blocks of {codes[1]} ({mode})"


def _name(code: int) -> str:
    return str(_DTYPE_CODES[code]) if 0 <= code < len(_DTYPE_CODES) else "another dtype"


def _chunks_name(v: int) -> str:
    return "None" if v < 0 else str(v)
