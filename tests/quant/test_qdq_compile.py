"""How torch.compile sees `mxmoe::qdq`: for the Triton kernel on CUDA tensors AOTAutograd decomposes
the op into its body with the launches wrapped by `torch.library.wrap_triton` (so inductor launches
the kernel from its generated code, no call back into the op's Python); for the torch kernel and
for anything on CPU (the Triton interpreter included) the op stays opaque with its fake
implementation. On CPU the decomposition is checked on fake CUDA tensors (the traced graph); on the
GPU (marked gpu) inductor's generated code and its results."""

from __future__ import annotations

import pytest
import torch

from mxmoe.quant.qdq import qdq, qdq_dim0_dim1, qdq_op
from mxmoe.recipe import MXRecipe

ARGS = ("mxfp8_e4m3_rceil", torch.bfloat16)


def _trace(f, *inputs) -> torch.fx.GraphModule:
    """f traced as AOTAutograd does (Python functionalization), inputs fake tensors."""
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(dispatch_functionalize(f))(*inputs)


def _launched_kernels(gm: torch.fx.GraphModule) -> list[str]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return [
        kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
        for n in gm.graph.nodes
        if "triton_kernel_wrapper" in str(n.target)
    ]


def _opaque_calls(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is torch.ops.mxmoe.qdq.default)


def test_triton_on_cuda_decomposes_to_kernel_launches(triton_sm90):
    """Traced on fake CUDA tensors (no GPU needed), with compiled Triton kernels (tests/triton_sm90.py,
    run with TRITON_INTERPRET=0: interpreted kernels are never decomposed): the Triton kernel's calls
    become kernel launches (the 2D grouped call and the 3D per-matrix one), the torch kernel's stays
    the op."""
    from conftest import assert_sm90_check  # here: tests/triton_sm90.py imports this module

    assert_sm90_check(triton_sm90, "qdq_decomposes_into_kernel_launches")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_cpu_stays_one_opaque_op(kernel):
    """On CPU (the torch kernel, or Triton through the interpreter) the op is not decomposed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def f(x):
        return qdq_op(x, *ARGS, True, True, kernel)

    with FakeTensorMode():
        gm = _trace(f, torch.empty(64, 64, dtype=torch.bfloat16))
    assert _launched_kernels(gm) == [] and _opaque_calls(gm) == 1


@pytest.mark.interpreter
def test_cpu_interpreter_compiles_fullgraph_and_matches_eager():
    """The Triton kernel through the interpreter under torch.compile(fullgraph=True, inductor):
    the opaque op, eager's values bit for bit."""
    r = MXRecipe(dim0_kernel="triton", dim1_kernel="triton", gemm_dtype=torch.float32)
    x = torch.randn(70, 64) * 3
    offs = torch.tensor([10, 10, 64], dtype=torch.int32)

    def f(x, offs):
        a, b = qdq_dim0_dim1(x, recipe=r, out_dtype=torch.float32, offs=offs)
        return a, b, qdq(x, -1, recipe=r)

    got = torch.compile(f, fullgraph=True, backend="inductor")(x, offs)
    for g, w in zip(got, f(x, offs), strict=True):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kernel,launch", [("auto", "torch.ops.mxmoe_cuda.qdq_"), ("triton", "qdq_rows_kernel")]
)
def test_gpu_inductor_launches_qdq_kernels_directly(kernel, launch):
    """On the GPU inductor's generated code calls the CUDA qdq C++ operators ("auto") or launches
    the qdq Triton kernel itself ("triton"): no `torch.ops.mxmoe.qdq` call back into Python (2D
    grouped, 2D and 3D weights along N with a short last block per expert); its results equal
    eager's bit for bit."""
    from torch._inductor.utils import run_and_get_code

    r = MXRecipe(dim0_kernel=kernel, dim1_kernel=kernel)
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(4, 100, 512, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 100, 999], dtype=torch.int32, device="cuda")

    def f(x, w, w3, offs):
        a, b = qdq_dim0_dim1(x, recipe=r, offs=offs)
        return a, b, qdq(x, -1, recipe=r), qdq(w, -2, recipe=r), qdq(w3, -2, recipe=r)

    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, w, w3, offs)
    code = "\n".join(codes)
    assert launch in code
    assert "torch.ops.mxmoe.qdq" not in code  # (comments may still name the op the code came from)
    for g, e in zip(got, f(x, w, w3, offs), strict=True):
        assert g.shape == e.shape
        assert torch.equal(g.contiguous().view(torch.int16), e.contiguous().view(torch.int16))
