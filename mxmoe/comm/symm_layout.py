"""Where things are in the symmetric-memory exchange (`mxmoe.comm.symm` describes the protocol):
the workspace's halves and slots (`Layout`), flag tiles, and one rank's work items of one exchange
(`Items`: the ticket order that the Triton kernel, `mxmoe.comm.symm_kernel`, and the CPU emulation,
`mxmoe.comm.symm_emulation`, both follow). Arithmetic on ints and views of a workspace: no kernel,
no process group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mxmoe.formats import DEFAULT_FORMAT

FORMAT = DEFAULT_FORMAT
"""The exchanged format: e4m3 elements, RCEIL e8m0 scales, blocks of 32 (the kernel's constants)."""
ELEM_DTYPE, BLOCK_SIZE, SPEC = FORMAT.elem_dtype, FORMAT.block_size, FORMAT.spec
ALIGN = 256  # bytes: region starts
# Blocks of 32 per flag tile (8192 elements: one flag, one release at system scope); a work item
# covers `per_item` tiles.
TILE_BLOCKS = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def halves_bytes(nbytes: int) -> int:
    """Bytes of one workspace half."""
    return nbytes // 2 // ALIGN * ALIGN


def tiles(rows: int, dim: int) -> int:
    """Flag tiles of `rows` rows of `dim` elements (at least one: an empty pair still signals)."""
    return max(1, -(-rows * (dim // BLOCK_SIZE) // TILE_BLOCKS))


def items_of(rows: int, dim: int, per_item: int) -> int:
    """Store (or receive) work items of a pair of `rows` rows: `per_item` flag tiles each."""
    return -(-tiles(rows, dim) // per_item)


@dataclass(frozen=True)
class Layout:
    """The slots of one workspace half for rows of `dim` elements among `world` ranks. A slot is
    [flags | elements | scales]; the flags come first, at offsets that do not depend on `dim`, so a
    flag never lies on bytes that an exchange of another row width wrote as data."""

    world: int
    dim: int
    half_bytes: int

    @property
    def slot_bytes(self) -> int:
        return self.half_bytes // max(1, self.world - 1) // ALIGN * ALIGN

    @property
    def flag_bytes(self) -> int:
        """Room for the flags of any row width: a tile holds TILE_BLOCKS * 32 element bytes."""
        return min(self.slot_bytes, _align(4 * (self.slot_bytes // (TILE_BLOCKS * BLOCK_SIZE) + 2)))

    def _need(self, rows: int) -> int:
        return _align(rows * self.dim) + _align(rows * (self.dim // BLOCK_SIZE))

    @functools.cached_property
    def slot_rows(self) -> int:
        room = self.slot_bytes - self.flag_bytes
        n = max(0, (room - 2 * ALIGN) // (self.dim + self.dim // BLOCK_SIZE))
        while n > 0 and self._need(n) > room:
            n -= 1
        return n

    def offsets(self, base: int, src: int, dst: int) -> tuple[int, int, int]:
        """Byte offsets, in receiver `dst`'s workspace, of the elements, scales and flags of source
        `src`'s slot in the half at byte `base`."""
        if self.flag_bytes < 4:
            raise ValueError(
                f"MXMOE_SYMM_WORKSPACE_MB gives slots of {self.slot_bytes} bytes for {self.world} ranks; "
                f"expected at least {ALIGN}"
            )
        f0 = base + ((src - dst - 1) % self.world) * self.slot_bytes
        q0 = f0 + self.flag_bytes
        return q0, q0 + _align(self.slot_rows * self.dim), f0

    def slot(self, buf: Tensor, base: int, src: int, dst: int) -> tuple[Tensor, Tensor, Tensor]:
        """Slot of source rank `src` in receiver `dst`'s half at byte `base` of `buf` (1D uint8, dst's
        workspace): (elements (slot_rows, dim) uint8, scales (slot_rows, dim // 32) uint8, flags
        (tiles(slot_rows, dim),) int32)."""
        n, d, sd = self.slot_rows, self.dim, self.dim // BLOCK_SIZE
        q0, s0, f0 = self.offsets(base, src, dst)
        q, sc = buf[q0 : q0 + n * d].view(n, d), buf[s0 : s0 + n * sd].view(n, sd)
        return q, sc, buf[f0 : f0 + 4 * tiles(n, d)].view(torch.int32)


@functools.lru_cache(maxsize=256)
def layout(world: int, dim: int, half_bytes: int) -> Layout:
    """The Layout (cached: its slot_rows is computed once)."""
    return Layout(world, dim, half_bytes)


# Rows of the item table (int64, (len(ROWS), W)): per peer index i (stores to peer (me + 1 + i) % W)
# and per source index i (receives from (me - 1 - i) % W). *_start: prefix sums of the tiles (entries
# i and i + 1); *blk: offsets and counts in blocks of 32; q/s/f: addresses of the slot's elements,
# scales and flags (the peer's slot for stores, this rank's for receives).
ROWS = ("st_start", "st_xblk", "st_nblk", "st_q", "st_s", "st_f",
        "rc_start", "rc_yblk", "rc_nblk", "rc_q", "rc_s", "rc_f")


@dataclass(frozen=True)
class Items:
    """One rank's work items of one exchange: `table` (list of ROWS lists, W entries each), the
    number of store, own and receive items, where the own rows are (blocks), the receive delay, the
    flag tiles per item (`per_item`: item k of a pair covers its tiles k * per_item ...), and the
    table as an int64 tensor on the device (`meta`, made on first use)."""

    table: list[list[int]]
    n_store: int
    n_own: int
    n_recv: int
    own_xblk: int
    own_yblk: int
    own_nblk: int
    delay: int
    per_item: int
    meta: dict = field(default_factory=dict, compare=False)  # device -> the table on it

    def row(self, name: str) -> list[int]:
        return self.table[ROWS.index(name)]

    def kind(self, t: int) -> tuple[str, int]:
        """Item t (< front) of the ticket order: ("store", k), ("own", k) or ("recv", k), k its index
        among items of its kind (the kernel's arithmetic: communication items spread evenly among the
        own tiles; receives spread evenly among the stores from the `delay`-th communication item on)."""
        n_comm = self.n_store + self.n_recv
        c = t * n_comm // self.front
        if (t + 1) * n_comm // self.front == c:
            return "own", t - c
        r = self.recv_before(c)
        return ("recv", r) if self.recv_before(c + 1) > r else ("store", c - r)

    def recv_before(self, c: int) -> int:
        """Receive tiles among the first c communication items."""
        n_comm = self.n_store + self.n_recv
        return min(max(c - self.delay, 0) * self.n_recv // (n_comm - self.delay), self.n_recv)

    @property
    def front(self) -> int:
        return self.n_store + self.n_own + self.n_recv




def timeout_error(code: int, timeout_ms: int) -> RuntimeError:
    """The error of a wait that ran out: `code` is the exchange's error word minus one (-1: this
    rank's own items; else source index << 32 | tile)."""
    if code < 0:
        return RuntimeError(
            f"symmetric-memory exchange: this rank's own work items did not finish within "
            f"MXMOE_SYMM_TIMEOUT_MS={timeout_ms}"
        )
    i, tile = code >> 32, code & 0xFFFFFFFF
    return RuntimeError(
        f"symmetric-memory exchange: no data from source index {i} (rank me - {i + 1}) for tile {tile} "
        f"after MXMOE_SYMM_TIMEOUT_MS={timeout_ms}; every rank must make the same exchanges in the same "
        "order with consistent splits"
    )
