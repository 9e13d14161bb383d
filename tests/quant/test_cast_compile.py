"""The casts under torch.compile on CPU: no graph breaks for any kernel, and compiled code gives the
same bytes as eager and as the oracle. Two inductor compiles in all (compiling is slow on 2 cores)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import recipe_for

import mxmoe
from mxmoe.formats import make_spec
from mxmoe.quant import to_mx, to_mx_dim0_dim1, torch_cast
from tests.quant.helpers import assert_bytes, check_dequant, check_quant, data, level, to_torch, ubytes

KERNELS = mxmoe.available_kernels("cpu")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kernel", KERNELS)
def test_no_graph_breaks(kernel):
    """torch._dynamo.explain sees one graph and no break for dim0, dim1, 3D, fused and dequantize."""

    r = recipe_for(kernel)

    def fn(x, x3):
        a = to_mx(x, axis=-1, recipe=r)
        b = to_mx(x, axis=0, recipe=recipe_for(kernel, scaling_mode="floor", elem_dtype=torch.float8_e5m2))
        c = to_mx(x3, axis=-2, recipe=recipe_for(kernel, scaling_mode="even"))
        d0, d1 = to_mx_dim0_dim1(x, recipe=recipe_for(kernel, scaling_mode="ceil"))
        return (
            a.dequantize(torch.float32, recipe=r) + b.dequantize(torch.float32, recipe=r)
            + d0.dequantize(torch.float32, recipe=r) + d1.dequantize(torch.float32, recipe=r),
            c.dequantize(recipe=r),
        )

    x = torch.randn(64, 128, dtype=torch.bfloat16)
    x3 = torch.randn(2, 64, 32, dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(fn)(x, x3)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_to_mx_dequantize_matches_eager():
    """fullgraph=True compile of to_mx + dequantize (torch kernel): same bytes as eager and oracle."""
    mode, elem, dtype = "rceil", torch.float8_e4m3fn, torch.float32
    x32 = data(33, 32, mode, elem, dtype, level("torch"))
    x = to_torch(x32, dtype)

    def fn(x):
        mx = to_mx(x, recipe=recipe_for("torch", scaling_mode=mode, elem_dtype=elem))
        return mx.qdata_blocked, mx.scale_blocked, mx.dequantize(torch.bfloat16, recipe=recipe_for("torch"))

    q, s, y = torch.compile(fn, fullgraph=True)(x)
    qe, se, ye = fn(x)
    assert_bytes(q, ubytes(qe), "compiled qdata vs eager")
    assert_bytes(s, ubytes(se), "compiled scale vs eager")
    assert torch.equal(y.view(torch.int16), ye.view(torch.int16))
    ws, wq = check_quant(s, q, x32, 32, mode, elem, "compiled to_mx")
    check_dequant(y, ws, wq, 32, elem, "compiled dequantize")


def test_inductor_compiled_torch_backend_matches_oracle():
    """The torch backend's own code compiled by inductor (what `torch.compile` of a model that inlines
    it would run): RCEIL dim0 cast + fp32 dequantize on the special classes, incl. subnormals."""
    mode, elem, dtype = "rceil", torch.float8_e5m2, torch.bfloat16
    spec = make_spec(32, mode, elem)
    x32 = data(33, 32, mode, elem, dtype, level("torch"))
    x = to_torch(x32, dtype)

    def fn(x):
        q, s = torch_cast.quantize_dim0(x, spec)
        # uint8 out: inductor's CPU codegen has no float8_e8m0fnu buffers (torch 2.13)
        return q, s.view(torch.uint8), torch_cast.dequantize(q, s, 32, torch.float32)

    q, s, y = torch.compile(fn, fullgraph=True)(x)
    s = s.view(torch.float8_e8m0fnu)
    ws, wq = check_quant(s, q, x32, 32, mode, elem, "inductor torch_cast.quantize_dim0")
    check_dequant(y, ws, wq, 32, elem, "inductor torch_cast.dequantize")
    assert np.array_equal(ubytes(q), ubytes(torch_cast.quantize_dim0(x, spec)[0]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_compiled_mx_ops_trace_no_kernel_resolution(kernel, monkeypatch):
    """Compiling MX ops (mx_mm on the emulated GEMM's qdq path, mx_grouped_mm on the MX path: the
    casts, to_mx, dequantize) with nothing resolved before: Dynamo never warns that it traced a
    `functools.lru_cache` wrapper (the kernel choice is made at trace time as a constant of the
    graph, `mxmoe.quant.backends._resolve_at_trace`), the graph is whole, and the compiled results
    are eager's."""
    import warnings

    import mxmoe.ops.gemm_backend as gemm_backend
    from mxmoe.ops import mx_grouped_mm, mx_mm
    from mxmoe.quant import backends

    r = recipe_for(kernel)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 64, generator=g), torch.randn(3, 32, 64, generator=g)
    offs = torch.tensor([10, 10, 64], dtype=torch.int32)

    def fn(x, w, w2):
        m = to_mx(x, recipe=r)
        return mx_mm(x, w2.t(), r), mx_grouped_mm(x, w.transpose(-2, -1), offs, r), m.dequantize(recipe=r)

    def mx_path(x, w, w2):  # the grouped op on its MX path (to_mx casts, as on Blackwell)
        with monkeypatch.context() as m:
            m.setattr(gemm_backend, "QDQ_BACKENDS", frozenset())
            return fn(x, w, w2)

    backends.clear_resolved()
    torch._dynamo.utils.warn_once_cache.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = torch.compile(fn, backend="eager", fullgraph=True)(x, w, w[0])
        got_mx = torch.compile(mx_path, backend="eager", fullgraph=True)(x, w, w[0])
    lru = [str(s.message) for s in seen if "lru_cache" in str(s.message)]
    assert not lru, lru[0]
    for a, b in zip((*got, *got_mx), (*fn(x, w, w[0]), *mx_path(x, w, w[0])), strict=True):
        assert torch.equal(a, b)


def test_compiled_cast_of_a_format_no_eager_call_made(monkeypatch):
    """A cast whose format (block 16, e5m2, floor) is first met inside torch.compile(fullgraph=True):
    the custom ops get the format's name before anything registered it, and find it (it failed with
    "format 'mxfp8_e5m2_floor_b16' is not registered"); same bytes as eager."""
    from mxmoe import formats

    key = (torch.float8_e5m2, 16, formats.ScalingMode.FLOOR)
    name = formats.format_name(*key)
    assert name == "mxfp8_e5m2_floor_b16"
    monkeypatch.delitem(formats.FORMATS, name, raising=False)  # (restored after the test)
    monkeypatch.delitem(formats._BY_KEY, key, raising=False)
    x = torch.randn(64, 64)

    def fn(x):
        mx = to_mx(x, 0, "floor", torch.float8_e5m2, 16)
        d0, d1 = to_mx_dim0_dim1(x, "floor", torch.float8_e5m2, 16)
        return mx.qdata_blocked, mx.scale_blocked, mx.dequantize(), d0.dequantize(), d1.dequantize()

    got = torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert formats.FORMATS[name].key == key
    for i, (g, w) in enumerate(zip(got, fn(x), strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), i


def test_get_format_by_generated_name_only():
    """get_format takes the names format_name spells (registering the format), nothing else."""
    from mxmoe.formats import ScalingMode, format_of, get_format

    assert get_format("mxfp8_e4m3_ceil_b8") is format_of(torch.float8_e4m3fn, 8, ScalingMode.CEIL)
    bads = ("mxfp8_e4m3_rceil_b3", "mxfp8_e4m3_rceil_b016", "mxfp8_e4m3_rceil_b32", "mxfp8_e4m3_round", 5)
    for bad in bads:
        with pytest.raises(ValueError, match=rf"^format {bad!r} is not registered; expected one of \["):
            get_format(bad)
