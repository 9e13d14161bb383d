"""Transports registered by tests, through the registry's public slot (`mxmoe.comm.TRANSPORTS`), and
a log of what the exchange hands to the collective.

- "rounded_bf16": the MXFP8 exchange's numbers with none of its bytes: each row is quantized and
  dequantized where it starts (the recipe's format, as the MXFP8 exchange quantizes it) and sent in
  its own dtype; the receiver quantizes it again where MX rows are asked for (an MX-rounded row
  quantizes to the same values). A run on it must give the MXFP8 run's numbers, bit for bit.
- "gather_tokens": a token-level transport, the kind DeepEP is: it moves tokens (once per rank, not
  once per routed expert) with their top-k expert ids, and returns its own token dispatcher. Every
  rank gathers every token; each runs its experts on the tokens routed to them; the outputs are
  summed back over the ranks and each rank keeps its tokens'.
- `ExchangeLog`: records (dtype, shape) of every tensor handed to `torch.distributed.all_to_all_single`
  (the collective every row transport of the process group ends in; rows go as bytes: a row of D
  elements is (D * itemsize,) uint8, an MXFP8 row (D,) elements plus (D / 32,) scales).
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from mxmoe.comm import TRANSPORTS
from mxmoe.comm.mx_rows import _dequantize, _quantize
from mxmoe.comm.nccl import TRANSPORT as PROCESS_GROUP
from mxmoe.comm.transport import Transport
from mxmoe.registry import Backend
from mxmoe.token_dispatch import UNQUANTIZED


class RoundedBF16Transport(Transport):
    name = "rounded_bf16"

    def mx_exchange(self, x, plan, group, fmt, kernel, dequant, chunks):
        rounded = _dequantize(*_quantize(x, fmt, kernel), x.dtype, fmt, kernel)
        y = PROCESS_GROUP.exchange(rounded, plan, group)
        return y if dequant else _quantize(y, fmt, kernel)

    def exchange(self, x, plan, group):
        return PROCESS_GROUP.exchange(x, plan, group)


class GatherTokensDispatcher:
    """A token dispatcher that gathers every token on every rank (the `TokenDispatcher` protocol)."""

    def __init__(self, group):
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def dispatch(self, x, idx, scores, *, num_experts, rows_as=UNQUANTIZED):
        T = x.shape[0]
        xs = torch.cat(dist_nn.all_gather(x, group=self.group))  # (ep * T, D), gradient summed back
        ids = [torch.empty_like(idx) for _ in range(self.ep)]
        dist.all_gather(ids, idx, group=self.group)
        ids = torch.cat(ids)
        El = num_experts // self.ep
        lo = self.rank * El
        t, j = ((ids >= lo) & (ids < lo + El)).nonzero(as_tuple=True)
        local = ids[t, j] - lo
        order = torch.argsort(local, stable=True)
        t, j = t[order], j[order]
        counts = torch.bincount(local, minlength=El)
        return xs.index_select(0, t), counts, (t, j, T, ids.shape, scores, x.dtype)

    def combine(self, y, handle):
        t, j, T, shape, scores, dtype = handle
        full = y.new_zeros((*shape, y.shape[-1])).index_put((t, j), y)  # (ep * T, k, D)
        mine = dist_nn.all_reduce(full, group=self.group)[self.rank * T : (self.rank + 1) * T]
        return (mine.float() * scores.unsqueeze(-1)).sum(1).to(dtype)


class GatherTokensTransport(Transport):
    name = "gather_tokens"
    moves_rows = False

    def dispatcher(self, group, *, transport, mxfp8, chunks):
        return GatherTokensDispatcher(group)


TRANSPORT_OF = {"rounded_bf16": RoundedBF16Transport(), "gather_tokens": GatherTokensTransport()}


def _why_unavailable(name: str):
    def why(site) -> str | None:
        if not TRANSPORT_OF[name].moves_rows and site.rows:
            return "moves tokens, not rows by split sizes"
        return None

    return why


ACTIVE: set[str] = set()
"""The test transports "auto" takes (before the built-in ones) where they can run."""


def register(name: str) -> None:
    """Register test transport `name` (once per process); "auto" takes it while it is active."""
    if name in TRANSPORTS.names():
        return
    module_name = f"{__name__}._{name}"
    module = types.ModuleType(module_name)
    module.TRANSPORT = TRANSPORT_OF[name]
    sys.modules[module_name] = module
    TRANSPORTS.register(
        Backend(name, module_name, _why_unavailable(name), lambda site: -1 if name in ACTIVE else None)
    )


def activate(*names: str) -> None:
    """Make "auto" take test transports `names` (registering them), and no other test transport."""
    for name in names:
        register(name)
    ACTIVE.clear()
    ACTIVE.update(names)
    TRANSPORTS.clear()  # forget the choices made before


class ExchangeLog(contextlib.AbstractContextManager):
    """(dtype, shape) of each input handed to torch.distributed.all_to_all_single while open."""

    def __init__(self):
        self.calls: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def __enter__(self):
        self._orig = dist.all_to_all_single

        def recording(output, input, *args, **kwargs):
            self.calls.append((input.dtype, tuple(input.shape)))
            return self._orig(output, input, *args, **kwargs)

        dist.all_to_all_single = recording
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig
        return False

    def rows(self, row_bytes: int) -> list[int]:
        """Row counts of the calls that moved rows of `row_bytes` bytes (uint8 (n, row_bytes))."""
        return [s[0] for d, s in self.calls if d == torch.uint8 and len(s) == 2 and s[1] == row_bytes]


def mx_and_unquantized_rows(log: ExchangeLog, dim: int, itemsize: int):
    """(element rows, scale rows, unquantized rows) of the calls in `log` for rows of `dim` elements:
    MXFP8 element bytes (dim per row), their scales (dim / 32), rows in a dtype of `itemsize` bytes."""
    return log.rows(dim), log.rows(dim // 32), log.rows(dim * itemsize)
