"""All-to-alls for expert parallelism: MXFP8 (exact, overlapped with the casts) and high precision.

See docs/comm.md. All functions exchange rows of a (tokens, dim) tensor per row splits and work with
any process group (NCCL on GPUs, gloo on CPU); `group=None` is the default group, and without an
initialized process group they act as a single rank.
"""

from mxmoe.comm.a2a import a2a_combine, a2a_dispatch_mxfp8, all_to_all_hp, to_mxfp8_a2a_dequant
from mxmoe.comm.kernels import dequantize_into, qdq_into
from mxmoe.comm.reference import reference_mxfp8_a2a

__all__ = [
    "a2a_combine",
    "a2a_dispatch_mxfp8",
    "all_to_all_hp",
    "dequantize_into",
    "qdq_into",
    "reference_mxfp8_a2a",
    "to_mxfp8_a2a_dequant",
]
