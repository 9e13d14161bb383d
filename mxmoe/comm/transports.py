"""The transports of the expert-parallel exchange, chosen by name in one registry: `TRANSPORTS`.

A transport moves an expert-parallel group's rows between its ranks. Each one is a
`mxmoe.registry.Backend` declared in the file that implements it (whether it can run at an
`ExchangeSite`, and its rank for "auto" there) and registered below; its module exposes the
implementation as `TRANSPORT` (a `Transport`):

- "symm" (`mxmoe.comm.symm`): one kernel per exchange quantizes each peer's rows straight into
  its symmetric-memory buffer (CUDA, an NCCL group of GPUs on one host, the default MX format);
  "auto" takes it there;
- "nccl" (`mxmoe.comm.nccl`): the process group's all-to-all (NCCL, or gloo on CPU), with the
  NCCL pipeline when `chunks` asks for it; it runs everywhere.

Rows are what mxmoe's all-to-all token dispatcher (`mxmoe.comm.dispatch.AllToAllDispatcher`)
moves: every row transport serves it. A transport that moves tokens itself (e.g. DeepEP: tokens
and their top-k expert ids in, each token sent once per destination rank, expert-ordered rows
out) registers the same way with `moves_rows = False` and returns its own token dispatcher from
`Transport.dispatcher`; the exchanges of rows by split sizes (`mxmoe.comm.a2a`) never pick it.

Choosing one is a lookup: `row_transport` for an exchange of rows (called where the exchange
runs eagerly: inside the custom ops of `mxmoe.comm.ops`, never while torch.compile traces), and
`make_dispatcher` for an expert-parallel group (when expert parallelism is applied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from mxmoe.comm import nccl, symm
from mxmoe.comm.transport import ExchangeSite, Transport
from mxmoe.registry import Registry

if TYPE_CHECKING:
    from mxmoe.recipe import MXRecipe

AUTO = "auto"

TRANSPORTS = Registry("exchange transport")
"""The exchange's transports by name (module docstring)."""


TRANSPORTS.register(symm.BACKEND)
TRANSPORTS.register(nccl.BACKEND)


def choices() -> tuple[str, ...]:
    """What `transport=` accepts: "auto" and the registered names."""
    return (AUTO, *TRANSPORTS.names())


def check_transport(transport, what: str = "transport") -> str:
    """ValueError naming `what` unless `transport` is "auto" or a registered transport."""
    if not isinstance(transport, str) or transport not in choices():
        raise ValueError(f"{what}={transport!r}; expected one of {list(choices())}")
    return transport


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


def _load(name: str) -> Transport:
    return TRANSPORTS.load(name).TRANSPORT


def _resolve(choice: str, site: ExchangeSite, what: str) -> str:
    if choice == AUTO:
        return TRANSPORTS.resolve(AUTO, site)
    reason = TRANSPORTS.get(choice, what).why_unavailable(site)
    if reason is not None:
        raise RuntimeError(f"{what}={choice!r} {reason}")
    return choice


def row_transport(
    choice: str, x: Tensor, group, recipe: MXRecipe | None, chunks: int | None, world: int
) -> Transport:
    """The transport that moves x's rows among the `world` ranks of `group`: `choice` ("auto" or a
    name; RuntimeError naming it when it cannot run here), quantized in `recipe`'s format (None:
    rows in their own dtype). One rank exchanges nothing: the process group's transport (a local
    copy or quantize-dequantize) whatever the choice."""
    if world == 1:
        return _load("nccl")
    fmt = None if recipe is None else (recipe.elem_dtype, recipe.block_size, recipe.scaling_mode)
    site = ExchangeSite(x.device.type, group_name(group), world, fmt, chunks is not None, True, group)
    name = _resolve(choice, site, "transport")
    t = _load(name)
    if not t.moves_rows:  # its availability should have refused a rows site
        raise RuntimeError(
            f"transport={name!r} moves tokens, not rows by split sizes; its why_unavailable must refuse "
            "sites with ExchangeSite.rows"
        )
    return t


def make_dispatcher(group, *, transport: str = AUTO, mxfp8: bool = True, chunks: int | None = None):
    """The token dispatcher of expert-parallel group `group`: the transport `transport` names
    ("auto": the available one of lowest rank, refined per exchange for row transports) makes it.
    mxfp8: send the dispatched rows (and the combine's gradient) as MXFP8 where the experts take
    an MX recipe; chunks: the NCCL pipeline's pieces (mxmoe.comm.to_mxfp8_a2a_dequant)."""
    check_transport(transport)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() and _backend_is_nccl(group) else "cpu"
    site = ExchangeSite(device, group_name(group), world, None, chunks is not None, False, group)
    name = _resolve(transport, site, "transport")
    return _load(name).dispatcher(group, transport=transport, mxfp8=mxfp8, chunks=chunks)


def _backend_is_nccl(group) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return "nccl" in str(dist.get_backend(group))

