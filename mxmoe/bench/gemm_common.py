"""What `mxmoe bench linear` and `mxmoe bench grouped_mm` share: recipes, shape parsing, the result
rows, the timed fwd+bwd and forward GEMMs (dense: offs None; grouped: offs given) and the command
line."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mxmoe.bench.timing import (
    bench,
    bf16_gemm_tflops,
    check_json,
    environment,
    print_table,
    require_cuda,
    write_json,
)
from mxmoe.cli import ArgumentParser, comma_list, positive_int
from mxmoe.recipe import CAST_KERNELS, GEMM_BACKENDS, RECIPES, check_gemm_backend  # RECIPES: timed

BLOCK = 32
"""The MX block of every timed recipe: K and N (the dims the casts block) are multiples of it."""


def shape_parser(pattern: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """argparse type for shapes like `pattern` ("MxKxN"): a tuple of len(pattern.split('x')) ints,
    its K and N multiples of BLOCK."""
    names = pattern.split("x")

    def parse(s: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(v) for v in s.lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) != len(names) or min(dims) <= 0:
            raise argparse.ArgumentTypeError(f"shape {s!r}: expected {pattern}, e.g. {example}")
        bad = [f"{k}={d}" for k, d in zip(names, dims, strict=True) if k in ("K", "N") and d % BLOCK]
        if bad:
            raise argparse.ArgumentTypeError(
                f"shape {s!r}: {', '.join(bad)}: expected K and N multiples of {BLOCK} (the MX block)"
            )
        return dims

    return parse


def row(shape: str, recipe: str, t: float, t_bf16: float, flops: float, tc: float, tg: float) -> dict:
    """One result row: fwd+bwd time t (ms), its TFLOP/s, ratio to bf16, casts and GEMMs alone (ms)."""
    return {
        "shape": shape,
        "recipe": recipe,
        "fwd+bwd ms": t,
        "TFLOP/s": flops / t / 1e9,
        "vs bf16": t_bf16 / t,
        "casts ms": tc,
        "gemms ms": tg,
        "cast share": tc / t,
    }


def forward_row(shape: str, gemm: str, t: float | None, t_bf16: float, flops: float, note: str = "") -> dict:
    """One forward-GEMM row: time t (ms; None: could not run, `note` says why), TFLOP/s, ratio to bf16."""
    return {
        "shape": shape,
        "forward GEMM": gemm,
        "ms": t,
        "TFLOP/s": None if t is None else flops / t / 1e9,
        "vs bf16": None if t is None else t_bf16 / t,
        "note": note,
    }


def rowwise_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) -> (e4m3 (..., K), fp32 scale (..., 1)) with x ~ q * scale: torch's row-wise fp8."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def timed_or_reason(fn: Callable[[], object], iters: int) -> tuple[float | None, str]:
    """(median ms, "") of fn, or (None, the error) when fn cannot run here (e.g. an op torch lacks)."""
    try:
        return bench(fn, iters=iters).median_ms, ""
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def _gemm(a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """The bf16 GEMM of the bench: torch.mm (dense) or torch._grouped_mm (offs given)."""
    return torch.mm(a, b) if offs is None else torch._grouped_mm(a, b, offs=offs)


def fwd_bwd_rows(
    name: str, a: Tensor, w: Tensor, dy: Tensor, offs: Tensor | None, recipes: list[str], kernel: str,
    iters: int, gemm_backend: str,
) -> list[dict]:
    """Forward+backward of y = a Wᵀ, bf16 then MX (each recipe, the op the model runs: `mx_mm`, or
    `mx_grouped_mm` with offs), the MX time split into its operand casts alone and its GEMMs alone
    (the emulated backend's path). a (M, K) bf16 requiring grad, w (N, K) or (E, N, K) bf16
    requiring grad, dy (M, N) bf16, offs None or (E,) int32 group ends."""
    from mxmoe.ops import mx_grouped_mm, mx_mm
    from mxmoe.ops.gemm import gemm
    from mxmoe.quant.qdq import qdq, qdq_dim0_dim1

    flops = 6 * a.shape[0] * a.shape[1] * w.shape[-2]
    bf = torch.bfloat16

    def bf16_step():
        (F.linear(a, w) if offs is None else _gemm(a, w.transpose(-2, -1), offs)).backward(dy)

    def bf16_gemms():
        ad, wd = a.detach(), w.detach()
        _gemm(ad, wd.transpose(-2, -1), offs), _gemm(dy, wd, offs), _gemm(dy.t(), ad, offs)

    t_bf16 = bench(bf16_step, iters=iters).median_ms
    t_bf16_gemm = bench(bf16_gemms, iters=iters).median_ms
    rows = [row(name, "bf16", t_bf16, t_bf16, flops, 0.0, t_bf16_gemm)]
    for recipe in recipes:
        r = RECIPES[recipe].replace(dim0_kernel=kernel, dim1_kernel=kernel, gemm_backend=gemm_backend)

        def mx_step(r=r):
            w_t = w.transpose(-2, -1)
            (mx_mm(a, w_t, r) if offs is None else mx_grouped_mm(a, w_t, offs, r)).backward(dy)

        # the emulated GEMM's operand casts (fused quantize-dequantize), as the op runs them: a and dy
        # both ways (along K / N, and along M, per group with offs) from one read each, W along K
        # (forward) and along N (backward)
        def casts(r=r):
            a0, a1 = qdq_dim0_dim1(a.detach(), recipe=r, out_dtype=bf, offs=offs)
            w0 = qdq(w.detach(), -1, recipe=r, out_dtype=bf)
            dy0, dy1 = qdq_dim0_dim1(dy, recipe=r, out_dtype=bf, offs=offs)
            w1 = qdq(w.detach(), -2, recipe=r, out_dtype=bf)
            return a0, a1, w0, dy0, dy1, w1

        a0, a1, w0, dy0, dy1, w1 = casts()

        def gemms(a0=a0, a1=a1, w0=w0, dy0=dy0, dy1=dy1, w1=w1):
            gemm(a0, w0.transpose(-2, -1), offs, bf)
            gemm(dy0, w1, offs, bf)
            gemm(dy1.t(), a1, offs, bf)

        t = bench(mx_step, iters=iters).median_ms
        emulated = gemm_backend == "emulated"  # the split below is the emulated path's
        tc = bench(casts, iters=iters).median_ms if emulated else float("nan")
        tg = bench(gemms, iters=iters).median_ms if emulated else float("nan")
        rows.append(row(name, recipe, t, t_bf16, flops, tc, tg))
        del a0, a1, w0, dy0, dy1, w1
    a.grad = w.grad = None
    return rows


def forward_rows(
    name: str, a: Tensor, w: Tensor, offs: Tensor | None, kernel: str, iters: int,
    scaled: Callable[[bool], Tensor],
) -> list[dict]:
    """y = a Wᵀ alone: bf16 (torch.mm, or torch._grouped_mm with offs), fp8 row-wise (`scaled(fast_accum)`:
    torch's `_scaled_mm` / `_scaled_grouped_mm` call on row-wise fp8 operands, with and without
    fast accumulation), and each MX GEMM backend (recipe mxfp8_rceil) on pre-cast operands.
    a (M, K) bf16, w (N, K) or (E, N, K) bf16, offs None or (E,) int32 group ends."""
    from mxmoe.ops import mx_gemm
    from mxmoe.quant.mx_tensor import to_mx

    flops = 2 * a.shape[0] * a.shape[1] * w.shape[-2]
    bf16_name = "bf16 torch.mm" if offs is None else "bf16 torch._grouped_mm"
    scaled_name = "fp8 row-wise _scaled_mm" if offs is None else "fp8 row-wise _scaled_grouped_mm"
    t_bf16 = bench(lambda: _gemm(a, w.transpose(-2, -1), offs), iters=iters).median_ms
    rows = [forward_row(name, bf16_name, t_bf16, t_bf16, flops)]
    for fast in (True, False):
        t, why = timed_or_reason(lambda fast=fast: scaled(fast), iters)
        rows.append(forward_row(name, f"{scaled_name} fast_accum={fast}", t, t_bf16, flops, why))
    rk = RECIPES["mxfp8_rceil"].replace(dim0_kernel=kernel, dim1_kernel=kernel)
    a0 = to_mx(a, axis=-1, recipe=rk)
    w0 = to_mx(w.transpose(-2, -1), axis=-2, recipe=rk)
    for backend in GEMM_BACKENDS:
        r = RECIPES["mxfp8_rceil"].replace(dim0_kernel=kernel, gemm_backend=backend)
        t, why = timed_or_reason(lambda r=r: mx_gemm(a0, w0, offs, recipe=r), iters)
        rows.append(forward_row(name, f"mxfp8_rceil mx_gemm {backend}", t, t_bf16, flops, why))
    return rows


def build_parser(name: str, doc: str, pattern: str, example: str, forward: bool) -> argparse.ArgumentParser:
    """The options of `mxmoe bench NAME` (linear, grouped_mm); `forward`: it has --forward."""
    p = ArgumentParser(prog=f"mxmoe bench {name}", description=doc)
    p.add_argument(
        "--shape",
        type=comma_list(shape_parser(pattern, example)),
        action="extend",
        help=f"{pattern}, comma list; default: MoE shapes",
    )
    p.add_argument(
        "--recipes", type=comma_list(choices=list(RECIPES)), action="extend", help="comma list; default: all"
    )
    p.add_argument(
        "--kernel", default="auto", choices=("auto", *CAST_KERNELS), help="cast kernel (default auto)"
    )
    p.add_argument(
        "--gemm_backend", default="emulated", help=f"MX GEMM backend of fwd+bwd: {' | '.join(GEMM_BACKENDS)}"
    )
    p.add_argument("--iters", type=positive_int, default=20, help="timed runs per measurement (default 20)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and the environment as JSON")
    if forward:
        p.add_argument(
            "--forward",
            action="store_true",
            help="the forward GEMM alone: bf16, torch fp8 row-wise, each MX GEMM backend",
        )
    return p


def main(
    argv: list[str],
    *,
    name: str,
    doc: str,
    pattern: str,
    example: str,
    shapes: Sequence[tuple[int, ...]],
    run_shape: Callable[..., list[dict]],
    run_forward: Callable[..., list[dict]] | None = None,
) -> int:
    """The command line of a GEMM bench: `run_shape(*shape, recipes, kernel, iters, gemm_backend=)` per shape;
    with --forward, `run_forward(*shape, kernel, iters)` instead: the forward GEMM alone, bf16 vs fp8
    row-wise (torch) vs the MX backends on pre-cast operands."""
    p = build_parser(name, doc, pattern, example, forward=run_forward is not None)
    args = p.parse_args(argv)
    try:  # argparse's choices= would not say why a removed backend is gone
        check_gemm_backend(args.gemm_backend, "--gemm_backend")
    except ValueError as e:
        p.error(str(e))
    check_json(p, args.json)
    require_cuda(f"mxmoe bench {name}")
    ceiling = bf16_gemm_tflops()
    # what the rows were measured with: without it, runs of two backends or kernels read the same
    asked = {"kernel": args.kernel, "iters": args.iters, "forward": bool(getattr(args, "forward", False))}
    if run_forward is not None and args.forward:
        rows = []
        for shape in args.shape or shapes:
            rows += run_forward(*shape, args.kernel, args.iters)
            torch.cuda.empty_cache()
        print_table(rows, title=f"{name} forward GEMM; bf16 GEMM ceiling 8192^3: {ceiling:.0f} TFLOP/s")
        if args.json:
            write_json(args.json, {"env": environment(), **asked, "bf16_gemm_tflops": ceiling, "rows": rows})
        return 0
    rows = []
    for shape in args.shape or shapes:
        rows += run_shape(
            *shape, args.recipes or list(RECIPES), args.kernel, args.iters, gemm_backend=args.gemm_backend
        )
        torch.cuda.empty_cache()
    title = (
        f"{name} fwd+bwd (3 GEMMs), MX GEMM backend {args.gemm_backend}; bf16 GEMM ceiling 8192^3: "
        f"{ceiling:.0f} TFLOP/s"
    )
    print_table(rows, title=title)
    if args.json:
        write_json(
            args.json,
            {"env": environment(), **asked, "gemm_backend": args.gemm_backend, "bf16_gemm_tflops": ceiling,
             "rows": rows},
        )
    return 0
