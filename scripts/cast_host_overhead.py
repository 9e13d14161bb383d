"""Host cost per call of the public MX casts, beside torch's native fp8 cast, in one run.

Usage: python scripts/cast_host_overhead.py [--device cpu|cuda] [--kernel torch|triton|cuda|auto]
                                             [--shape 64 64] [--calls 2000] [--stub-backend]

Prints one line per op: microseconds per call (wall time over `calls` back-to-back calls, best of
5 repeats, after warm-up; on CUDA synchronized once per repeat, so with small shapes this is the
host's launch cost, not the kernel). On CPU with small tensors the numbers are dominated by the
Python and dispatcher work per call, which is what this measures. --stub-backend (with
--kernel torch) replaces the torch backend's functions by ones returning preallocated outputs, so
that only the API's own work around the kernel is timed (what every backend pays on top of its
kernel launch).
"""

from __future__ import annotations

import argparse
import time

import torch

from mxmoe.quant import to_mx, to_mx_dim0_dim1
from mxmoe.recipe import recipe


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def _stub_torch_backend(x: torch.Tensor, mx) -> None:
    """Replace mxmoe.quant.torch_cast's cast functions by ones returning preallocated outputs."""
    from mxmoe.quant import torch_cast

    R, C = x.shape
    q0, s0 = mx.qdata_blocked, mx.scale_blocked
    q1 = torch.empty((1, C, R), dtype=q0.dtype, device=x.device)
    s1 = torch.empty((1, C, R // 32), dtype=s0.dtype, device=x.device)
    y = torch.empty_like(x)
    torch_cast.quantize_dim0 = lambda x, spec, *a, **k: (q0, s0)
    torch_cast.quantize_dim1 = lambda x, spec, *a, **k: (q1, s1)
    torch_cast.quantize_dim0_dim1 = lambda x, spec, *a, **k: (q0, s0, q1[0], s1[0])
    torch_cast.dequantize = lambda q, s, bs, dt, *a, **k: y
    try:  # backends that look their functions up once must look again
        from mxmoe.quant.backends import cast_fn

        cast_fn.cache_clear()
    except ImportError:
        pass


def main() -> None:
    import mxmoe

    print(f"mxmoe from {mxmoe.__file__}")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernel", default="torch")
    p.add_argument("--shape", type=int, nargs=2, default=(64, 64))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--stub-backend", action="store_true", help="time the API around a no-op torch backend")
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(*a.shape, dtype=torch.bfloat16, device=dev)
    r = recipe("mxfp8_rceil", dim0_kernel=a.kernel, dim1_kernel=a.kernel)
    mx = to_mx(x, -1, recipe=r)
    if a.stub_backend:
        _stub_torch_backend(x, mx)
    from mxmoe.formats import make_spec
    from mxmoe.quant import torch_cast

    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    ops = {
        "x.to(float8_e4m3fn) (native)": lambda: x.to(torch.float8_e4m3fn),
        "x.clone() (native)": lambda: x.clone(),
        "torch_cast.quantize_dim0 (bare)": lambda: torch_cast.quantize_dim0(x, spec),
        "to_mx dim0 (recipe=)": lambda: to_mx(x, -1, recipe=r),
        "to_mx dim0 (kernel=)": lambda: to_mx(x, -1, kernel=a.kernel),
        "to_mx dim1 (recipe=)": lambda: to_mx(x, 0, recipe=r),
        "to_mx_dim0_dim1 (recipe=)": lambda: to_mx_dim0_dim1(x, recipe=r),
        "torch_cast.dequantize (bare)": lambda: torch_cast.dequantize(mx.qdata_blocked, mx.scale_blocked, 32, torch.bfloat16),
        "MXTensor.dequantize": lambda: mx.dequantize(kernel=a.kernel),
    }
    print(f"device={dev} kernel={a.kernel} shape={tuple(a.shape)} torch={torch.__version__}")
    for name, fn in ops.items():
        print(f"{name:32s} {per_call_us(fn, a.calls, sync):8.1f} us/call")


if __name__ == "__main__":
    main()
