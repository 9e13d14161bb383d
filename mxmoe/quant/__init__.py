"""Casts between high precision and MX: `to_mx`, `to_mx_dim0_dim1`, `MXTensor`, kernel choice.

`mx_cast` / `mx_cast_dim0_dim1` are the unchecked fast entries for the ops layer (docs/casts.md)."""

from mxmoe.quant.backends import KERNELS, available_kernels, cast_kernel
from mxmoe.quant.mx_tensor import MXTensor, mx_cast, mx_cast_dim0_dim1, to_mx, to_mx_dim0_dim1

__all__ = [
    "KERNELS",
    "MXTensor",
    "available_kernels",
    "cast_kernel",
    "mx_cast",
    "mx_cast_dim0_dim1",
    "to_mx",
    "to_mx_dim0_dim1",
]
