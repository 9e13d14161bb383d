"""Host cost per call of the public MX casts, beside torch's native fp8 cast, in one run.

Usage: python scripts/cast_host_overhead.py [--device cpu|cuda] [--kernel torch|triton|cuda|auto]
                                             [--shape 64 64] [--calls 2000]

Prints one line per op: microseconds per call (wall time over `calls` back-to-back calls, best of
5 repeats, after warm-up; on CUDA synchronized once per repeat, so with small shapes this is the
host's launch cost, not the kernel). On CPU with small tensors the numbers are dominated by the
Python and dispatcher work per call, which is what this measures.
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernel", default="torch")
    p.add_argument("--shape", type=int, nargs=2, default=(64, 64))
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(*a.shape, dtype=torch.bfloat16, device=dev)
    r = recipe("mxfp8_rceil", dim0_kernel=a.kernel, dim1_kernel=a.kernel)
    mx = to_mx(x, -1, recipe=r)
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
