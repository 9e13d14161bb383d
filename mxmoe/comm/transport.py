"""What a transport of the expert-parallel exchange is, and the registry that chooses one by name.

A transport moves an expert-parallel group's rows between its ranks: `Transport` (its methods),
`Plan` (one checked exchange: the row splits), `ExchangeSite` (where an exchange runs: what a
transport's availability and rank for "auto" read) and `TRANSPORTS` (the registry). This module
stands below everything in `mxmoe.comm` that uses a transport; each transport is a
`mxmoe.registry.Backend` declared and registered in the file that implements it:

- "symm" (`mxmoe.comm.symm`): one kernel per exchange quantizes each peer's rows straight into
  its symmetric-memory buffer (CUDA, an NCCL group of GPUs on one host, the default MX format);
  "auto" takes it there;
- "nccl" (`mxmoe.comm.nccl`): the process group's all-to-all (NCCL, or gloo on CPU), with the
  NCCL pipeline when `chunks` asks for it; it runs everywhere.

`mxmoe.comm` imports both, so they are registered once the package is. A new transport is its own
file (ending in `TRANSPORTS.register(BACKEND)`) and one import line in `mxmoe/comm/__init__.py`.
Rows are what mxmoe's all-to-all token dispatcher (`mxmoe.comm.a2a_dispatcher`) moves: every row
transport serves it. A transport that moves tokens itself (e.g. DeepEP: tokens and their top-k
expert ids in, expert-ordered rows out) registers the same way with `moves_rows = False` and
returns its own token dispatcher from `Transport.dispatcher`; the exchanges of rows by split sizes
(`mxmoe.comm.a2a`) never pick it.

Choosing one is a lookup: `row_transport` for an exchange of rows (called where the exchange runs
eagerly: inside the custom ops of `mxmoe.comm.custom_ops`, never while torch.compile traces), and
`mxmoe.comm.a2a_dispatcher.make_dispatcher` for an expert-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor

from mxmoe.registry import Registry

if TYPE_CHECKING:  # annotations only
    from mxmoe.formats import MXFormat

AUTO = "auto"

TRANSPORTS = Registry("exchange transport")
"""The exchange's transports by name (module docstring)."""


def choices() -> tuple[str, ...]:
    """What `transport=` accepts: "auto" and the registered names."""
    return (AUTO, *TRANSPORTS.names())


def check_transport(transport, what: str = "transport") -> str:
    """ValueError naming `what` unless `transport` is "auto" or a registered transport."""
    if not isinstance(transport, str) or transport not in choices():
        raise ValueError(f"{what}={transport!r}; expected one of {list(choices())}")
    return transport


def offsets(splits) -> list[int]:
    """Exclusive prefix sums: where each split starts."""
    out, acc = [], 0
    for n in splits:
        out.append(acc)
        acc += n
    return out


@dataclass(frozen=True)
class Plan:
    """A checked exchange: this rank's place in the group and the row splits (Python ints)."""

    rank: int
    world: int
    input_splits: tuple[int, ...]  # rows of x sent to each rank, in rank order
    output_splits: tuple[int, ...]  # rows received from each rank, in rank order
    row_shape: tuple[int, ...]  # x.shape[1:]
    # Rows sent by all ranks together: known (and equal on every rank) after the shared check, or
    # with one rank; None otherwise. Decisions every rank must take alike (the pipelined path or
    # not) are made from it, never from this rank's own size.
    global_rows: int | None = None

    @property
    def in_offsets(self) -> list[int]:
        return offsets(self.input_splits)

    @property
    def out_offsets(self) -> list[int]:
        return offsets(self.output_splits)

    def reversed(self) -> Plan:
        """The plan of the backward exchange: send back what was received."""
        return Plan(
            self.rank, self.world, self.output_splits, self.input_splits, self.row_shape, self.global_rows
        )


def group_rank_world(group) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("group was given but torch.distributed is not initialized")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group {group}")
    return rank, dist.get_world_size(group)


def group_name(group) -> str:
    """The name of `group` (None: the default group; "" without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    return (group if group is not None else dist.group.WORLD).group_name


def resolve_group(name: str):
    """The process group named `name` ("": None, no torch.distributed)."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@dataclass(frozen=True)
class ExchangeSite:
    """Where an exchange runs: what a transport's availability and rank read (hashable: the
    registry keeps its answer per site)."""

    device_type: str
    """Device type of the rows ("cuda", "cpu", ...)."""
    group_name: str
    """The process group's name ("" without torch.distributed: one rank)."""
    world: int
    """Ranks in the group."""
    fmt: MXFormat | None
    """The format of MX rows (`mxmoe.formats.MXFormat`); None: rows in their own dtype, or not
    known yet (a token dispatcher's choice, made before any row is exchanged)."""
    chunks: bool
    """The caller asked for the NCCL pipeline (`chunks` given)."""
    rows: bool = True
    """True: an exchange of rows by split sizes; False: the choice of a token dispatcher."""
    group: Any = field(default=None, compare=False, hash=False, repr=False)
    """The process group itself (None: the default group), for checks that ask it."""


class Transport:
    """How an expert-parallel group's rows travel; a registered transport's module exposes one as
    `TRANSPORT`. Row transports implement `mx_exchange` and `exchange`; a token-level transport
    sets `moves_rows = False`, overrides `dispatcher`, and declares itself unavailable at sites
    with `rows=True` (an exchange of rows by split sizes)."""

    name: str = ""
    moves_rows: bool = True

    def mx_exchange(
        self, x: Tensor, plan: Plan, group, fmt: MXFormat, kernel: str, dequant: bool, chunks: int | None
    ):
        """x (rows_in, dim) bf16/fp32 contiguous, rows ordered by destination -> quantized in format
        `fmt` along dim, moved per `plan` (cast kernel `kernel`, concrete) and, if `dequant`,
        dequantized: y (rows_out, dim) x.dtype; else (q (rows_out, dim) fmt.elem_dtype, s
        (rows_out, dim // fmt.block_size) fmt.scale_dtype). Bit for bit `reference_mxfp8_a2a`."""
        raise NotImplementedError(f"transport {self.name!r} does not exchange rows by split sizes")

    def exchange(self, x: Tensor, plan: Plan, group) -> Tensor:
        """x (rows_in, ...) any dtype -> (rows_out, ...) the same dtype: the rows moved per `plan`."""
        raise NotImplementedError(f"transport {self.name!r} does not exchange rows by split sizes")

    def dispatcher(self, group, *, transport: str, mxfp8: bool, chunks: int | None):
        """The token dispatcher (`mxmoe.token_dispatch.TokenDispatcher`) of expert-parallel group
        `group` over this transport; None (a row transport): mxmoe's all-to-all dispatcher, whose
        rows take `transport` ("auto" or this transport's name). A token-level transport returns
        its own."""
        return None


def load_transport(name: str) -> Transport:
    """The registered transport called `name` (its module's `TRANSPORT`)."""
    return TRANSPORTS.load(name).TRANSPORT


def resolve_transport(choice: str, site: ExchangeSite, what: str = "transport") -> str:
    """The transport `choice` ("auto" or a name) takes at `site`; RuntimeError naming `what` when a
    named one cannot run there."""
    if choice == AUTO:
        return TRANSPORTS.resolve(AUTO, site)
    reason = TRANSPORTS.get(choice, what).why_unavailable(site)
    if reason is not None:
        raise RuntimeError(f"{what}={choice!r} {reason}")
    return choice


def row_transport_name(
    choice: str, x: Tensor, group, fmt: MXFormat | None, chunks: int | None, world: int
) -> str:
    """The name of the transport `row_transport` takes (what "auto" chose: benchmarks record it)."""
    if world == 1:
        return "nccl"
    site = ExchangeSite(x.device.type, group_name(group), world, fmt, chunks is not None, True, group)
    return resolve_transport(choice, site)


def row_transport(
    choice: str, x: Tensor, group, fmt: MXFormat | None, chunks: int | None, world: int
) -> Transport:
    """The transport that moves x's rows among the `world` ranks of `group`: `choice` ("auto" or a
    name; RuntimeError naming it when it cannot run here), quantized in format `fmt` (None: rows in
    their own dtype). One rank exchanges nothing: the process group's transport (a local
    copy or quantize-dequantize) whatever the choice."""
    name = row_transport_name(choice, x, group, fmt, chunks, world)
    t = load_transport(name)
    if not t.moves_rows:  # its availability should have refused a rows site
        raise RuntimeError(
            f"transport={name!r} moves tokens, not rows by split sizes; its why_unavailable must refuse "
            "sites with ExchangeSite.rows"
        )
    return t
