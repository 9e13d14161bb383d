"""What a transport of the expert-parallel exchange is: `Transport` (how an expert-parallel group's
rows travel) and `ExchangeSite` (where an exchange runs: what a transport's availability and rank
for "auto" read). The transports themselves and their registry: `mxmoe.comm.transports`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from mxmoe.comm.splits import Plan
    from mxmoe.recipe import MXRecipe


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
    fmt: tuple | None
    """(elem_dtype, block_size, scaling_mode) of MXFP8 rows; None: rows in their own dtype, or not
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
        self, x: Tensor, plan: Plan, group, recipe: MXRecipe, kernel: str, dequant: bool, chunks: int | None
    ):
        """x (rows_in, dim) bf16/fp32 contiguous, rows ordered by destination -> quantized with
        `recipe` along dim, moved per `plan` (cast kernel `kernel`, concrete) and, if `dequant`,
        dequantized: y (rows_out, dim) x.dtype; else (q (rows_out, dim) recipe.elem_dtype, s
        (rows_out, dim // block_size) float8_e8m0fnu). Bit for bit `reference_mxfp8_a2a`."""
        raise NotImplementedError(f"transport {self.name!r} does not exchange rows by split sizes")

    def exchange(self, x: Tensor, plan: Plan, group) -> Tensor:
        """x (rows_in, ...) any dtype -> (rows_out, ...) the same dtype: the rows moved per `plan`."""
        raise NotImplementedError(f"transport {self.name!r} does not exchange rows by split sizes")

    def dispatcher(self, group, *, transport: str, mxfp8: bool, chunks: int | None):
        """The token dispatcher (`mxmoe.comm.dispatch.TokenDispatcher`) of expert-parallel group
        `group` over this transport: mxmoe's all-to-all dispatcher, whose rows take `transport`
        ("auto" or this transport's name). A token-level transport returns its own."""
        from mxmoe.comm.dispatch import AllToAllDispatcher

        return AllToAllDispatcher(group, transport=transport, mxfp8=mxfp8, chunks=chunks)
