"""`mxmoe bench cast`: speed of the MX cast kernels as a fraction of the device copy bandwidth.

Every cast is called the way users get it: the `triton` and `cuda` backends through the
`mxmoe::*` custom ops, the `torch` backend compiled with `torch.compile` (its only fast form).
Bytes counted per call: input read + elements and scales written (the fused dim0+dim1 cast reads x
once and writes both outputs; dequantize reads elements and scales and writes the output). The
copy ceiling is measured in the same run with the same timing utility (mxmoe.bench.timing).

    mxmoe bench cast                                    # every mode, kernel, scaling, default shape
    mxmoe bench cast --mode dim1 --kernel triton --shape 16384x16384 --json out.json
    mxmoe bench cast --mode 3d --shape 8x2048x7168      # expert weights, blocks along either dim
    mxmoe bench cast --mode qdq --kernel cuda,triton    # fused quantize-dequantize, rows layout

The qdq rows (`mxmoe.quant.qdq`, the kernels the emulated GEMM's operands come from, bf16 in and
out): kernel triton times every row with the Triton rows kernel, kernel cuda with the C++
operators mxmoe_cuda::qdq_dim0, qdq_dim1 and qdq_dim0_dim1 (the grouped rows too). They
count the input read and each bf16 output written: dim0 or dim1 alone 4 bytes per element,
both 6. "E=8" / "E=256": dim1 blocks per expert group (ragged groups, some empty, rows after the
last), as `mx_grouped_mm` casts tokens and dy; "3d E=16": the input viewed as 16 matrices, dim1
blocks per matrix, as `mx_grouped_mm` casts the expert weights along N (the row count must divide
by 16); the others as `mx_mm` does. The SwiGLU rows time the experts' w2 input (h = F.silu(g) * u
formed by torch then cast, against `swiglu_qdq_dim0_dim1`) and the casts of its gradients (dg and
du formed by torch's silu_backward and muls then cast each, against `swiglu_bwd_qdq_dim0_dim1`),
bytes counted the fused op's way: g, u read and two outputs written (8 per element); dh, g, u read
and four outputs written (14 per element).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from mxmoe.bench import timing
from mxmoe.cli import ArgumentParser, comma_list, positive_int
from mxmoe.recipe import CAST_KERNELS

MODES = ("dim0", "dim1", "dim0_dim1", "3d", "dequant", "qdq")
QDQ_LABELS = ("qdq dim0", "qdq dim1 rows", "qdq dim1 rows 3d E=16", "qdq dim0+dim1 rows",
              "qdq dim0+dim1 rows E=8", "qdq dim0+dim1 rows E=256",
              "silu(g)*u, qdq dim0+dim1 rows E=8", "swiglu_qdq dim0+dim1 rows E=8",
              "silu bwd, 2x qdq dim0+dim1 rows E=8", "swiglu_bwd_qdq dim0+dim1 rows E=8")
SWIGLU_LABELS = QDQ_LABELS[-4:-2]  # inputs (g, u), both of the shape
SWIGLU_BWD_LABELS = QDQ_LABELS[-2:]  # inputs (dh, g, u), all of the shape
SCALINGS = ("floor", "rceil")
KERNELS = CAST_KERNELS
DEFAULT_SHAPES_2D = ((16384, 16384), (131072, 7168), (131072, 2048))
DEFAULT_SHAPES_3D = ((8, 2048, 7168), (8, 7168, 2048))
ELEMS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 32


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(t) for t in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (2, 3) or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(
            f"shape {text!r} is not RxC or BxRxC with positive integers (e.g. 16384x16384, 8x2048x7168)"
        )
    if dims[-1] % BLOCK or dims[-2] % BLOCK:
        raise argparse.ArgumentTypeError(f"shape {text!r}: the last two dims must be multiples of {BLOCK}")
    return dims


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench cast",
        description="Time the MX cast kernels (median of CUDA-event timings, inputs rotated past the "
        "L2) against the device copy bandwidth measured in the same run.",
    )
    p.add_argument("--mode", choices=(*MODES, "all"), default="all",
                   help="dim0: blocks along the last dim; dim1: blocks along dim 0, stored transposed; "
                   "dim0_dim1: both from one read; 3d: expert weights (E, N, K) along K and along N; "
                   "dequant: back to bf16; qdq: fused quantize-dequantize (Triton and cuda)")
    p.add_argument("--scaling", choices=(*SCALINGS, "all"), default="all", help="scale mode")
    p.add_argument("--kernel", type=comma_list(choices=(*KERNELS, "all")), action="extend",
                   help="backend(s), comma list (torch = torch_cast under torch.compile); default all")
    p.add_argument("--shape", type=comma_list(_shape), action="extend",
                   help="RxC for 2D modes or ExNxK for 3d, comma list; defaults: "
                   + ", ".join("x".join(map(str, s)) for s in DEFAULT_SHAPES_2D + DEFAULT_SHAPES_3D))
    p.add_argument("--elem", choices=tuple(ELEMS), default="e4m3", help="element format")
    p.add_argument("--iters", type=positive_int, default=50, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=positive_int, default=10, help="untimed iterations first")
    p.add_argument("--graph", action="store_true",
                   help="time CUDA-graph replays of each call (the kernels' GPU time without the host's "
                   "per-call cost; see mxmoe.bench.timing.bench)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    return p


@dataclass
class Case:
    mode: str  # row label
    kernel: str  # row label
    backend: str  # torch | triton | cuda
    scaling: str
    shape: tuple[int, ...]


def _cases(args) -> list[Case]:
    modes = MODES if args.mode == "all" else (args.mode,)
    scalings = SCALINGS if args.scaling == "all" else (args.scaling,)
    kernels = KERNELS if not args.kernel or "all" in args.kernel else tuple(dict.fromkeys(args.kernel))
    shapes = args.shape or []
    s2 = [s for s in shapes if len(s) == 2] or list(DEFAULT_SHAPES_2D)
    s3 = [s for s in shapes if len(s) == 3] or list(DEFAULT_SHAPES_3D)
    cases = []
    for mode in modes:
        for shape in s3 if mode == "3d" else s2:
            for scaling in scalings if mode != "dequant" else ("-",):
                for k in kernels:
                    # qdq: the Triton rows kernel and the CUDA qdq operators (torch: no qdq row)
                    if mode != "qdq" or k in ("triton", "cuda"):
                        cases.append(Case(mode, k, k, scaling, shape))
    return cases


def _bytes(mode: str, shape, in_size: int, out_size: int = 2) -> int:
    n = 1
    for d in shape:
        n *= d
    if mode in SWIGLU_LABELS:  # g and u read, two outputs of out_size bytes
        return 2 * n * in_size + 2 * n * out_size
    if mode in SWIGLU_BWD_LABELS:  # dh, g and u read, four outputs of out_size bytes
        return 3 * n * in_size + 4 * n * out_size
    if mode.startswith("qdq"):  # read once, one or two outputs of out_size bytes
        return n * in_size + (2 if "dim0+dim1" in mode else 1) * n * out_size
    elems_and_scales = n + n // BLOCK
    if mode == "dequant":
        return elems_and_scales + n * out_size
    if mode == "dim0_dim1":
        return n * in_size + 2 * elems_and_scales
    return n * in_size + elems_and_scales


def _make_fns(case: Case, elem: torch.dtype):
    """{row label: fn} calling the cast like a user does; fn takes one input set (x,) or (q, s)."""
    from mxmoe.formats import format_of, make_spec
    from mxmoe.quant import custom_ops, torch_cast

    spec = make_spec(BLOCK, case.scaling if case.scaling != "-" else "rceil", elem)
    k = case.backend
    if case.mode == "qdq":
        return _qdq_fns(case, elem)
    if k == "torch":
        casts = {
            "dim0": lambda x: torch_cast.quantize_dim0(x, spec),
            "dim1": lambda x: torch_cast.quantize_dim1(x.unsqueeze(0), spec),
            "dim0_dim1": lambda x: torch_cast.quantize_dim0_dim1(x, spec),
            "3d axis=-1": lambda x: torch_cast.quantize_dim0(x.view(-1, x.shape[-1]), spec),
            "3d axis=-2": lambda x: torch_cast.quantize_dim1(x, spec),
            "dequant": lambda q, s: torch_cast.dequantize(q, s, BLOCK, torch.bfloat16),
        }
        return {m: torch.compile(f, dynamic=False) for m, f in casts.items()}
    args = (format_of(elem, BLOCK, spec.mode).name, k)
    return {
        "dim0": lambda x: custom_ops.quantize_dim0(x, *args),
        "dim1": lambda x: custom_ops.quantize_dim1(x.unsqueeze(0), *args),
        "dim0_dim1": lambda x: custom_ops.quantize_dim0_dim1(x, *args),
        "3d axis=-1": lambda x: custom_ops.quantize_dim0(x.view(-1, x.shape[-1]), *args),
        "3d axis=-2": lambda x: custom_ops.quantize_dim1(x, *args),
        "dequant": lambda q, s: custom_ops.dequantize(q, s, BLOCK, torch.bfloat16, k),
    }


def _qdq_fns(case: Case, elem: torch.dtype):
    """{qdq label: fn(x)} through the public qdq API (bf16 out), groups as the label says."""
    import torch.nn.functional as F

    from mxmoe.quant.qdq import qdq, qdq_dim0_dim1, swiglu_bwd, swiglu_bwd_qdq_dim0_dim1, swiglu_qdq_dim0_dim1
    from mxmoe.recipe import MXRecipe

    r = MXRecipe(elem_dtype=elem, scaling_mode=case.scaling, dim0_kernel=case.backend,
                 dim1_kernel=case.backend)
    bf = torch.bfloat16
    R = case.shape[0]

    def ragged(E: int) -> torch.Tensor:  # E ragged groups (every 5th empty), 7 rows after the last
        g = torch.Generator().manual_seed(E)
        w = torch.rand(E, generator=g) + 0.5
        w[::5] = 0
        counts = (w / w.sum() * (R - 7)).floor().to(torch.int64)
        return counts.cumsum(0).to(torch.int32).cuda()

    o8, o256 = ragged(8), ragged(256)
    return {
        "qdq dim0": lambda x: qdq(x, -1, recipe=r, out_dtype=bf),
        "qdq dim1 rows": lambda x: qdq(x, -2, recipe=r, out_dtype=bf),
        "qdq dim1 rows 3d E=16": lambda x: qdq(x.view(16, R // 16, -1), -2, recipe=r, out_dtype=bf),
        "qdq dim0+dim1 rows": lambda x: qdq_dim0_dim1(x, recipe=r, out_dtype=bf),
        "qdq dim0+dim1 rows E=8": lambda x: qdq_dim0_dim1(x, recipe=r, out_dtype=bf, offs=o8),
        "qdq dim0+dim1 rows E=256": lambda x: qdq_dim0_dim1(
            x, recipe=r, out_dtype=bf, offs=o256
        ),
        "silu(g)*u, qdq dim0+dim1 rows E=8": lambda g, u: qdq_dim0_dim1(
            F.silu(g) * u, recipe=r, out_dtype=bf, offs=o8
        ),
        "swiglu_qdq dim0+dim1 rows E=8": lambda g, u: swiglu_qdq_dim0_dim1(
            g, u, recipe=r, out_dtype=bf, offs=o8
        ),
        "silu bwd, 2x qdq dim0+dim1 rows E=8": lambda dh, g, u: tuple(
            y for x in swiglu_bwd(dh, g, u) for y in qdq_dim0_dim1(x, recipe=r, out_dtype=bf, offs=o8)
        ),
        "swiglu_bwd_qdq dim0+dim1 rows E=8": lambda dh, g, u: swiglu_bwd_qdq_dim0_dim1(
            dh, g, u, recipe=r, out_dtype=bf, offs=o8
        ),
    }


def _inputs(mode: str, shape, elem: torch.dtype, count: int) -> list[tuple]:
    sets = []
    for i in range(count):
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        x.mul_(2.0 ** ((i % 7) - 3))
        if mode == "dequant":
            from mxmoe.formats import make_spec
            from mxmoe.quant import torch_cast

            q, s = torch_cast.quantize_dim0(x, make_spec(BLOCK, "rceil", elem))
            del x
            sets.append((q, s))
        elif mode in SWIGLU_LABELS:
            sets.append((x, torch.randn(shape, dtype=torch.bfloat16, device="cuda")))
        elif mode in SWIGLU_BWD_LABELS:  # (dh, g, u)
            sets.append((x, *(torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))))
        else:
            sets.append((x,))
    return sets


def _run_case(case: Case, args, copy_tbs: float, elem: torch.dtype) -> list[dict]:
    from mxmoe.quant.backends import why_unavailable

    labels = {"3d": ("3d axis=-1", "3d axis=-2"), "qdq": QDQ_LABELS}.get(case.mode, (case.mode,))
    shape_s = "x".join(map(str, case.shape))
    base = {"kernel": case.kernel, "scaling": case.scaling, "shape": shape_s}

    def error_rows(msg: str) -> list[dict]:
        msg = " ".join(str(msg).split())[:160]
        return [{"mode": m, **base, "us": None, "TB/s": None, "% of copy": None, "note": msg} for m in labels]

    reason = why_unavailable(case.backend, torch.device("cuda"))
    if reason is not None:
        return error_rows(reason)
    rows = []
    try:
        fns = _make_fns(case, elem)
        for label in labels:
            nbytes = _bytes(label if label in QDQ_LABELS else case.mode, case.shape, 2)
            count = timing.rotation_count(nbytes)
            sets = _inputs(label, case.shape, elem, count)
            fn = fns[label]
            t = timing.bench(fn, sets, warmup=args.warmup, iters=args.iters, graph=args.graph)
            tbs = nbytes / (t.median_ms * 1e-3) / 1e12
            rows.append({"mode": label, **base, "us": t.median_ms * 1e3, "TB/s": tbs,
                         "% of copy": 100 * tbs / copy_tbs, "note": ""})
            del sets
    except Exception as e:  # a kernel that fails to build or run is a row, not a crash
        done = {r["mode"] for r in rows}
        rows += [r for r in error_rows(f"{type(e).__name__}: {e}") if r["mode"] not in done]
    finally:
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    # a shape no chosen mode takes (RxC for the 2D modes, ExNxK for 3d) would leave that mode's
    # default shapes timed in its place
    ranks = {3 if m == "3d" else 2 for m in (MODES if args.mode == "all" else (args.mode,))}
    unused = [s for s in args.shape or [] if len(s) not in ranks]
    if unused:
        p.error(f"--shape {'x'.join(map(str, unused[0]))}: --mode {args.mode} takes "
                f"{'ExNxK' if 3 in ranks else 'RxC'} shapes")
    timing.check_json(p, args.json)
    timing.require_cuda("mxmoe bench cast")
    from tqdm import tqdm

    elem = ELEMS[args.elem]
    cases = _cases(args)
    copy_tbs = timing.copy_bandwidth_tbs()
    rows = []
    for case in tqdm(cases, desc="bench cast", unit="case"):
        rows += _run_case(case, args, copy_tbs, elem)
    env = timing.environment()
    title = (f"MX cast ({args.elem}, block {BLOCK}, bf16 in/out) on {env.get('gpu')}; "
             f"copy bandwidth {copy_tbs:.3f} TB/s (same run); median of {args.iters} iters"
             + (" of CUDA-graph replays" if args.graph else ""))
    timing.print_table(rows, title=title)
    if args.json:
        timing.write_json(args.json, {"env": env, "copy_tbs": copy_tbs, "elem": args.elem,
                                      "iters": args.iters, "graph": args.graph, "rows": rows})
    return 0
