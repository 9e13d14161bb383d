"""Host-cost contracts of the MX ops' eager call path (scripts/host_cost_cpu.py measures it): the
aten ops one call dispatches (on a GPU each is an allocation, a view or a launch, host time per
call) and its Triton launches, counted on CPU with the launches replaced by counted no-ops."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mxmoe
from mxmoe.ops import mx_grouped_mm, mx_mm
from mxmoe.quant import to_mx, triton_cast, triton_qdq
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1

pytestmark = pytest.mark.interpreter  # the "triton" kernels on CPU tensors


class _NoLaunch:
    """Stands in for `kernel[grid](...)`: counts the launch, runs nothing."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside (detach left out: this mode's own view tracking adds one
    after each dtype view)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ != "detach":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch) -> list:
    out: list = []
    monkeypatch.setattr(triton_qdq, "qdq_rows_kernel", _NoLaunch(out))
    monkeypatch.setattr(triton_cast, "_dim0_kernel", _NoLaunch(out))
    monkeypatch.setattr(triton_cast, "_dim1_pack4_kernel", _NoLaunch(out))
    return out


R = mxmoe.recipe("mxfp8_rceil", dim0_kernel="triton", dim1_kernel="triton", gemm_dtype=torch.bfloat16)


def _ops(fn, launches: list) -> tuple[list[str], int]:
    """The aten ops and the launches of one call of fn (after a first call: kernel choices
    resolved, caches filled)."""
    fn()
    del launches[:]
    with _Ops() as ops:
        fn()
    return ops.names, len(launches)


def test_casts_dispatch_their_outputs_and_one_launch(launches):
    """A qdq call allocates its outputs and launches the kernel, nothing else (the kernel takes the
    tensors as they are: no int views); to_mx adds its kernels' int views of x and of its fp8 and
    e8m0 outputs."""
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([16, 16, 40, 64], dtype=torch.int32)
    assert _ops(lambda: qdq(x, -1, recipe=R), launches) == (["empty_like"], 1)
    assert _ops(lambda: qdq(x, -2, recipe=R, offs=offs), launches) == (["empty_like"], 1)
    assert _ops(lambda: qdq_dim0_dim1(x, recipe=R), launches) == (["empty_like"] * 2, 1)
    assert _ops(lambda: to_mx(x, -1, recipe=R), launches) == (["empty_like", "empty"] + ["view"] * 3, 1)
    assert _ops(lambda: to_mx(x, 0, recipe=R), launches) == (["empty", "empty"] + ["view"] * 3, 1)


def test_mx_ops_fwd_bwd_allocate_one_output_per_cast(launches):
    """mx_mm and mx_grouped_mm forward+backward: 3 qdq launches (x both ways, W both ways, dy both
    ways), each allocating its two outputs; mx_mm's other aten ops are its 3 GEMMs and transposes
    (the caller's W view, the op's W view and its cast's, dy1ᵀ, dW's, autograd's)."""
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    w3 = torch.randn(4, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)

    def mm():
        mx_mm(x, w.t(), R).backward(dy)
        x.grad = w.grad = None

    def grouped():
        mx_grouped_mm(x, w3.transpose(-2, -1), offs, R).backward(dy)
        x.grad = w3.grad = None

    ops, n = _ops(mm, launches)
    assert (Counter(ops), n) == (Counter(t=6, empty_like=6, mm=3), 3), ops
    ops, n = _ops(grouped, launches)  # (on CPU the grouped GEMMs are loops of mm over the groups)
    assert (ops.count("empty_like"), n) == (6, 3), ops


def test_shared_casts_make_fewer_launches_than_separate_calls(launches):
    """Under bf16 autocast with fp32 weights (torchtitan on one GPU), forward+backward: two MXLinears
    on one x through `project` cast x once (5 launches: x, each W and each dy both ways), two calls 6;
    the SwiGLU experts' MLP as one op (`mx_grouped_swiglu_mlp`) launches 8 casts: x, w1, w3, w2, h
    (from g and u), dy and dg, du (from dh, g and u), each both ways."""
    from mxmoe.nn import MXLinear, project
    from mxmoe.ops import mx_grouped_swiglu_mlp

    x = torch.randn(64, 64, requires_grad=True)
    w1, w3 = (MXLinear(64, 64, bias=False, recipe=R) for _ in range(2))
    ws = [torch.randn(4, 64, 64, requires_grad=True) for _ in range(3)]  # w1, w3, w2 (E, N, K)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)

    def step(forward):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = forward()
            y.float().sum().backward()
            for t in (x, w1.weight, w3.weight, *ws):
                t.grad = None

        return run

    assert _ops(step(lambda: sum(project(x, w1, w3))), launches)[1] == 5
    assert _ops(step(lambda: w1(x) + w3(x)), launches)[1] == 6
    mlp = step(lambda: mx_grouped_swiglu_mlp(x, *(w.transpose(-2, -1) for w in ws), offs, R))
    assert _ops(mlp, launches)[1] == 8
