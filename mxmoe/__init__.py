"""mxmoe: mixture-of-experts training in MXFP8, exact and fast on Hopper, runnable on CPU."""

from mxmoe.formats import ELEM_FORMATS, ScalingMode
from mxmoe.quant import MXTensor, available_kernels, to_mx, to_mx_dim0_dim1

__version__ = "0.1.0"

__all__ = [
    "ELEM_FORMATS",
    "MXTensor",
    "ScalingMode",
    "available_kernels",
    "to_mx",
    "to_mx_dim0_dim1",
]
