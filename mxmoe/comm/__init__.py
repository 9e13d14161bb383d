"""All-to-alls for expert parallelism: MXFP8 (exact, overlapped with the casts) and unquantized;
their transports chosen by name in one registry (`mxmoe.comm.transport.TRANSPORTS`; the shipped
ones, `nccl` and `symm`, register themselves when imported here); the all-to-all token dispatcher
that expert parallelism goes through (`mxmoe.comm.a2a_dispatcher`).

See docs/comm.md. All functions exchange rows of a (tokens, dim) tensor per row splits and work with
any process group (NCCL on GPUs, gloo on CPU); `group=None` is the default group, and without an
initialized process group they act as a single rank.
"""

from mxmoe.comm import nccl, symm  # noqa: F401  (the shipped transports register themselves)
from mxmoe.comm.a2a import a2a_combine, a2a_dispatch_mxfp8, a2a_unquantized, to_mxfp8_a2a_dequant
from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.reference import reference_mxfp8_a2a
from mxmoe.comm.transport import TRANSPORTS

__all__ = [
    "TRANSPORTS",
    "a2a_combine",
    "a2a_dispatch_mxfp8",
    "a2a_unquantized",
    "dequantize_into",
    "qdq_into",
    "reference_mxfp8_a2a",
    "to_mxfp8_a2a_dequant",
]
