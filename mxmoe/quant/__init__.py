"""Casts between high precision and MX: `to_mx`, `to_mx_dim0_dim1`, `MXTensor`, kernel choice."""

from mxmoe.quant.backends import KERNELS, available_kernels, resolve_kernel
from mxmoe.quant.mx_tensor import MXTensor, to_mx, to_mx_dim0_dim1

__all__ = ["KERNELS", "MXTensor", "available_kernels", "resolve_kernel", "to_mx", "to_mx_dim0_dim1"]
