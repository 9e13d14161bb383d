"""The `cuda` cast backend (mxmoe/quant/cuda_cast.py, csrc/*.cu) against `torch_cast`.

GPU tests (`pytest -m gpu`) compare every output bit for bit with `mxmoe.quant.torch_cast` run on the
CPU (the executable spec, docs/mx-format.md) over many input classes, all scale modes, both element
formats, bf16/fp32 inputs and both dequantize dtypes. CPU tests check that the kernels compile for
sm_90 with nvcc and that a recipe naming "cuda" on a CPU tensor fails clearly.

Standalone GPU self-check (correctness sweep, then bandwidth vs device copy):
    PYTHONPATH=. python tests/quant/test_cuda_cast.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import Job, JobResult, assert_same_bits, recipe_for, subprocess_job

import mxmoe
from mxmoe.formats import ELEM_FORMATS, ScalingMode, make_spec
from mxmoe.quant import cuda_cast, torch_cast

ROOT = Path(__file__).resolve().parents[2]
CU_FILE = ROOT / "mxmoe" / "quant" / "csrc" / "mx_cast.cu"

MODES = list(ScalingMode)
ELEMS = [torch.float8_e4m3fn, torch.float8_e5m2]
IN_DTYPES = [torch.bfloat16, torch.float32]
OUT_DTYPES = [torch.bfloat16, torch.float32]
CLASSES = [
    "normal",
    "wide",
    "zeros",
    "subnormal",
    "ties",
    "saturation",
    "nonfinite",
    "huge",
    "rceil_thresholds",
]


# ------------------------------------------------------------------------------------------------
# Input classes (built on the CPU as fp32, then cast to the input dtype).


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e exactly, as float64."""
    return torch.pow(2.0, e.to(torch.float64))


def _signs(shape, g) -> torch.Tensor:
    return torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)


def _fp8_grid_midpoints(n: int, elem: torch.dtype, g) -> torch.Tensor:
    """n values exactly halfway between two adjacent finite positive fp8 values (ties for RNE)."""
    top = 0x7E if elem == torch.float8_e4m3fn else 0x7B  # largest finite positive code
    codes = torch.randint(0, top, (n,), generator=g, dtype=torch.int32)
    lo = codes.to(torch.uint8).view(elem).to(torch.float64)
    hi = (codes + 1).to(torch.uint8).view(elem).to(torch.float64)
    return (lo + hi) / 2


def make_input(
    cls: str, shape: tuple[int, ...], dtype: torch.dtype, elem: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` from input class `cls` (blocks may run along either of
    the last two dims: magnitudes vary slowly along both)."""
    g = torch.Generator().manual_seed(seed)
    fmt = ELEM_FORMATS[elem]
    n = 1
    for d in shape:
        n *= d
    if cls == "normal":
        rows = torch.randint(-20, 21, (shape[-2] if len(shape) > 1 else 1, 1), generator=g)
        x = torch.randn(shape, generator=g, dtype=torch.float64) * _pow2(rows)
    elif cls == "wide":
        # magnitudes 2^-140 .. 2^120: a base exponent that changes every 16 rows / 16 cols, plus a
        # per-element spread of 14 binades (small elements of a block underflow in fp8)
        R, C = shape[-2], shape[-1]
        br = torch.randint(-140, 121, ((R + 15) // 16,), generator=g).repeat_interleave(16)[:R]
        bc = torch.randint(-10, 11, ((C + 15) // 16,), generator=g).repeat_interleave(16)[:C]
        base = (br[:, None] + bc[None, :]).clamp(-140, 120).expand(shape)
        off = torch.randint(-12, 3, shape, generator=g)
        x = _signs(shape, g) * (1 + torch.rand(shape, generator=g, dtype=torch.float64)) * _pow2(base + off)
    elif cls == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
        pick = torch.rand(shape, generator=g)
        x = torch.where(pick < 0.3, -0.0, x)  # -0 scattered in zero blocks
        x = torch.where(pick > 0.995, torch.randn(shape, generator=g, dtype=torch.float64), x)
        R = shape[-2]
        neg_rows = torch.arange(R) % 3 == 1  # whole rows of -0
        x[..., neg_rows, :] = torch.where(x[..., neg_rows, :] == 0, -0.0, x[..., neg_rows, :])
    elif cls == "subnormal":
        # fp32 subnormals (bf16 subnormals for bf16 inputs), a few small normals
        if dtype == torch.bfloat16:
            bits = torch.randint(1, 0x80, shape, generator=g, dtype=torch.int32) << 16
        else:
            bits = torch.randint(1, 0x800000, shape, generator=g, dtype=torch.int32)
        x = bits.view(torch.float32).to(torch.float64) * _signs(shape, g)
        small = torch.rand(shape, generator=g) < 0.05
        x = torch.where(small, _signs(shape, g) * _pow2(torch.randint(-126, -118, shape, generator=g)), x)
    elif cls == "ties":
        # halfway points of the fp8 grid times 2^k, one element per 32 forcing amax = max * 2^k
        k = torch.randint(-100, 100, (shape[-2], 1), generator=g).expand(shape)
        mids = _fp8_grid_midpoints(n, elem, g).reshape(shape)
        x = _signs(shape, g) * mids * _pow2(k)
        anchor = torch.zeros(shape, dtype=torch.bool)
        anchor[..., ::32, :] = True
        anchor[..., :, ::32] = True
        x = torch.where(anchor, fmt.max_normal * _pow2(k), x)
    elif cls == "saturation":
        # amax just under 2^(emax+1) * 2^k: FLOOR gives |x * 2^-e| > max, which must saturate
        k = torch.randint(-60, 60, (shape[-2], 1), generator=g).expand(shape)
        top = 2.0 ** (fmt.emax + 1)
        u = 0.85 + 0.15 * torch.rand(shape, generator=g, dtype=torch.float64)
        x = _signs(shape, g) * u * top * _pow2(k)
        pick = torch.rand(shape, generator=g)
        x = torch.where(pick < 0.1, fmt.max_normal * _pow2(k), x)
        x = torch.where(pick > 0.9, -(fmt.max_normal + 2.0 ** (fmt.emax - fmt.mbits - 1)) * _pow2(k), x)
    elif cls == "nonfinite":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        pick = torch.rand(shape, generator=g)
        x = torch.where(pick < 0.004, float("nan"), x)
        x = torch.where((pick >= 0.004) & (pick < 0.008), float("inf"), x)
        x = torch.where((pick >= 0.008) & (pick < 0.012), float("-inf"), x)
    elif cls == "huge":
        e = torch.randint(100, 128, shape, generator=g)
        x = _signs(shape, g) * (1 + torch.rand(shape, generator=g, dtype=torch.float64)) * _pow2(e)
        x = x.clamp(-3.3e38, 3.3e38)
        pick = torch.rand(shape, generator=g)
        fmax = torch.finfo(dtype).max
        x = torch.where(pick < 0.02, fmax, x)
        x = torch.where(pick > 0.98, -fmax, x)
    elif cls == "rceil_thresholds":
        # amax bit patterns within a few ulps of the RCEIL subnormal-descale thresholds T127 / T126
        spec = make_spec(32, "rceil", elem)
        centers = torch.tensor([spec.rceil_t127, spec.rceil_t126], dtype=torch.int64)
        # one amax pattern per 32x32 tile, so that blocks along either dim share it
        R, C = shape[-2], shape[-1]
        tiles = ((R + 31) // 32, (C + 31) // 32)
        which = torch.randint(0, 2, tiles, generator=g)
        delta = torch.randint(-3, 4, tiles, generator=g)
        if dtype == torch.bfloat16:
            tile_bits = ((centers[which] >> 16) + delta) << 16
        else:
            tile_bits = centers[which] + delta
        bits = tile_bits.repeat_interleave(32, 0)[:R].repeat_interleave(32, 1)[:, :C].expand(shape)
        amax_like = bits.to(torch.int32).view(torch.float32).to(torch.float64)
        frac = torch.rand(shape, generator=g, dtype=torch.float64)
        x = _signs(shape, g) * torch.where(torch.rand(shape, generator=g) < 0.25, amax_like, amax_like * frac)
    else:
        raise ValueError(f"unknown input class {cls!r}")
    return x.to(torch.float32).to(dtype)


# ------------------------------------------------------------------------------------------------
# Comparison helpers.


def check_dim0(x: torch.Tensor, spec, what: str = "dim0") -> None:
    q, s = cuda_cast.quantize_dim0(x.cuda(), spec)
    wq, ws = torch_cast.quantize_dim0(x, spec)
    assert_same_bits(q, wq, f"{what} qdata")
    assert_same_bits(s, ws, f"{what} scale")


def check_dim1(x: torch.Tensor, spec, what: str = "dim1") -> None:
    q, s = cuda_cast.quantize_dim1(x.cuda(), spec)
    wq, ws = torch_cast.quantize_dim1(x, spec)
    assert_same_bits(q, wq, f"{what} qdata")
    assert_same_bits(s, ws, f"{what} scale")


def check_dim0_dim1(x: torch.Tensor, spec, what: str = "dim0_dim1") -> None:
    got = cuda_cast.quantize_dim0_dim1(x.cuda(), spec)
    want = torch_cast.quantize_dim0_dim1(x, spec)
    for name, g_, w_ in zip(("q0", "s0", "q1", "s1"), got, want, strict=True):
        assert_same_bits(g_, w_, f"{what} {name}")


def check_dequant(
    q: torch.Tensor, s: torch.Tensor, bs: int, out_dtype: torch.dtype, what: str = "dequant"
) -> None:
    got = cuda_cast.dequantize(q.cuda(), s.cuda(), bs, out_dtype)
    want = torch_cast.dequantize(q, s, bs, out_dtype)
    assert_same_bits(got, want, f"{what} {out_dtype}")


# ------------------------------------------------------------------------------------------------
# CPU tests.


def test_mx_cast_cu_compiles_for_sm90(mx_cast_sm90):
    """CI's check of the CUDA build (as scripts/check_cuda_build.sh): the kernels alone, no torch
    headers, sm_90; the session's one nvcc build, which fails this test if a csrc/*.cu breaks."""
    assert [p.name for p in mx_cast_sm90.objs] == ["mx_cast.o", "mx_qdq.o", "mx_swiglu_qdq.o"]
    assert all(p.stat().st_size > 0 for p in mx_cast_sm90.objs)
    for kernel in ("dim0_grp_kernel", "dim1_tile_kernel", "dequant_flat_kernel", "qdq_dim0_kernel",
                   "qdq_dim1_kernel", "swiglu_bwd_qdq_kernel", "zero_rows_after_kernel"):
        assert mx_cast_sm90.entries(kernel), kernel
    assert mx_cast_sm90.ptxas


def test_extension_builds_every_kernel_unit():
    """The extension's sources are binding.cpp and every csrc/*.cu (a unit left out would leave its
    launchers undefined at load), each .cu one of the units the build compiles at once; every
    launcher that mx_cast.h declares is defined in exactly one of them."""
    import re

    from mxmoe.quant import cuda_cast

    csrc = CU_FILE.parent
    assert [p.name for p in cuda_cast._SOURCES] == ["binding.cpp", *sorted(p.name for p in csrc.glob("*.cu"))]
    declared = re.findall(r"^(?:cudaError_t|bool) (mx_\w+)\(", (csrc / "mx_cast.h").read_text(), re.M)
    assert len(declared) == 12
    for name in declared:
        definition = re.compile(rf"^(?:cudaError_t|bool) {name}\(", re.M)
        defined_in = [p.name for p in csrc.glob("*.cu") if definition.search(p.read_text())]
        assert len(defined_in) == 1, (name, defined_in)


def _binding_cpp_job(config: pytest.Config, folder: Path) -> Job | str:
    """g++ -fsyntax-only of csrc/binding.cpp against torch's and CUDA's headers: a subprocess job,
    started with the session."""
    import os
    import shutil

    from conftest import nvcc_path
    from torch.utils.cpp_extension import include_paths

    nvcc = nvcc_path()
    if nvcc is None:
        return "nvcc not found (neither on PATH nor under CUDA_HOME): no CUDA headers to check against"
    # no g++: the job reports it (the test fails, naming it)
    cxx = shutil.which("g++") or "g++"
    # the CPU wheel of torch ships c10/cuda's headers but not the CMake-generated cuda_cmake_macros.h
    # they include; a stand-in (it only sets build macros) lets binding.cpp be checked against them
    stub = folder / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    homes = [os.environ.get("CUDA_HOME", ""), str(Path(nvcc).parents[1]), "/usr/local/cuda"]
    cuda_inc = [f"-I{h}/include" for h in homes if h and Path(h, "include", "cuda_runtime.h").is_file()][:1]
    cmd = [cxx, "-std=c++20", "-fsyntax-only", *(f"-I{p}" for p in include_paths()),
           "-idirafter", str(folder / "stub"), *cuda_inc, str(CU_FILE.with_name("binding.cpp"))]
    return Job(cmd, timeout_s=600)


binding_cpp_syntax = subprocess_job("binding_cpp_syntax", _binding_cpp_job)


def test_binding_cpp_compiles_against_torch_headers(binding_cpp_syntax: JobResult):
    """CI's check of the operator binding (as scripts/check_cuda_build.sh): csrc/binding.cpp compiles
    (g++ -fsyntax-only) against the installed torch's headers and CUDA's, where nvcc is found."""
    res = binding_cpp_syntax
    assert res.returncode == 0, f"{' '.join(res.cmd)} failed:\n{res.stderr[-6000:]}"


def test_mx_cast_sources_include_no_torch_headers():
    """The kernels' sources (the .cu units, their parts, mx_cast.h) compile alone: no torch headers
    (binding.cpp, the operator binding, is the one file that includes them)."""
    paths = sorted(p for p in CU_FILE.parent.iterdir() if p.suffix in (".cu", ".cuh", ".h"))
    assert {p.name for p in paths} >= {"mx_cast.cu", "mx_qdq.cu", "mx_swiglu_qdq.cu", "mx_cast.h",
                                       "mx_launch.cuh", "mx_numerics.cuh", "mx_cast_kernels.cuh",
                                       "mx_dequant_kernels.cuh", "mx_qdq_kernels.cuh"}
    for path in paths:
        includes = [ln for ln in path.read_text().splitlines() if ln.startswith("#include")]
        assert includes, path
        assert not any("torch" in ln or "ATen" in ln or "c10" in ln for ln in includes), (path, includes)


def test_cuda_kernel_on_cpu_tensor_raises_through_to_mx():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match=r"kernel='cuda' needs a CUDA tensor \(got a cpu tensor\)"):
        mxmoe.to_mx(x, recipe=recipe_for("cuda"))
    with pytest.raises(RuntimeError, match="kernel='cuda' needs a CUDA tensor"):
        mxmoe.to_mx_dim0_dim1(x.reshape(32, 8).repeat(1, 4), recipe=recipe_for("cuda"))


def test_cuda_backend_direct_call_on_cpu_tensor_raises():
    """Without a GPU the backend cannot load; on a GPU machine the C++ operators have no CPU kernel."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):
        cuda_cast.quantize_dim0(torch.randn(2, 64), spec)
    with pytest.raises(RuntimeError):
        cuda_cast.quantize_dim1(torch.randn(1, 64, 8), spec)


def test_binding_compiles_and_registers_every_operator():
    """binding.cpp's TORCH_LIBRARY block defines every operator cuda_cast calls, with a CUDA kernel."""
    text = CU_FILE.with_name("binding.cpp").read_text()
    called = set(re.findall(r"torch\.ops\.mxmoe_cuda\.(\w+)", Path(cuda_cast.__file__).read_text()))
    assert called >= {"quantize_dim0", "quantize_dim0_out", "quantize_dim1", "quantize_dim0_dim1",
                      "dequantize", "dequantize_out", "qdq_dim0", "qdq_dim0_out", "qdq_dim1", "qdq_dim0_dim1",
                      "zero_rows_after", "format_constants"}
    for op in called:
        assert f'm.def("{op}(' in text, op
        assert op == "format_constants" or f'm.impl("{op}", &{op});' in text, op
    # every schema parses, and the mutating ones say what they write
    schemas = {m.group(1): m.group(0)[len('m.def("'):-1]
               for m in re.finditer(r'm\.def\("(\w+)\([^"]*"', text)}
    assert set(schemas) == called
    for op, text_schema in schemas.items():
        parsed = torch._C.parse_schema("mxmoe_cuda::" + text_schema)
        mutated = [a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == {"quantize_dim0_out": ["q", "s"], "dequantize_out": ["out"],
                           "qdq_dim0_out": ["out"], "zero_rows_after": ["out"]}.get(op, []), op


# ------------------------------------------------------------------------------------------------
# GPU tests: bitwise against torch_cast on the CPU.


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("cls", CLASSES)
def test_quantize_dim0_bitwise(cls, mode, elem, dtype):
    spec = make_spec(32, mode, elem)
    x = make_input(cls, (67, 320), dtype, elem, seed=1)
    check_dim0(x, spec, f"dim0 {cls}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 160, 72), (1, 256, 70), (3, 32, 129)], ids=str)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("cls", CLASSES)
def test_quantize_dim1_bitwise(cls, mode, elem, dtype, shape):
    spec = make_spec(32, mode, elem)
    x = make_input(cls, shape, dtype, elem, seed=2)
    check_dim1(x, spec, f"dim1 {cls} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(160, 96), (64, 352)], ids=str)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("cls", CLASSES)
def test_quantize_dim0_dim1_bitwise(cls, mode, elem, dtype, shape):
    spec = make_spec(32, mode, elem)
    x = make_input(cls, shape, dtype, elem, seed=3)
    check_dim0_dim1(x, spec, f"dim0_dim1 {cls} {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS, ids=str)
@pytest.mark.parametrize("mode", [ScalingMode.FLOOR, ScalingMode.RCEIL], ids=str)
@pytest.mark.parametrize("cls", CLASSES)
def test_dequantize_bitwise(cls, mode, elem, out_dtype):
    spec = make_spec(32, mode, elem)
    x = make_input(cls, (40, 224), torch.float32, elem, seed=4)
    q, s = torch_cast.quantize_dim0(x, spec)
    check_dequant(q, s, 32, out_dtype, f"dequant {cls}")


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("elem", ELEMS, ids=str)
def test_dequantize_all_codes_all_scales(elem, out_dtype):
    """Every fp8 byte (NaNs included) against every E8M0 byte (0 = 2^-127, 0xFF = NaN)."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 32)  # (256, 8192)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].expand(256, 256).contiguous()
    check_dequant(q.view(elem), s.view(torch.float8_e8m0fnu), 32, out_dtype, "dequant all codes")


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [2, 4, 8, 16, 64, 128])
@pytest.mark.parametrize("elem", ELEMS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_other_block_sizes_bitwise(bs, mode, elem):
    spec = make_spec(bs, mode, elem)
    for dtype in IN_DTYPES:
        x = make_input("wide", (2 * bs + 6, 3 * bs), dtype, elem, seed=bs)
        check_dim0(x, spec, f"dim0 bs={bs} {dtype}")
        x3 = make_input("wide", (2, 3 * bs, 37), dtype, elem, seed=bs + 1)
        check_dim1(x3, spec, f"dim1 bs={bs} {dtype}")
        x2 = make_input("nonfinite", (2 * bs, 3 * bs), dtype, elem, seed=bs + 2)
        check_dim0_dim1(x2, spec, f"dim0_dim1 bs={bs} {dtype}")
        q, s = torch_cast.quantize_dim0(x, spec)
        for out_dtype in OUT_DTYPES:
            check_dequant(q, s, bs, out_dtype, f"dequant bs={bs}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_misaligned_inputs_take_the_generic_paths(dtype):
    """x starting one element past an aligned address (a contiguous view with an offset)."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    R, C = 64, 96
    x = make_input("wide", (R, C), dtype, torch.float8_e4m3fn, seed=5)
    buf = torch.empty(R * C + 1, dtype=dtype, device="cuda")
    buf[1:] = x.reshape(-1).cuda()
    xv = buf[1:].view(R, C)
    assert xv.data_ptr() % 16 != 0
    for got, want in zip(cuda_cast.quantize_dim0(xv, spec), torch_cast.quantize_dim0(x, spec), strict=True):
        assert_same_bits(got, want, "dim0 misaligned")
    got1 = cuda_cast.quantize_dim1(xv.unsqueeze(0), spec)
    for got, want in zip(got1, torch_cast.quantize_dim1(x.unsqueeze(0), spec), strict=True):
        assert_same_bits(got, want, "dim1 misaligned")
    got01 = cuda_cast.quantize_dim0_dim1(xv, spec)
    for got, want in zip(got01, torch_cast.quantize_dim0_dim1(x, spec), strict=True):
        assert_same_bits(got, want, "dim0_dim1 misaligned")
    q, s = torch_cast.quantize_dim0(x, spec)
    qbuf = torch.empty(R * C + 1, dtype=torch.uint8, device="cuda")
    qbuf[1:] = q.view(torch.uint8).reshape(-1).cuda()
    got = cuda_cast.dequantize(qbuf[1:].view(R, C).view(q.dtype), s.cuda(), 32, torch.float32)
    assert_same_bits(got, torch_cast.dequantize(q, s, 32, torch.float32), "dequant misaligned")


@pytest.mark.gpu
def test_large_tensors_grid_stride_and_many_tiles():
    """Shapes big enough for several grid-stride passes and many dim1 tiles."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = make_input("wide", (4096, 4096), torch.bfloat16, torch.float8_e4m3fn, seed=6)
    check_dim0(x, spec, "dim0 4096x4096")
    check_dim0_dim1(x[:1024], spec, "dim0_dim1 1024x4096")
    w = make_input("normal", (4, 512, 896), torch.bfloat16, torch.float8_e4m3fn, seed=7)
    check_dim1(w, spec, "dim1 experts 4x512x896")
    q, s = torch_cast.quantize_dim0(x, spec)
    check_dequant(q, s, 32, torch.bfloat16, "dequant 4096x4096")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_public_api_kernel_cuda_matches_torch(mode):
    x3 = make_input("wide", (3, 96, 160), torch.bfloat16, torch.float8_e4m3fn, seed=8).cuda()
    for axis in (-1, -2):
        a = mxmoe.to_mx(x3, axis=axis, recipe=recipe_for("cuda", scaling_mode=mode))
        b = mxmoe.to_mx(x3.cpu(), axis=axis, recipe=recipe_for("torch", scaling_mode=mode))
        assert_same_bits(a.qdata_blocked, b.qdata_blocked, f"to_mx axis={axis} qdata")
        assert_same_bits(a.scale_blocked, b.scale_blocked, f"to_mx axis={axis} scale")
        for dt in OUT_DTYPES:
            assert_same_bits(
                a.dequantize(dt, recipe=recipe_for("cuda")), b.dequantize(dt, recipe=recipe_for("torch")),
                f"deq axis={axis}",
            )
    x2 = x3[0]
    got = mxmoe.to_mx_dim0_dim1(x2, recipe=recipe_for("cuda", scaling_mode=mode))
    want = mxmoe.to_mx_dim0_dim1(x2.cpu(), recipe=recipe_for("torch", scaling_mode=mode))
    for g_, w_ in zip(got, want, strict=True):
        assert_same_bits(g_.qdata_blocked, w_.qdata_blocked, "to_mx_dim0_dim1 qdata")
        assert_same_bits(g_.scale_blocked, w_.scale_blocked, "to_mx_dim0_dim1 scale")


@pytest.mark.gpu
@pytest.mark.parametrize("cls", CLASSES)
def test_tile_edges_bitwise(cls):
    """Shapes with partial groups / tiles / scale words, bit for bit against torch_cast: dim0 (67, 320)
    and (3, 4128); dim1 (2, 160, 200) (partial column tiles), (1, 96, 136), (3, 256, 72) (whole 4- /
    8-byte scale words per column); fused (160, 96), (64, 352), (256, 256) (whole 2- / 4-byte dim0
    and 4- / 8-byte dim1 scale words); dequant (40, 224), (8, 4128) and (3, 32)."""
    for mode in MODES:
        for elem in ELEMS:
            spec = make_spec(32, mode, elem)
            for dtype in IN_DTYPES:
                tag = f"{cls} {mode} {elem} {dtype}"
                for shape in [(67, 320), (3, 4128)]:
                    check_dim0(make_input(cls, shape, dtype, elem, seed=11), spec, f"dim0 {shape} {tag}")
                for shape in [(2, 160, 200), (1, 96, 136), (3, 256, 72)]:
                    check_dim1(make_input(cls, shape, dtype, elem, seed=12), spec, f"dim1 {shape} {tag}")
                for shape in [(160, 96), (64, 352), (256, 256)]:
                    x = make_input(cls, shape, dtype, elem, seed=13)
                    check_dim0_dim1(x, spec, f"fused {shape} {tag}")
            for shape in [(40, 224), (8, 4128), (3, 32)]:
                q, s = torch_cast.quantize_dim0(make_input(cls, shape, torch.float32, elem, seed=14), spec)
                for out_dtype in OUT_DTYPES:
                    check_dequant(q, s, 32, out_dtype, f"dequant {shape} {cls} {mode} {elem}")


@pytest.mark.gpu
def test_kernel_format_constants_match_formats():
    cuda_cast.load_extension()
    cuda_cast._check_constants()


@pytest.mark.gpu
def test_out_variants_write_into_slices():
    """quantize_dim0(out=) and dequantize(out=) (the C++ *_out operators) write into row slices of
    larger buffers (e.g. a peer's slot) exactly what the allocating calls return, nothing else."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    R, C = 37, 96
    x = make_input("wide", (R, C), torch.bfloat16, torch.float8_e4m3fn, seed=21)
    wq, ws = torch_cast.quantize_dim0(x, spec)
    qbuf = torch.full((R + 9, C), 0xA5, dtype=torch.uint8, device="cuda")
    sbuf = torch.full((R + 9, C // 32), 0x5A, dtype=torch.uint8, device="cuda")
    q, s = cuda_cast.quantize_dim0(x.cuda(), spec, out=(qbuf[4 : 4 + R], sbuf[4 : 4 + R]))
    assert q.data_ptr() == qbuf[4].data_ptr() and s.data_ptr() == sbuf[4].data_ptr()
    assert_same_bits(q, wq, "out= qdata")
    assert_same_bits(s, ws, "out= scale")
    assert bool((qbuf[:4] == 0xA5).all() and (qbuf[4 + R :] == 0xA5).all())
    assert bool((sbuf[:4] == 0x5A).all() and (sbuf[4 + R :] == 0x5A).all())
    ybuf = torch.zeros(R + 2, C, dtype=torch.bfloat16, device="cuda")
    y = cuda_cast.dequantize(wq.cuda(), ws.cuda(), 32, torch.bfloat16, out=ybuf[1 : 1 + R])
    assert y.data_ptr() == ybuf[1].data_ptr()
    assert_same_bits(y, torch_cast.dequantize(wq, ws, 32, torch.bfloat16), "dequantize out=")
    assert bool((ybuf[0] == 0).all() and (ybuf[-1] == 0).all())


@pytest.mark.gpu
def test_cpp_operators_check_their_arguments():
    """The C++ operators check in C++ and name the argument."""
    cuda_cast.load_extension()
    ops = torch.ops.mxmoe_cuda
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\]=64 is not divisible by block_size=128"):
        ops.quantize_dim0(x, 128, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="block_size must be a power of two >= 2, got 24"):
        ops.quantize_dim0(x, 24, 1, torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="elem_dtype"):
        ops.quantize_dim0(x, 32, 1, torch.float16)
    with pytest.raises(TypeError, match="x is"):
        ops.quantize_dim0(x.half(), 32, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"x must be 2D or more, got shape \(64\)"):
        ops.quantize_dim1(x[0], 32, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"x must be 1D or more, got shape \(\)"):
        ops.quantize_dim0(x[0, 0], 32, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"x.shape\[-2\]=4 is not divisible by block_size=32"):
        ops.quantize_dim1(x, 32, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"x must be 2D, got shape \(1, 4, 64\)"):
        ops.quantize_dim0_dim1(x[None], 32, 1, torch.float8_e4m3fn)
    q, s = ops.quantize_dim0(x, 32, 1, torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="s must be"):
        ops.dequantize(q, s[:, :1], 32, torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        ops.dequantize(q, s, 32, torch.float16)


@pytest.mark.gpu
def test_cpp_operators_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the C++ operators (fake implementations registered by
    cuda_cast) and the compiled results equal eager, bit for bit; so does the public API with
    kernel='cuda'."""
    cuda_cast.load_extension()
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)

    def direct(x):
        q0, s0 = cuda_cast.quantize_dim0(x, spec)
        q1, s1 = cuda_cast.quantize_dim1(x.unsqueeze(0), spec)
        q2, s2 = cuda_cast.quantize_dim1(x, spec)  # 2D in, 2D out
        q3, s3 = cuda_cast.quantize_dim0(x.view(2, -1, 512), spec)  # 3D in, 3D out
        f = cuda_cast.quantize_dim0_dim1(x, spec)
        return q0, s0, q1, s1, q2, s2, q3, s3, *f, cuda_cast.dequantize(q0, s0, 32, torch.bfloat16)

    def public(x):
        a = mxmoe.to_mx(x, recipe=recipe_for("cuda"))
        b = mxmoe.to_mx(x, axis=0, recipe=recipe_for("cuda"))
        c0, c1 = mxmoe.to_mx_dim0_dim1(x, recipe=recipe_for("cuda"))
        return a.qdata_blocked, b.scale_blocked, c1.qdata_blocked, a.dequantize(recipe=recipe_for("cuda"))

    x = make_input("wide", (256, 512), torch.bfloat16, torch.float8_e4m3fn, seed=22).cuda()
    for fn in (direct, public):
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(fn)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        for got, want in zip(torch.compile(fn, fullgraph=True)(x), fn(x), strict=True):
            assert_same_bits(got, want.cpu(), f"compiled {fn.__name__}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=str)
def test_operators_take_and_return_the_final_shapes(dtype):
    """quantize_dim0 takes x (..., C) and returns q of x's shape, s (..., C // bs); quantize_dim1
    takes x (..., R, C), ndim >= 2, and returns q (..., C, R), s (..., C, R // bs) (2D: what to_mx's
    dim1 cast of a matrix calls): bit for bit the 2D / 3D casts of x reshaped (torch_cast)."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    for shape in [(96,), (1, 64), (2, 3, 5, 64)]:
        x = make_input("normal", shape, dtype, torch.float8_e4m3fn, seed=31).reshape(shape)
        q, s = cuda_cast.quantize_dim0(x.cuda(), spec)
        wq, ws = torch_cast.quantize_dim0(x.reshape(-1, shape[-1]), spec)
        assert_same_bits(q, wq.view(shape), f"dim0 {shape} qdata")
        assert_same_bits(s, ws.view(*shape[:-1], shape[-1] // 32), f"dim0 {shape} scale")
    for shape in [(160, 72), (64, 1), (2, 3, 64, 40)]:
        x = make_input("wide", shape, dtype, torch.float8_e4m3fn, seed=32)
        *lead, R, C = shape
        q, s = cuda_cast.quantize_dim1(x.cuda(), spec)
        wq, ws = torch_cast.quantize_dim1(x.reshape(-1, R, C), spec)
        assert_same_bits(q, wq.view(*lead, C, R), f"dim1 {shape} qdata")
        assert_same_bits(s, ws.view(*lead, C, R // 32), f"dim1 {shape} scale")


@pytest.mark.gpu
def test_outputs_are_fresh_separate_tensors():
    """Every output of the quantize operators is its own contiguous allocation: no output aliases
    the input or another output (what torch.library requires of a functional operator; torch.compile
    checks it, and a shared buffer for q and s was rejected for that reason)."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = make_input("wide", (96, 160), torch.bfloat16, torch.float8_e4m3fn, seed=33).cuda()
    for outs in (cuda_cast.quantize_dim0(x, spec), cuda_cast.quantize_dim1(x, spec),
                 cuda_cast.quantize_dim0_dim1(x, spec)):
        storages = {x.untyped_storage().data_ptr()}
        for t in outs:
            assert t.is_contiguous() and t.storage_offset() == 0
            assert t.untyped_storage().data_ptr() not in storages
            storages.add(t.untyped_storage().data_ptr())


@pytest.mark.gpu
def test_large_shapes_many_tiles():
    """Large shapes: many CTAs of the one-shot grids, many dim1 tiles, 3D expert weights."""
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = make_input("wide", (4096, 4096), torch.bfloat16, torch.float8_e4m3fn, seed=15)
    check_dim0(x, spec, "dim0 4096x4096")
    check_dim0_dim1(x[:2048], spec, "dim0_dim1 2048x4096")
    check_dim1(x.reshape(8, 512, 4096), spec, "dim1 8x512x4096")
    q, s = torch_cast.quantize_dim0(x, spec)
    check_dequant(q, s, 32, torch.bfloat16, "dequant 4096x4096")


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    spec = make_spec(32, "rceil", torch.float8_e4m3fn)
    x = make_input("normal", (256, 512), torch.bfloat16, torch.float8_e4m3fn, seed=9)
    xc = x.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q, s = cuda_cast.quantize_dim0(xc, spec)
    torch.cuda.current_stream().wait_stream(side)
    wq, ws = torch_cast.quantize_dim0(x, spec)
    assert_same_bits(q, wq, "side-stream qdata")
    assert_same_bits(s, ws, "side-stream scale")


# ------------------------------------------------------------------------------------------------
# Standalone self-check: python tests/quant/test_cuda_cast.py


def _self_check() -> int:
    if not torch.cuda.is_available():
        print("self-check needs a CUDA GPU")
        return 1
    cuda_cast.load_extension()
    failures = 0
    total = 0
    for cls in CLASSES:
        for mode in MODES:
            for elem in ELEMS:
                for dtype in IN_DTYPES:
                    spec = make_spec(32, mode, elem)
                    checks = [
                        (check_dim0, make_input(cls, (67, 320), dtype, elem, 1)),
                        (check_dim1, make_input(cls, (2, 160, 70), dtype, elem, 2)),
                        (check_dim0_dim1, make_input(cls, (160, 96), dtype, elem, 3)),
                    ]
                    for fn, x in checks:
                        total += 1
                        try:
                            fn(x, spec, f"{fn.__name__} {cls} {mode} {elem} {dtype}")
                        except AssertionError as err:
                            failures += 1
                            print("FAIL", err)
                    q, s = torch_cast.quantize_dim0(make_input(cls, (40, 224), torch.float32, elem, 4), spec)
                    for out_dtype in OUT_DTYPES:
                        total += 1
                        try:
                            check_dequant(q, s, 32, out_dtype, f"dequant {cls} {mode} {elem}")
                        except AssertionError as err:
                            failures += 1
                            print("FAIL", err)
    print(f"correctness: {total - failures}/{total} checks bit-identical to torch_cast")

    from mxmoe.bench.timing import bench, copy_bandwidth_tbs

    copy = copy_bandwidth_tbs()
    print(f"device copy bandwidth: {copy:.2f} TB/s")
    rows = []
    for mode in ("floor", "rceil"):
        spec = make_spec(32, mode, torch.float8_e4m3fn)
        for shape in [(16384, 16384), (131072, 7168), (131072, 2048), (8, 2048, 7168), (8, 7168, 2048)]:
            x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            n = x.numel()
            cast_bytes = n * 2 + n + n // 32
            ops = {}
            if x.ndim == 2:
                ops["dim0"] = (lambda x=x, spec=spec: cuda_cast.quantize_dim0(x, spec), cast_bytes)
                ops["dim1"] = (
                    lambda x=x, spec=spec: cuda_cast.quantize_dim1(x.unsqueeze(0), spec),
                    cast_bytes,
                )
                ops["dim0_dim1"] = (
                    lambda x=x, spec=spec: cuda_cast.quantize_dim0_dim1(x, spec),
                    n * 2 + 2 * (n + n // 32),
                )
                q, s = cuda_cast.quantize_dim0(x, spec)
                ops["dequant"] = (lambda q=q, s=s: cuda_cast.dequantize(q, s, 32, torch.bfloat16), cast_bytes)
            else:
                x2 = x.reshape(-1, shape[-1])
                ops["dim0"] = (lambda x2=x2, spec=spec: cuda_cast.quantize_dim0(x2, spec), cast_bytes)
                ops["dim1"] = (lambda x=x, spec=spec: cuda_cast.quantize_dim1(x, spec), cast_bytes)
            for name, (fn, nbytes) in ops.items():
                t = bench(fn, warmup=5, iters=20)
                tbs = nbytes / (t.median_ms * 1e-3) / 1e12
                rows.append((mode, name, shape, t.median_ms, tbs, tbs / copy))
            del x
    for mode, name, shape, ms, tbs, frac in rows:
        print(f"{mode:6s} {name:10s} {str(shape):20s} {ms:8.3f} ms {tbs:6.2f} TB/s {frac:5.2f} x copy")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_self_check())


def test_check_cuda_build_script_refuses_a_tree_without_sources(tmp_path):
    """scripts/check_cuda_build.sh outside a tree holding the CUDA sources checks nothing: an error,
    not a pass (its globs once came back empty without a word)."""
    import shutil
    import subprocess

    from conftest import nvcc_path

    if nvcc_path() is None or shutil.which("nvcc") is None:
        pytest.skip("the script skips its checks without nvcc on PATH")
    script = Path(__file__).parents[2] / "scripts" / "check_cuda_build.sh"
    (tmp_path / "scripts").mkdir()
    shutil.copy(script, tmp_path / "scripts")
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / script.name)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "no mxmoe/*/csrc/*.cu or binding.cpp" in proc.stderr
