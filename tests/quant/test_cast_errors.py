"""Bad arguments to the cast API raise before any kernel runs, with an error naming the argument."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import recipe_for

import mxmoe
from mxmoe.quant import MXTensor, to_mx, to_mx_dim0_dim1

KERNELS = mxmoe.available_kernels("cpu")
X = torch.ones(4, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("kernel", ["auto", *KERNELS])
@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int8, torch.float16, torch.float64, torch.float8_e4m3fn]
)
def test_wrong_input_dtype(kernel, dtype):
    x = torch.ones(4, 64).to(dtype)
    with pytest.raises(TypeError, match=rf"x has dtype {dtype}"):
        to_mx(x, recipe=recipe_for(kernel))
    with pytest.raises(TypeError, match=rf"x has dtype {dtype}"):
        to_mx_dim0_dim1(torch.ones(64, 64).to(dtype), recipe=recipe_for(kernel))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        to_mx([[1.0] * 32])


@pytest.mark.parametrize("elem", [torch.float16, torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                  torch.uint8, "float8_e4m3fn"])
def test_wrong_elem_dtype(elem):
    with pytest.raises(TypeError, match="elem_dtype="):
        to_mx(X, elem_dtype=elem)
    with pytest.raises(TypeError, match="elem_dtype="):
        to_mx_dim0_dim1(torch.ones(64, 64), elem_dtype=elem)


# (32.0 and True after a cast with 32 and 1 (invalid) remembered as checked: the memo is by type too;
# [32] is unhashable, so never remembered: checked as given. None is the default format's: 32.)
@pytest.mark.parametrize("bs", [0, 1, 3, 48, -32, 24, True, 32.0, "32", [32]])
def test_bad_block_size(bs):
    to_mx(X, recipe=recipe_for("torch"))
    with pytest.raises(ValueError, match=r"block_size=.*power of two"):
        to_mx(X, block_size=bs)
    with pytest.raises(ValueError, match=r"block_size=.*power of two"):
        to_mx_dim0_dim1(torch.ones(64, 64), block_size=bs)


@pytest.mark.parametrize("mode", ["round", "", "nearest", 1, ["rceil"]])  # (None: the default's)
def test_unknown_scaling_mode(mode):
    with pytest.raises(ValueError, match="scaling_mode="):
        to_mx(X, scaling_mode=mode)
    with pytest.raises(ValueError, match="scaling_mode="):
        to_mx_dim0_dim1(torch.ones(64, 64), scaling_mode=mode)


def test_scaling_mode_is_case_insensitive_and_accepts_the_enum():
    a = to_mx(X * 3, recipe=recipe_for("torch", scaling_mode="RCEIL"))
    b = to_mx(X * 3, recipe=recipe_for("torch", scaling_mode=mxmoe.ScalingMode.RCEIL))
    assert torch.equal(a.scale_blocked.view(torch.uint8), b.scale_blocked.view(torch.uint8))


@pytest.mark.parametrize("shape,axis,bs", [((4, 48), -1, 32), ((48, 4), 0, 32), ((4, 64), -1, 128),
                                          ((2, 3, 40), -1, 16), ((2, 40, 3), -2, 16), ((4, 6), -1, 4)])
def test_size_not_divisible_by_block(shape, axis, bs):
    with pytest.raises(ValueError, match=rf"not divisible by block_size={bs}"):
        to_mx(torch.ones(shape), axis=axis, block_size=bs)


def test_fused_size_not_divisible_by_block():
    with pytest.raises(ValueError, match="not divisible by block_size=32"):
        to_mx_dim0_dim1(torch.ones(48, 64))
    with pytest.raises(ValueError, match="not divisible by block_size=32"):
        to_mx_dim0_dim1(torch.ones(64, 48))


@pytest.mark.parametrize("kernel", ["tritonn", "cutlass", "TORCH", "", None])
def test_unknown_kernel(kernel):
    """A cast kernel is named only in a recipe, which refuses a wrong name when it is made."""
    for field in ("dim0_kernel", "dim1_kernel"):
        with pytest.raises(ValueError, match=rf"{field}={kernel!r} is not a cast kernel"):
            mxmoe.MXRecipe(**{field: kernel})
    if kernel is not None:  # (None is the default recipe)
        mx = to_mx(X, recipe=recipe_for("torch"))
        with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
            mx.dequantize(recipe=kernel)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_unavailable_kernel_cuda_on_cpu():
    with pytest.raises(RuntimeError, match="kernel='cuda' needs a CUDA tensor"):
        to_mx(X, recipe=recipe_for("cuda"))
    with pytest.raises(RuntimeError, match="kernel='cuda'"):
        to_mx_dim0_dim1(torch.ones(64, 64), recipe=recipe_for("cuda"))
    with pytest.raises(RuntimeError, match="kernel='cuda'"):
        to_mx(X, recipe=recipe_for("torch")).dequantize(recipe=recipe_for("cuda"))


def test_unavailable_kernel_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from mxmoe.quant import backends

    backends.clear_resolved()  # resolved answers are kept
    assert "triton" not in mxmoe.available_kernels("cpu")
    with pytest.raises(RuntimeError, match="kernel='triton'.*TRITON_INTERPRET=1"):
        to_mx(X, recipe=recipe_for("triton"))
    backends.clear_resolved()


@pytest.mark.parametrize("shape,axis", [((4, 64), 2), ((4, 64), -3), ((2, 4, 64), 3), ((2, 4, 64), -4),
                                        ((64,), 1)])
def test_axis_out_of_range(shape, axis):
    with pytest.raises(ValueError, match=rf"axis={axis} is out of range"):
        to_mx(torch.ones(shape), axis=axis)


@pytest.mark.parametrize("shape,axis", [((2, 64, 64), 0), ((2, 64, 64), -3), ((2, 2, 64, 64), 1)])
def test_axis_not_one_of_the_last_two(shape, axis):
    with pytest.raises(ValueError, match=rf"axis={axis} of a {len(shape)}D tensor is not supported"):
        to_mx(torch.ones(shape), axis=axis)


@pytest.mark.parametrize("axis", [1.0, "a", None])
def test_axis_not_an_int(axis):
    with pytest.raises(ValueError, match=r"axis=.*: expected an int"):
        to_mx(X, axis=axis)


def test_fused_needs_2d():
    with pytest.raises(ValueError, match="x must be 2D"):
        to_mx_dim0_dim1(torch.ones(2, 64, 64))
    with pytest.raises(ValueError, match="x must be 2D"):
        to_mx_dim0_dim1(torch.ones(64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int32, torch.float8_e4m3fn])
def test_dequantize_wrong_dtype(dtype):
    mx = to_mx(X, recipe=recipe_for("torch"))
    with pytest.raises(TypeError, match=rf"dtype={dtype} is not an output dtype"):
        mx.dequantize(dtype)


def test_errors_raise_before_any_kernel(monkeypatch):
    """Argument errors come from the checks, not from a backend: no backend module is touched."""
    def boom(kernel, cast):
        raise AssertionError(f"backend {kernel} called")

    monkeypatch.setattr("mxmoe.quant.call_path.cast_fn", boom)
    monkeypatch.setattr("mxmoe.quant.custom_ops.cast_fn", boom)
    for kwargs in (dict(block_size=3), dict(scaling_mode="x"), dict(elem_dtype=torch.float16), dict(axis=5)):
        with pytest.raises((ValueError, TypeError)):
            to_mx(X, **kwargs)
    with pytest.raises(TypeError):
        to_mx(X.half(), recipe=recipe_for("torch"))


def test_empty_tensor_is_fine():
    """A (0, 64) input quantizes to empty storage of the right shapes (no error, no kernel)."""
    mx = to_mx(torch.ones(0, 64), recipe=recipe_for("torch"))
    assert tuple(mx.qdata_blocked.shape) == (0, 64) and tuple(mx.scale_blocked.shape) == (0, 2)
    assert tuple(mx.dequantize(recipe=recipe_for("torch")).shape) == (0, 64)


@pytest.mark.parametrize(
    "shape,axis", [((4, 0), -1), ((0, 64), 0), ((2, 0, 64), -2), ((0, 32, 64), -2), ((3, 0, 32), -1)]
)
def test_zero_size_dims_are_fine(shape, axis):
    """A zero-size dim anywhere (e.g. an expert with no tokens) gives empty storage, no reshape error."""
    mx = to_mx(torch.ones(shape), axis=axis, recipe=recipe_for("torch"))
    assert tuple(mx.qdata.shape) == shape
    scale_shape = list(shape)
    scale_shape[axis] //= 32
    assert tuple(mx.scale.shape) == tuple(scale_shape)
    assert tuple(mx.dequantize(recipe=recipe_for("torch")).shape) == shape


def test_fused_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        to_mx_dim0_dim1([[1.0] * 32] * 32)


def test_dequantize_dtype_not_a_dtype():
    with pytest.raises(TypeError, match="dtype='bf16' is not a torch.dtype"):
        to_mx(X, recipe=recipe_for("torch")).dequantize("bf16")


def test_mxtensor_repr_names_the_layout():
    mx = to_mx(X, recipe=recipe_for("torch"))
    assert isinstance(mx, MXTensor)
    assert repr(mx).startswith("MXTensor(shape=(4, 64), axis=1, elem=torch.float8_e4m3fn, block_size=32")


def test_arguments_are_checked_once_per_public_call(monkeypatch):
    """The public API checks its arguments once; everything below trusts them. The format arguments
    (block size, scaling mode, element dtype) are checked once per distinct combination (remembered
    by value and type); with a recipe (checked when it was made) not again at all."""
    import mxmoe.quant.checks as checks
    from mxmoe.recipe import recipe

    calls = []

    def counting(block_size):
        calls.append(block_size)
        return block_size

    x = torch.randn(64, 64)
    to_mx(x, 0, block_size=16)  # registers its format (once a process, checked then): as if a test ran before
    monkeypatch.setattr(checks, "check_block_size", counting)
    monkeypatch.setattr("mxmoe.formats.check_block_size", counting)
    checks._checked_spec.cache_clear()
    to_mx(x, -1)  # loose format arguments ("auto" kernels: torch on CPU)
    to_mx(x, 0).dequantize()
    to_mx_dim0_dim1(x)
    to_mx(x, 0, block_size=16)
    to_mx(x, 0, block_size=16)
    assert calls == [32, 16]
    checks._checked_spec.cache_clear()  # forget the specs checked by the stand-in
    calls.clear()
    r = recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch")
    to_mx(x, -1, recipe=r).dequantize(recipe=r)
    to_mx(x, 0, recipe=r)
    to_mx_dim0_dim1(x, recipe=r)
    assert calls == []


def test_to_mx_of_a_tensor_that_needs_grad_says_how_to_train():
    """A cast has no gradient: refuse up front, naming the differentiable entry points."""
    w = torch.randn(64, 64, requires_grad=True)
    r = recipe_for("torch")
    for call in (lambda: to_mx(w, recipe=r), lambda: to_mx_dim0_dim1(w, recipe=r)):
        with pytest.raises(RuntimeError, match="MXLinear, mxmoe.ops.mx_mm or mxmoe.ops.mx_grouped_mm"):
            call()
    with torch.no_grad():
        to_mx(w, recipe=recipe_for("torch"))
    to_mx(w.detach(), recipe=recipe_for("torch"))


def test_auto_falls_back_when_the_cuda_extension_cannot_build(as_on_a_gpu):
    """kernel='auto' on a CUDA device skips `cuda` whose build failed (its `ready` is False),
    instead of raising."""
    from mxmoe.quant import backends

    as_on_a_gpu(builds=False)
    assert backends.resolve_kernel("auto", torch.device("cuda")) == "triton"
    as_on_a_gpu(builds=True)
    assert backends.resolve_kernel("auto", torch.device("cuda")) == "cuda"


def test_auto_is_a_lookup_in_the_registry(as_on_a_gpu):
    """The cast kernels are one `mxmoe.registry.Registry`, each backend declaring in its own module
    where it runs and its rank for "auto": on a CUDA device "auto" takes cuda for every cast (its
    C++ operators' host cost decides), Triton where cuda is unavailable, torch where neither is;
    CPU tensors always get torch."""
    import importlib
    import importlib.util

    from mxmoe.quant import backends, cuda_cast, triton_cast

    reg = backends.CAST_BACKENDS
    assert reg.names() == backends.KERNELS == ("torch", "triton", "cuda")
    for name in reg.names():  # each backend's declarations live in its own module
        mod = importlib.import_module(reg.get(name).module)
        assert callable(mod.why_unavailable) and callable(mod.auto_rank), name
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    casts = backends.CASTS + ("qdq_dim0", "qdq_dim1")
    assert all(backends.resolve_kernel("auto", cuda, c) == "cuda" for c in casts)
    as_on_a_gpu(cuda_reason="no toolkit")  # e.g. no nvcc: every cast falls back to Triton
    assert all(backends.resolve_kernel("auto", cuda, c) == "triton" for c in casts)
    assert all(backends.resolve_kernel("auto", cpu, c) == "torch" for c in casts)
    with pytest.MonkeyPatch.context() as m:  # and to torch where Triton is not either
        m.setattr(triton_cast, "why_unavailable", lambda d, c: "no triton")
        backends.clear_resolved()
        assert backends.resolve_kernel("auto", cuda, "dim1") == "torch"
    with pytest.MonkeyPatch.context() as m:  # no triton package: its module is not imported
        find_spec = importlib.util.find_spec
        m.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "triton" else find_spec(n, *a))
        backends.clear_resolved()
        assert backends.why_unavailable("triton", cuda) == (
            "kernel='triton' needs the triton package, which is not installed"
        )
        assert backends.resolve_kernel("auto", cuda, "dim1") == "torch"
        assert mxmoe.available_kernels("cuda") == ["torch"]
    backends.clear_resolved()
    assert cuda_cast.STAND_INS == {"qdq_dim0_offs": "triton"}
    with pytest.raises(ValueError, match="cast='dim2'; expected one of"):
        backends.resolve_kernel("auto", cuda, "dim2")
    with pytest.raises(ValueError, match="kernel='cudnn' is not a cast kernel; expected 'auto' or one of"):
        backends.resolve_kernel("cudnn", cuda, "dim1")


def test_cast_kernel_reads_each_casts_recipe_field(as_on_a_gpu):
    """`backends.cast_kernel`, the one kernel choice: dim0 and dequantize read the recipe's
    dim0_kernel, dim1 and the fused cast its dim1_kernel, "auto" resolves per cast; a kernel that
    cannot run on the device names the recipe field; an unknown cast is refused."""
    from mxmoe.quant import backends
    from mxmoe.recipe import recipe

    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="recipe dim1_kernel='cuda': kernel='cuda' needs a CUDA tensor"):
        backends.cast_kernel(recipe(dim1_kernel="cuda"), cpu, "dim1")
    with pytest.raises(ValueError, match="cast='dim2'; expected one of"):
        backends.cast_kernel(recipe(), cpu, "dim2")
    assert backends.cast_kernel(recipe(dim0_kernel="cuda"), cpu, "dim1") == "torch"  # "auto" on CPU
    # a device given as a string failed inside a backend's check ("'str' object has no attribute 'type'")
    for fn in (backends.cast_kernel, lambda r, d, c: backends.resolve_kernel(r.dim0_kernel, d, c)):
        with pytest.raises(TypeError, match=r"device='cpu' \(str\): expected a torch.device"):
            fn(recipe(), "cpu", "dim0")
    cuda = torch.device("cuda")  # as on a GPU machine whose extension builds (the fixture)
    r = recipe(dim0_kernel="torch", dim1_kernel="auto")
    got = {c: backends.cast_kernel(r, cuda, c) for c in backends.CASTS}
    assert got == {"dim0": "torch", "dequant": "torch", "dim1": "cuda", "dim0_dim1": "cuda"}
    r = recipe(dim0_kernel="triton", dim1_kernel="torch")
    got = {c: backends.cast_kernel(r, cuda, c) for c in backends.CASTS}
    assert got == {"dim0": "triton", "dequant": "triton", "dim1": "torch", "dim0_dim1": "torch"}


def test_fast_entries_equal_the_public_casts():
    """mx_cast / mx_cast_dim0_dim1 (no checks, for the ops layer) give to_mx's bytes."""
    from mxmoe.quant import mx_cast, mx_cast_dim0_dim1
    from mxmoe.recipe import recipe

    r = recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch")
    x3 = torch.randn(2, 64, 96) * 3
    for x, ax in ((x3[0], 1), (x3[0], 0), (x3, 2), (x3, 1), (x3[0].t(), 0)):
        a, b = mx_cast(x, ax, r), to_mx(x, ax, recipe=r)
        assert a.axis == b.axis and a.scaling_mode == b.scaling_mode == "floor"
        assert torch.equal(a.qdata_blocked.view(torch.uint8), b.qdata_blocked.view(torch.uint8))
        assert torch.equal(a.scale_blocked.view(torch.uint8), b.scale_blocked.view(torch.uint8))
        assert torch.equal(a.dequantize(recipe=recipe_for("torch")), b.dequantize(recipe=recipe_for("torch")))
    for a, b in zip(mx_cast_dim0_dim1(x3[0], r), to_mx_dim0_dim1(x3[0], recipe=r), strict=True):
        assert torch.equal(a.qdata_blocked.view(torch.uint8), b.qdata_blocked.view(torch.uint8))
        assert torch.equal(a.scale_blocked.view(torch.uint8), b.scale_blocked.view(torch.uint8))


def test_remember_keeps_derived_answers_until_clear_resolved(monkeypatch):
    """`backends.remember` computes once per key, and `clear_resolved` forgets its answers with the
    kernel choices they derive from (the MX ops' `op_kernels`: made again after the clear)."""
    from mxmoe.ops.gemm_backend import op_kernels
    from mxmoe.quant import backends
    from mxmoe.recipe import MXRecipe

    monkeypatch.setattr(backends, "_resolved", {})
    made = []
    assert backends.remember(("test", 1), lambda: made.append(1) or "a") == "a"
    assert backends.remember(("test", 1), lambda: made.append(1) or "b") == "a"
    assert made == [1]
    r = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")
    ks = op_kernels(r, torch.device("cpu"))
    assert op_kernels(r, torch.device("cpu")) is ks
    assert (ks.k0, ks.k1, ks.compute) == ("torch", "torch", torch.float32)
    backends.clear_resolved()
    assert backends.remember(("test", 1), lambda: "b") == "b"
    again = op_kernels(r, torch.device("cpu"))
    assert again is not ks and again == ks


def _parts(x=X, **kw) -> dict:
    """The fields of to_mx(x, **kw) as a hand-built MXTensor takes them."""
    import dataclasses

    mx = to_mx(x, recipe=recipe_for("torch"), **kw)
    return {f.name: getattr(mx, f.name) for f in dataclasses.fields(mx)}


E8 = torch.float8_e8m0fnu
SWIZZLED = to_mx(X, recipe=recipe_for("torch"), scale_layout="swizzled").scale_swizzled  # (128, 4)


@pytest.mark.parametrize(
    "change, error, message",
    [
        # once dequantized as the swizzled layout (max error 3.25): the old keyword names its replacement
        ({"scale_layout": "Plain"}, TypeError,
         "MXTensor() takes no scale_layout (got scale_layout='Plain'): scale_blocked always holds the "
         "storage scales; pass swizzled ones as scale_swizzled="),
        # swizzled scales where the storage scales go: refused, naming the field that takes them
        ({"scale_blocked": SWIZZLED}, ValueError,
         "scale_blocked has shape (128, 4); expected (4, 2): one scale per block_size=32 elements of "
         "qdata_blocked (4, 64) in the storage layout (swizzled scales go in scale_swizzled)"),
        # the old scale_layout value where scale_swizzled now goes (the 8th positional argument)
        ({"scale_swizzled": "plain"}, TypeError,
         "scale_swizzled is str 'plain'; expected None or a torch.float8_e8m0fnu tensor"),
        ({"scale_swizzled": torch.zeros(4, 2, dtype=E8)}, ValueError,
         "scale_swizzled has shape (4, 2); expected (128, 4): scale_blocked (4, 2) in the swizzled layout"),
        ({"scale_swizzled": torch.zeros(128, 4, dtype=torch.uint8)}, TypeError,
         "scale_swizzled is torch.uint8; expected None or a torch.float8_e8m0fnu tensor"),
        # the right shape, other bytes: a block-scaled GEMM would read them
        ({"scale_swizzled": torch.zeros(128, 4, dtype=E8)}, ValueError,
         "scale_swizzled is not scale_blocked in the swizzled layout (padding zero)"),
        # once broadcast
        ({"scale_blocked": torch.zeros(4, 1, dtype=E8)}, ValueError,
         "scale_blocked has shape (4, 1); expected (4, 2): one scale per block_size=32 elements"),
        # once read as integers
        ({"qdata_blocked": torch.zeros(4, 64, dtype=torch.int8)}, TypeError,
         "qdata_blocked is torch.int8; expected a tensor of an MX element dtype"),
        ({"scale_blocked": torch.zeros(4, 2, dtype=torch.uint8)}, TypeError,
         "scale_blocked is torch.uint8; expected a torch.float8_e8m0fnu tensor"),
        # once a transposed result
        ({"axis": -1}, ValueError, "axis=-1: expected one of [0, 1], the non-negative logical axis"),
        ({"axis": 2}, ValueError, "axis=2: expected one of [0, 1]"),
        ({"axis": True}, ValueError, "axis=True: expected one of [0, 1]"),
        ({"block_size": 48}, ValueError, "block_size=48 is not supported"),
        ({"block_size": 64}, ValueError, "scale_blocked has shape (4, 2); expected (4, 1)"),
        ({"scaling_mode": "nearest"}, ValueError, "scaling_mode='nearest' is not a scale mode"),
        ({"orig_dtype": torch.float16}, TypeError, "orig_dtype=torch.float16: expected torch.bfloat16"),
        ({"qdata_blocked": torch.zeros(64, 4, dtype=torch.float8_e4m3fn).t()}, ValueError,
         "must be contiguous tensors"),
        ({"grad_anchor": torch.zeros(64, 4)}, ValueError,
         "grad_anchor is (64, 4) on cpu; expected None or a tensor of the logical shape (4, 64)"),
        ({"offs": torch.tensor([4], dtype=torch.int32)}, ValueError,
         "offs groups the swizzled scales; pass scale_swizzled with it"),
        ({"scale_swizzled": SWIZZLED, "offs": torch.tensor([4, 2], dtype=torch.int32)}, ValueError,
         "offs=[4, 2] must be non-decreasing group ends <= x.shape[0]=4"),
        # swizzled as one matrix, offs saying per group: the grouped shape is expected
        ({"scale_swizzled": SWIZZLED, "offs": torch.tensor([2, 4], dtype=torch.int32)}, ValueError,
         "scale_swizzled has shape (128, 4); expected (260, 4): scale_blocked (4, 2) in the swizzled "
         "layout in 2 token groups (offs)"),
    ],
)
def test_a_hand_built_mxtensor_is_checked_as_to_mx_checks(change, error, message):
    parts = _parts()
    MXTensor(**parts)  # as to_mx made it: accepted
    MXTensor(**{**parts, "scale_swizzled": SWIZZLED})  # with its swizzled scales: accepted
    with pytest.raises(error, match=re.escape(message)):
        MXTensor(**{**parts, **change})


def test_a_hand_built_mxtensor_takes_its_fields_by_position():
    """The 8th positional argument was scale_layout; a string there names scale_swizzled."""
    mx = to_mx(X, recipe=recipe_for("torch"))
    args = (mx.qdata_blocked, mx.scale_blocked, 1, 32, "rceil", torch.bfloat16, None)
    assert MXTensor(*args).scale_layout == "plain"
    assert MXTensor(*args, SWIZZLED).scale_layout == "swizzled"
    with pytest.raises(TypeError, match=r"scale_swizzled is str 'swizzled'.*\.to_scale_layout\('swizzled'\)"):
        MXTensor(*args, "swizzled")


def test_a_valid_hand_built_mxtensor_is_the_cast_one():
    import dataclasses

    from mxmoe.formats import ScalingMode

    x = torch.randn(64, 64, dtype=torch.bfloat16)
    offs = torch.tensor([32, 64], dtype=torch.int32)
    sw = {"scale_layout": "swizzled"}
    for kw in ({}, {"axis": 0}, sw, {"axis": 0, **sw, "offs": offs}, {**sw, "offs": offs}):
        cast = to_mx(x, recipe=recipe_for("torch"), **kw)
        hand = MXTensor(**_parts(x, **kw))
        assert torch.equal(hand.dequantize(), cast.dequantize()), kw
        assert hand.scale_layout == cast.scale_layout == kw.get("scale_layout", "plain"), kw
        if cast.scale_swizzled is not None:
            assert torch.equal(hand.scale_swizzled.view(torch.uint8), cast.scale_swizzled.view(torch.uint8))
    mx = MXTensor(**{**_parts(), "scaling_mode": ScalingMode.RCEIL})
    assert mx.scaling_mode == "rceil"  # stored by name, as the casts store it
    with pytest.raises(ValueError, match="axis=0: expected one of"):  # replace() is checked too
        dataclasses.replace(mx, qdata_blocked=torch.zeros(2, 4, 64, dtype=torch.float8_e4m3fn), axis=0)
    with pytest.raises(TypeError, match="takes no scale_layout"):  # and names the old keyword
        dataclasses.replace(mx, scale_layout="swizzled")
    # a 3D tensor's swizzled scales: one matrix per leading index
    x3 = torch.randn(2, 64, 64, dtype=torch.bfloat16)
    hand = MXTensor(**_parts(x3, axis=1, scale_layout="swizzled"))
    assert hand.scale_swizzled.shape == (2, 128, 4)


def test_mx_grouped_mm_takes_a_hand_built_mxtensor_and_no_narrow_scales():
    from mxmoe.ops import mx_grouped_mm

    r = recipe_for("torch")
    a = torch.randn(64, 64)
    b_t = torch.randn(2, 64, 32)
    offs = torch.tensor([24, 64], dtype=torch.int32)
    cast = to_mx(a, recipe=r)
    hand = MXTensor(**_parts(a))
    assert torch.equal(mx_grouped_mm(hand, b_t, offs, r), mx_grouped_mm(cast, b_t, offs, r))
    with pytest.raises(ValueError, match=r"scale_blocked has shape \(64, 1\); expected \(64, 2\)"):
        MXTensor(cast.qdata_blocked, cast.scale_blocked[:, :1].contiguous(), 1)  # once broadcast


def test_the_casts_and_ops_build_their_mxtensors_unchecked(monkeypatch):
    """The public constructor checks; the casts and the ops (per call, in training) do not."""
    import mxmoe.quant.mx_tensor as mt
    from mxmoe.ops import mx_grouped_mm, mx_mm

    calls = []
    check = mt._check_fields
    monkeypatch.setattr(mt, "_check_fields", lambda t: calls.append(1) or check(t))
    r = recipe_for("torch")
    a = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    b_t = torch.randn(2, 64, 32, requires_grad=True)
    offs = torch.tensor([24, 64], dtype=torch.int32)
    (mx_mm(a, w.t(), r).sum() + mx_grouped_mm(a, b_t, offs, r).sum()).backward()
    x = to_mx(a.detach(), recipe=r)
    x.to_scale_layout("swizzled").to_scale_layout("plain").index_rows(torch.arange(3)).dequantize()
    to_mx_dim0_dim1(a.detach(), recipe=r)
    assert calls == []
    MXTensor(**_parts())
    assert calls == [1]


def test_mxtensor_equality_names_what_to_compare():
    """`==` of two MXTensors (the dataclass's: "Boolean value of Tensor ... is ambiguous") is a
    TypeError naming what to compare; a tensor equals itself, and nothing else."""
    a, b = to_mx(torch.randn(4, 64)), to_mx(torch.randn(4, 64))
    assert a == a and a != 3 and not (a == 3) and a in [a]
    with pytest.raises(TypeError, match=r"MXTensor has no ==: compare the storage with torch.equal\(a.qdata"):
        _ = a == b
    with pytest.raises(TypeError, match="unhashable type"):
        hash(a)


def test_to_scale_layout_checks_offs_as_to_mx():
    """MXTensor.to_scale_layout's offs (the fix to_mx's errors name) is checked as to_mx checks it:
    decreasing ends or ends past the rows were swizzled silently, a list failed deep in the swizzle."""
    src = torch.randn(8, 64)
    x = to_mx(src)
    o = lambda ends, dtype=torch.int32: torch.tensor(ends, dtype=dtype)  # noqa: E731
    with pytest.raises(ValueError, match=r"offs=\[6, 2\] must be non-decreasing .* <= MXTensor.shape\[0\]=8"):
        x.to_scale_layout("swizzled", o([6, 2]))
    with pytest.raises(ValueError, match=r"offs=\[6, 20\] must be non-decreasing"):
        x.to_scale_layout("swizzled", o([6, 20]))
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor"):
        x.to_scale_layout("swizzled", [4, 8])
    with pytest.raises(ValueError, match="offs must be a non-empty 1D int32 tensor"):
        x.to_scale_layout("swizzled", o([4, 8], torch.int64))
    with pytest.raises(ValueError, match="offs groups the swizzled scales"):
        x.to_scale_layout("plain", o([4, 8]))
    # a 1D tensor has no swizzled layout ("not enough values to unpack" inside the swizzle)
    with pytest.raises(ValueError, match=r"'swizzled' needs x of at least 2 dims .* got shape \(64,\)"):
        to_mx(torch.randn(64), scale_layout="swizzled")
    with pytest.raises(ValueError, match=r"'swizzled' needs MXTensor of at least 2 dims"):
        to_mx(torch.randn(64)).to_scale_layout("swizzled")
    g = x.to_scale_layout("swizzled", o([4, 8]))
    want = to_mx(src, scale_layout="swizzled", offs=o([4, 8]))
    u8 = torch.uint8
    assert g.offs is not None and torch.equal(g.scale_swizzled.view(u8), want.scale_swizzled.view(u8))


def test_mxtensor_pickles_and_deepcopies():
    """pickle.loads of an MXTensor failed in torch ("'UntypedStorage' has no attribute 'dtype'": torch
    cannot unpickle float8 tensors); its fields round-trip bit for bit, swizzled scales too."""
    import copy
    import pickle

    x = to_mx(torch.randn(64, 64), scale_layout="swizzled")
    for y in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x)):
        assert (y.axis, y.block_size, y.scaling_mode, y.orig_dtype) == (1, 32, "rceil", torch.float32)
        for name in ("qdata_blocked", "scale_blocked", "scale_swizzled"):
            a, b = getattr(x, name), getattr(y, name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_deepcopy_of_an_mxtensor_with_a_graph_anchor_is_named():
    """deepcopy of the MXFP8 dispatch's output (its grad_anchor is in an autograd graph) failed inside
    torch with a hint about weight_norm; the error names the anchor and the way to copy it, which
    works. A leaf anchor (no graph) is copied, and a memo keeps shared fields shared."""
    import copy
    import dataclasses

    from mxmoe.comm import a2a_dispatch_mxfp8

    x = torch.randn(8, 64, requires_grad=True)
    d = a2a_dispatch_mxfp8(x, [8], [8])
    why = r"^deepcopy of an MXTensor whose grad_anchor is part of an autograd graph"
    with pytest.raises(RuntimeError, match=why):
        copy.deepcopy(d)
    c = copy.deepcopy(dataclasses.replace(d, grad_anchor=None))
    assert c.grad_anchor is None and torch.equal(c.dequantize(), d.dequantize())
    m = to_mx(torch.randn(8, 64))
    a, b = copy.deepcopy([m, m])
    assert a is b and a is not m
    assert torch.equal(a.qdata_blocked.view(torch.uint8), m.qdata_blocked.view(torch.uint8))


def test_mxtensor_loads_with_weights_only(tmp_path):
    """torch.load(path, weights_only=True) refused an MXTensor ("Unsupported global: GLOBAL
    mxmoe.quant.mx_tensor.MXTensor") unless the caller allowlisted it; it round-trips bit for bit, and
    a file whose fields MXTensor(...) would refuse is refused the same way."""
    from mxmoe.quant.mx_tensor import mx_tensor_trusted

    offs = torch.tensor([16, 64], dtype=torch.int32)
    saved = {
        "plain": to_mx(torch.randn(64, 96)),
        "dim1_e5m2": to_mx(torch.randn(64, 96, dtype=torch.bfloat16), axis=0,
                           recipe=recipe_for("torch", scaling_mode="floor", elem_dtype=torch.float8_e5m2)),
        "swizzled": to_mx(torch.randn(64, 64), scale_layout="swizzled", offs=offs),
        "3d_block16": to_mx(torch.randn(2, 8, 32), block_size=16),
    }
    torch.save(saved, tmp_path / "mx.pt")
    loaded = torch.load(tmp_path / "mx.pt", weights_only=True)
    assert sorted(loaded) == sorted(saved)
    for k, x in saved.items():
        y = loaded[k]
        assert isinstance(y, MXTensor), k
        assert (y.axis, y.block_size, y.scaling_mode, y.orig_dtype) == (
            x.axis, x.block_size, x.scaling_mode, x.orig_dtype
        ), k
        for name in ("qdata_blocked", "scale_blocked", "scale_swizzled", "offs"):
            a, b = getattr(x, name), getattr(y, name)
            assert (a is None) == (b is None), (k, name)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (k, name)
    x = saved["plain"]
    short = x.scale_blocked[:, :2].contiguous()
    bad = mx_tensor_trusted(x.qdata_blocked, short, 1, 32, "rceil", torch.float32)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"scale_blocked has shape \(64, 2\); expected \(64, 3\)"):
        torch.load(tmp_path / "bad.pt", weights_only=True)


def test_mxtensor_to_a_device():
    """MXTensor had no .to / .cpu (AttributeError): .to(device) moves every field, self where
    nothing moves, and a dtype is refused naming dequantize."""
    from mxmoe.quant.mx_tensor import _MoveAnchor, mx_tensor_trusted

    offs = torch.tensor([32, 64], dtype=torch.int32)
    x = to_mx(torch.randn(64, 64), scale_layout="swizzled", offs=offs)
    assert x.to("cpu") is x and x.to(torch.device("cpu"), non_blocking=True) is x and x.cpu() is x
    assert x.to() is x
    m = x.to("meta")
    assert m is not x and isinstance(m, MXTensor)
    for name in ("qdata_blocked", "scale_blocked", "scale_swizzled", "offs"):
        a, b = getattr(x, name), getattr(m, name)
        assert b.device.type == "meta", name
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
    fields = lambda t: (t.axis, t.block_size, t.scaling_mode, t.orig_dtype)
    assert fields(m) == fields(x) and x.device.type == "cpu"  # the original is left as it was
    # a grad anchor is made again on the new device (zero-stride), its gradient back on the old one
    src = torch.zeros((), requires_grad=True)
    y = mx_tensor_trusted(x.qdata_blocked, x.scale_blocked, 1, 32, "rceil", torch.float32, src.expand(64, 64))
    ym = y.to("meta")
    assert ym.grad_anchor.device.type == "meta" and ym.grad_anchor.stride() == (0, 0)
    assert ym.grad_anchor.requires_grad and y.to("cpu") is y
    moved = _MoveAnchor.apply(src.expand(64, 64), torch.device("cpu"))
    assert moved.stride() == (0, 0)
    moved.backward(torch.full((64, 64), 0.5))
    assert src.grad.item() == 64 * 64 * 0.5
    said = r"^MXTensor.to takes a device only, got dtype torch.bfloat16: .* use .dequantize\(dtype\)"
    with pytest.raises(TypeError, match=said):
        x.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"^MXTensor.to takes a device only, got dtype torch.float32"):
        x.to("cpu", dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^MXTensor.to: device='float32' is not a device"):
        x.to("float32")


@pytest.mark.parametrize(
    "name, value",
    [
        ("qdata_blocked", torch.zeros(4, 32, dtype=torch.float8_e4m3fn)),  # its scales no longer agree
        ("scale_blocked", torch.zeros(4, 1, dtype=torch.float8_e8m0fnu)),
        ("axis", 0),
        ("block_size", 16),
        ("scaling_mode", "floor"),
        ("orig_dtype", torch.float32),
        ("grad_anchor", None),
        ("scale_swizzled", None),
        ("offs", None),
    ],
)
def test_mxtensor_fields_are_read_only(name, value):
    """A field assigned after construction was never checked again: `t.block_size = 16` or another
    qdata_blocked made the next dequantize or GEMM silently wrong. Each assignment and deletion is now
    an AttributeError naming the field and the way to a new, checked MXTensor; the tensor is
    unchanged and still dequantizes to the same values."""
    import dataclasses

    t = to_mx(torch.randn(4, 64))
    before = t.dequantize(torch.float32)
    fields = dict(t.__dict__)
    msg = rf"^MXTensor\.{name} cannot be assigned: an MXTensor's fields are read-only, checked together"
    with pytest.raises(AttributeError, match=msg) as e:
        setattr(t, name, value)
    assert isinstance(e.value, dataclasses.FrozenInstanceError)
    assert f"make a new MXTensor: dataclasses.replace(t, {name}=...) (checked" in str(e.value)
    with pytest.raises(AttributeError, match=rf"^MXTensor\.{name} cannot be deleted: "):
        delattr(t, name)
    assert t.__dict__ == fields
    assert torch.equal(t.dequantize(torch.float32), before)


def test_mxtensor_views_and_other_attributes_are_refused():
    """`.qdata` / `.scale` (views of the storage) and names that are not fields: refused naming them,
    the views with the storage field to replace; dataclasses.replace makes the new tensor, checked."""
    import dataclasses

    t = to_mx(torch.randn(4, 64))
    for view in ("qdata", "scale"):
        with pytest.raises(
            AttributeError,
            match=rf"^MXTensor\.{view} is a view of {view}_blocked \(the storage\) and cannot be "
            rf"assigned: .* dataclasses\.replace\(t, {view}_blocked=\.\.\.\) with the storage tensor",
        ):
            setattr(t, view, getattr(t, view))
    no_field = r"^MXTensor has no field 'qdata_blockd' \(qdata_blocked, scale_blocked"
    with pytest.raises(AttributeError, match=no_field):
        t.qdata_blockd = t.qdata_blocked
    assert "qdata_blockd" not in t.__dict__
    # the way the errors name: a new MXTensor, checked as MXTensor(...) checks
    with pytest.raises(ValueError, match=r"scale_blocked has shape \(4, 2\); expected \(4, 4\)"):
        dataclasses.replace(t, block_size=16)
    u = dataclasses.replace(t, orig_dtype=torch.bfloat16)
    assert u is not t and u.orig_dtype == torch.bfloat16 and t.orig_dtype == torch.float32
    assert u.qdata_blocked is t.qdata_blocked


def test_mxtensor_read_only_under_compile_and_its_copies():
    """What makes MXTensors still does: a graph that builds one and returns it (torch.compile sets
    the fields of the object it rebuilds once each), pickle, deepcopy and .to; each result is as
    read-only as one made eagerly."""
    import copy
    import pickle

    x = torch.randn(64, 64)
    r = recipe_for("torch")
    made = torch.compile(lambda x: to_mx(x, recipe=r), fullgraph=True, backend="eager")(x)
    eager = to_mx(x, recipe=r)
    assert torch.equal(made.qdata_blocked.view(torch.uint8), eager.qdata_blocked.view(torch.uint8))
    copies = [pickle.loads(pickle.dumps(eager)), copy.deepcopy(eager), copy.copy(eager), eager.to("meta")]
    for c in [made, *copies]:
        assert isinstance(c, MXTensor) and c.axis == 1
        with pytest.raises(AttributeError, match=r"^MXTensor\.axis cannot be assigned"):
            c.axis = 0
        assert c.axis == 1
