"""Diagnostics for the MX ops under torch.compile (compact output, one line per check).

1. Does this torch's dynamo bake a wrong `ctx.needs_input_grad` for an autograd.Function whose
   input comes from another autograd.Function? (pure torch, no mxmoe)
2. mx_mm -> mx_grouped_mm compiled with aot_eager on CPU: gradients with each of the two fixes
   on and off (the old behaviour): "flags" = mxmoe.ops.linear.needs_grads / wants_grad (trace
   computes every gradient), "layout" = mxmoe.quant.custom_ops._contiguous (real outputs have the
   fake's contiguous strides).
3. The tests/nn toy model, 3 SGD steps, compiled vs eager losses, same four variants.
4. On CUDA, inductor vs eager gradients of (2) per cast kernel.

Usage: PYTHONPATH=. python scripts/gpu/ops_diag.py
"""

from __future__ import annotations

import sys

import torch

import mxmoe.ops.linear as lin
from mxmoe.ops import MXOpConfig, mx_grouped_mm, mx_mm
from mxmoe.quant import custom_ops


def dynamo_flag_bug() -> str:
    class A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), x.t() @ g

    class B(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w):
            ctx.save_for_backward(h, w)
            return h @ w

        @staticmethod
        def backward(ctx, g):
            h, w = ctx.saved_tensors
            return (g @ w.t() if ctx.needs_input_grad[0] else None), h.t() @ g

    def f(x, w1, w2):
        return B.apply(A.apply(x, w1), w2).sum()

    torch.manual_seed(0)
    base = [torch.randn(4, 4) for _ in range(3)]
    grads = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        ps = [t.clone().requires_grad_() for t in base]
        fn(*ps).backward()
        grads.append(ps[0].grad)
    bad = not torch.equal(grads[0], grads[1])
    zero = bool((grads[1] == 0).all())
    return f"needs_input_grad bug in this torch's dynamo: {bad} (compiled x.grad all zero: {zero})"


def ops_body(backend: str, device: str, kernel: str, gemm_dtype=None) -> list[str]:
    cfg = MXOpConfig(kernel=kernel, dim1_kernel=kernel, gemm_dtype=gemm_dtype)
    torch.manual_seed(5)
    offs = torch.tensor([5, 0, 27]).cumsum(0).to(torch.int32).to(device)

    def step(x, w_lin, w_exp):
        h = mx_mm(x, w_lin.t(), cfg)
        y = mx_grouped_mm(h, w_exp.transpose(-2, -1), offs, cfg)
        return (y.float() ** 2).mean()

    base = [torch.randn(32, 64), torch.randn(32, 64) * 0.2, torch.randn(3, 64, 32) * 0.2]
    grads = []
    torch._dynamo.reset()
    for fn in (step, torch.compile(step, fullgraph=True, backend=backend)):
        ps = [t.to(device).requires_grad_() for t in base]
        loss = fn(*ps)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in ps])
    out = []
    for name, g0, g1 in zip(("loss", "x.grad", "w_lin.grad", "w_exp.grad"), *grads, strict=True):
        out.append(
            f"{name}: bit-equal {torch.equal(g0, g1)}, max|diff| {(g0 - g1).abs().max().item():.3g}, "
            f"compiled all-zero {bool((g1 == 0).all())}"
        )
    return out


def nn_losses() -> str:
    sys.path.insert(0, "tests/nn")
    import test_mx_nn as t

    torch._dynamo.reset()
    eager = t.train_losses(t.convert(t.make_model(), t.CPU_CFG))
    compiled = t.train_losses(t.convert(t.make_model(), t.CPU_CFG), compile_=True)
    rel = max(abs(a - b) / abs(a) for a, b in zip(eager, compiled, strict=True))
    return f"nn toy model aot_eager vs eager losses: max rel diff {rel:.3g}"


def main() -> int:
    print(f"torch {torch.__version__}")
    print("[1]", dynamo_flag_bug())
    tracing, contiguous = lin._tracing, custom_ops._contiguous
    for flags_fix in (True, False):
        for layout_fix in (True, False):
            lin._tracing = tracing if flags_fix else (lambda: False)
            custom_ops._contiguous = contiguous if layout_fix else (lambda outs: outs)
            label = f"flags-fix {'on ' if flags_fix else 'off'} layout-fix {'on ' if layout_fix else 'off'}"
            for line in ops_body("aot_eager", "cpu", "torch"):
                print(f"[2] {label} aot_eager cpu {line}")
            print(f"[3] {label}", nn_losses())
    lin._tracing, custom_ops._contiguous = tracing, contiguous
    if torch.cuda.is_available():
        for kernel in ("torch", "triton", "cuda"):
            for gd in (None, torch.float32):
                try:
                    lines = ops_body("inductor", "cuda", kernel, gd)
                except Exception as e:  # keep going: report the failure in one line
                    lines = [f"ERROR {type(e).__name__}: {str(e)[:200]}"]
                for line in lines:
                    print(f"[4] inductor cuda {kernel} gemm={gd or 'bf16'} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
