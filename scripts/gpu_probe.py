"""Quick facts about the GPU toolchain that the cast kernels depend on (FTZ, fp8 cvt)."""
import torch
import triton
import triton.language as tl

print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))


@triton.jit
def _mul(x_ptr, s_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    s = tl.load(s_ptr + o, mask=m)
    tl.store(y_ptr + o, x * s, mask=m)


@triton.jit
def _cvt(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(y_ptr + o, x.to(tl.float8e4nv), mask=m)



import mxmoe  # noqa: E402

g = torch.Generator().manual_seed(0)
xc = torch.randn(4096, 1024, generator=g) * torch.pow(2.0, torch.randint(-140, 120, (4096, 32), generator=g).float()).repeat_interleave(32, 1)
for mode in ["floor", "rceil", "ceil", "even"]:
    ref = mxmoe.to_mx(xc, scaling_mode=mode, kernel="torch")
    eager = mxmoe.to_mx(xc.cuda(), scaling_mode=mode, kernel="torch")
    comp = torch.compile(lambda t: mxmoe.to_mx(t, scaling_mode=mode, kernel="torch"), fullgraph=True)(xc.cuda())
    for name, m in [("eager", eager), ("compiled", comp)]:
        dq = (m.qdata.cpu().view(torch.uint8) != ref.qdata.view(torch.uint8)).sum().item()
        ds = (m.scale.cpu().view(torch.uint8) != ref.scale.view(torch.uint8)).sum().item()
        dd = (m.dequantize(torch.float32, kernel="torch").cpu().view(torch.int32) != ref.dequantize(torch.float32).view(torch.int32)).sum().item()
        print(f"torch backend cuda {name} {mode}: q mismatches {dq}, scale mismatches {ds}, dequant mismatches {dd}")
from mxmoe.bench.timing import copy_bandwidth_tbs  # noqa: E402

print("copy TB/s", copy_bandwidth_tbs())
