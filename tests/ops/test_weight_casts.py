"""`cast_weight`: on the qdq path, with one process, each MX op casts its weight along K and along
N from one read in the forward and keeps the cast along N for the dgrad, so the backward casts no
weight. The answers (outputs and every gradient) are bit for bit those of casting the weight along
K in the forward and along N in the backward, which several processes still do (FSDP frees each
unsharded weight after the forward: keeping a cast would keep it)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_bits

import mxmoe.ops.linear as linear
import mxmoe.quant.qdq as qdq_mod
from mxmoe.ops import mx_grouped_mm, mx_grouped_swiglu_mlp, mx_mm
from tests.ops.recipes import CPU, CPU_BF16

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def _rand(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


OFFS = torch.tensor([5, 5, 38, 70], dtype=torch.int32)  # an empty group, rows after the last


def _mm(x, ws, r):
    return mx_mm(x, ws[0].t(), r)


def _grouped(x, ws, r):
    return mx_grouped_mm(x, ws[0].transpose(-2, -1), OFFS, r)


def _mlp(x, ws, r):
    return mx_grouped_swiglu_mlp(x, *(w.transpose(-2, -1) for w in ws), OFFS, r)


CASES = {  # op, weight shapes (x is (80, 64))
    "mx_mm": (_mm, [(96, 64)]),
    "mx_grouped_mm": (_grouped, [(4, 96, 64)]),
    "mx_grouped_swiglu_mlp": (_mlp, [(4, 64, 64), (4, 64, 64), (4, 64, 64)]),
}


def _run(op, shapes, recipe, req_x, monkeypatch, processes: int):
    """(output, x.grad, weight grads, quantizer calls in the backward) with `processes` processes."""
    monkeypatch.setattr(linear, "_one_process", lambda: processes == 1)
    calls = [0]
    impl = qdq_mod._qdq_impl

    def counted(*args):
        calls[0] += 1
        return impl(*args)

    monkeypatch.setattr(qdq_mod, "_qdq_impl", counted)
    x = _rand((80, 64), 0).requires_grad_(req_x)
    ws = [(_rand(s, 1 + i, 0.1)).requires_grad_() for i, s in enumerate(shapes)]
    y = op(x, ws, recipe)
    fwd = calls[0]
    (y.float() * _rand(y.shape, 9)).sum().backward()
    return y.detach(), x.grad, [w.grad for w in ws], calls[0] - fwd


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("recipe", [CPU, CPU_BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("req_x", [True, False])
def test_weights_cast_once_same_bits_no_weight_cast_in_backward(monkeypatch, name, recipe, req_x):
    op, shapes = CASES[name]
    one = _run(op, shapes, recipe, req_x, monkeypatch, 1)
    several = _run(op, shapes, recipe, req_x, monkeypatch, 2)
    assert_same_bits(one[0], several[0], "output")
    assert_same_bits(one[1], several[1], "input gradient")
    for i, (a, b) in enumerate(zip(one[2], several[2], strict=True)):
        assert_same_bits(a, b, f"gradient of weight {i}")
        assert a.dtype == torch.float32  # the weight's dtype, not the compute dtype of its cast
    # the backward casts one weight fewer per weight whose dgrad it makes (each weight's whenever
    # x needs a gradient; the MLP's w2 also for w1's and w3's wgrads)
    dgrads = len(shapes) if req_x else (1 if name == "mx_grouped_swiglu_mlp" else 0)
    assert several[3] - one[3] == dgrads, (one[3], several[3])


def test_one_process_is_the_default_without_a_process_group():
    assert not torch.distributed.is_initialized()
    assert linear._one_process()
