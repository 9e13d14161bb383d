"""CPU proxy of the MX ops' host cost per call (no GPU needed).

On a GPU the emulated-GEMM path of `mx_mm` / `mx_grouped_mm` spends its host time in our Python,
torch's dispatch of each aten op (allocation, views, GEMMs) and one Triton launch per qdq. This
script runs that same path on CPU at tiny shapes: the recipe's cast kernels are "triton" (the GPU's
qdq path, taken on CPU through TRITON_INTERPRET=1), but the Triton kernels' launches are replaced
by no-ops (counted), so what is timed is our Python plus torch's dispatch of real (tiny) CPU ops,
not the interpreter. Beside each MX op: the native op it stands in for, in the same run.

    TRITON_INTERPRET=1 python scripts/host_cost_cpu.py [--iters 2000] [--profile OP]
    TRITON_INTERPRET=1 python scripts/host_cost_cpu.py --model [--iters 20]

--cuda-route: the GPU's default route ("auto" takes the CUDA backend: the C++ operators of mxmoe's
CUDA extension, torch.ops.mxmoe_cuda.*) measured on this CPU. The operators are replaced by CPU
stand-ins registered under the same names and schemas (csrc/binding.cpp) that return outputs of the
right shapes and dtypes, preallocated once per shape, and compute nothing; the "cuda" backend is made
resolvable on CPU tensors, the bf16 grouped GEMM runs torch._grouped_mm followed by the tail-rows
operator as on CUDA, the CPU GEMMs (aten::mm, aten::_grouped_mm: torch.mm, torch._grouped_mm and
their backward formulas, in the native rows and inside the MX ops alike) are stand-ins too, and offs
are not read on the host (on a GPU they live on the device). All this
is set up by this script only (never by mxmoe): what is timed is mxmoe's Python around the operators
plus torch's dispatch of the stand-ins and of real (tiny) CPU aten ops, NOT kernel time, and not a
GPU's own per-op host cost. The row "stand-in op alone" gives one stand-in call's cost. Emulated
GEMMs in bf16 (the recipe's gemm_dtype, as on CUDA), the default recipe's kernels ("auto").

    python scripts/host_cost_cpu.py --cuda-route [--iters 2000] [--profile OP] [--only OP]

--model: a training step (forward, cross-entropy, backward) of torchtitan 0.2.2's DeepSeek-V3 debug
model (configs/torchtitan/deepseek_v3_debug_0.2.toml: 6 layers, 8 routed experts top-3, 2 shared,
attention, router and head high precision) with its dims cut to 64 (2 heads of 32 + 32, vocabulary
256: what is timed is the host's work, not the CPU's GEMMs) and a batch of 1 x 64 tokens,
bf16 and converted by `--model.converters mxmoe` (the 0.2 adapter), as torchtitan runs it on one
GPU: fp32 parameters under bf16 autocast, grouped GEMMs through torch._grouped_mm (as on CUDA: the
CPU's exact loop over groups is not what a GPU runs), the casts' kernels Triton (launches counted,
not run), the emulated GEMMs in bf16. torchtitan 0.2.2 is imported from --torchtitan02 (default
.venv/torchtitan-0.2, where `make test` installs it).

Columns: us (CPU µs per call of this process, best of 5 rounds), aten (aten ops dispatched per call),
launches (Triton kernel launches per call: each costs the Triton launcher's time on a GPU, not
counted in us), pycalls (Python and builtin function calls per call: deterministic, where us is
noisy on a shared machine). --profile OP prints a cProfile of that row (by total time).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's mxmoe

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import mxmoe  # noqa: E402
from mxmoe.ops import mx_grouped_mm, mx_mm  # noqa: E402
from mxmoe.quant import to_mx  # noqa: E402
from mxmoe.quant.qdq import qdq, qdq_dim0_dim1  # noqa: E402

LAUNCHES = [0]


class _NoLaunch:
    """Stands in for `kernel[grid]`: counts the launch, runs nothing."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES[0] += 1

        return launch


def _stub_triton() -> None:
    from mxmoe.quant import triton_cast, triton_qdq

    for mod in (triton_qdq, triton_cast):
        for name in dir(mod):
            obj = getattr(mod, name)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and name.endswith("kernel"):
                setattr(mod, name, _NoLaunch())


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _cases(M: int, K: int, E: int):
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, dtype=dt, generator=g)
    dy = torch.randn(M, K, dtype=dt, generator=g)
    xg = x.clone().requires_grad_()
    w = torch.nn.Parameter(torch.randn(K, K, dtype=dt, generator=g))  # (N, K)
    w3 = torch.nn.Parameter(torch.randn(E, K, K, dtype=dt, generator=g))  # (E, N, K)
    w3_t = w3.transpose(-2, -1)
    offs = (torch.arange(1, E + 1, dtype=torch.int32) * (M // E)).contiguous()
    r = mxmoe.recipe("mxfp8_rceil", dim0_kernel="triton", dim1_kernel="triton", gemm_dtype=torch.bfloat16)

    def fwd_bwd(f):
        def run():
            f().backward(dy)
            xg.grad = w.grad = w3.grad = None

        return run

    wt, w3t = w.detach().t(), w3_t.detach()
    return [
        # fwd: inputs that need no gradient (no autograd graph), as `mxmoe bench overhead`'s fwd rows
        ("torch.mm fwd", lambda: torch.mm(x, wt)),
        ("mx_mm fwd", lambda: mx_mm(x, wt, r)),
        ("torch._grouped_mm fwd", lambda: torch._grouped_mm(x, w3t, offs=offs)),
        ("mx_grouped_mm fwd", lambda: mx_grouped_mm(x, w3t, offs, r)),
        ("torch.mm fwd+bwd", fwd_bwd(lambda: torch.mm(xg, w.t()))),
        ("mx_mm fwd+bwd", fwd_bwd(lambda: mx_mm(xg, w.t(), r))),
        ("torch._grouped_mm fwd+bwd", fwd_bwd(lambda: torch._grouped_mm(xg, w3_t, offs=offs))),
        ("mx_grouped_mm fwd+bwd", fwd_bwd(lambda: mx_grouped_mm(xg, w3_t, offs, r))),
        ("qdq dim0", lambda: qdq(x, -1, recipe=r)),
        ("qdq dim1, offs", lambda: qdq(x, -2, recipe=r, offs=offs)),
        ("qdq_dim0_dim1", lambda: qdq_dim0_dim1(x, recipe=r)),
        ("to_mx dim0", lambda: to_mx(x, -1, recipe=r)),
        ("to_mx dim1", lambda: to_mx(x, 0, recipe=r)),
        ("x.to(float8_e4m3fn)", lambda: x.to(torch.float8_e4m3fn)),
    ]


# ----------------------------------------------------------------------------------------------
# --cuda-route: the C++ operators replaced by CPU stand-ins (this script only; see the docstring)
# ----------------------------------------------------------------------------------------------

# csrc/binding.cpp's TORCH_LIBRARY(mxmoe_cuda, m), the operators mxmoe calls
_STANDIN_SCHEMAS = (
    "quantize_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor)",
    "quantize_dim0_out(Tensor x, int block_size, int mode, Tensor(a!) q, Tensor(b!) s) -> ()",
    "quantize_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor)",
    "quantize_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype) -> (Tensor, Tensor, Tensor, Tensor)",  # noqa: E501
    "dequantize(Tensor q, Tensor s, int block_size, ScalarType out_dtype) -> Tensor",
    "dequantize_out(Tensor q, Tensor s, int block_size, Tensor(a!) out) -> ()",
    "qdq_dim0(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype) -> Tensor",
    "qdq_dim0_out(Tensor x, int block_size, int mode, ScalarType elem_dtype, Tensor(a!) out) -> ()",
    "qdq_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> Tensor",  # noqa: E501
    "qdq_dim0_dim1(Tensor x, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor)",  # noqa: E501
    "swiglu_qdq_dim0_dim1(Tensor g, Tensor u, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor)",  # noqa: E501
    "swiglu_bwd_qdq_dim0_dim1(Tensor dh, Tensor g, Tensor u, int block_size, int mode, ScalarType elem_dtype, ScalarType out_dtype, Tensor? offs=None) -> (Tensor, Tensor, Tensor, Tensor)",  # noqa: E501
    "zero_rows_after(Tensor(a!) out, Tensor offs) -> ()",
)  # fmt: skip
_standin_lib = []  # the torch.library.Library, kept alive


def _install_cuda_standins() -> None:
    """torch.ops.mxmoe_cuda.* as CPU stand-ins (outputs of the right shapes and dtypes, preallocated
    per shape, nothing computed), the "cuda" backend resolvable on CPU tensors, the bf16 grouped
    GEMM as on CUDA (torch._grouped_mm, then the tail-rows operator), offs not read on the host."""
    from mxmoe.formats import SCALE_DTYPE
    from mxmoe.ops import gemm as ops_gemm
    from mxmoe.ops import grouped as ops_grouped
    from mxmoe.ops import tail_rows
    from mxmoe.quant import cuda_cast
    from mxmoe.quant.backends import resolve_kernel

    lib = torch.library.Library("mxmoe_cuda", "DEF")
    _standin_lib.append(lib)
    cache: dict = {}

    def alloc(key, make):
        out = cache.get(key)
        if out is None:
            out = cache[key] = make()
        return out

    def dim0(x, bs, mode, elem):
        s_shape = (*x.shape[:-1], x.shape[-1] // bs)
        return alloc(("d0", x.shape, elem, bs), lambda: (
            torch.empty(x.shape, dtype=elem), torch.empty(s_shape, dtype=SCALE_DTYPE)))

    def dim1(x, bs, mode, elem):
        *lead, R, C = x.shape
        return alloc(("d1", x.shape, elem, bs), lambda: (
            torch.empty((*lead, C, R), dtype=elem), torch.empty((*lead, C, R // bs), dtype=SCALE_DTYPE)))

    def dim0_dim1(x, bs, mode, elem):
        return (*dim0(x, bs, mode, elem), *dim1(x, bs, mode, elem))

    def deq(q, s, bs, out_dtype):
        return alloc(("dq", q.shape, out_dtype), lambda: torch.empty(q.shape, dtype=out_dtype))

    def like(x, out_dtype, n):
        outs = alloc(("like", x.shape, out_dtype, n), lambda: tuple(torch.empty(x.shape, dtype=out_dtype)
                                                                     for _ in range(n)))
        return outs[0] if n == 1 else outs

    impls = {
        "quantize_dim0": dim0,
        "quantize_dim0_out": lambda x, bs, mode, q, s: None,
        "quantize_dim1": dim1,
        "quantize_dim0_dim1": dim0_dim1,
        "dequantize": deq,
        "dequantize_out": lambda q, s, bs, out: None,
        "qdq_dim0": lambda x, bs, mode, elem, od: like(x, od, 1),
        "qdq_dim0_out": lambda x, bs, mode, elem, out: None,
        "qdq_dim1": lambda x, bs, mode, elem, od, offs=None: like(x, od, 1),
        "qdq_dim0_dim1": lambda x, bs, mode, elem, od, offs=None: like(x, od, 2),
        "swiglu_qdq_dim0_dim1": lambda g, u, bs, mode, elem, od, offs=None: like(g, od, 2),
        "swiglu_bwd_qdq_dim0_dim1": lambda dh, g, u, bs, mode, elem, od, offs=None: like(dh, od, 4),
        "zero_rows_after": lambda out, offs: None,
    }
    for schema in _STANDIN_SCHEMAS:
        lib.define(schema)
        name = schema.split("(", 1)[0]
        lib.impl(name, impls[name], "CPU")
    # the backend: resolvable on CPU tensors, its extension "loaded" (the stand-ins above)
    cuda_cast.why_unavailable = lambda device, cast: None
    cuda_cast.ready = lambda device, cast: True
    cuda_cast.ops_loaded = True
    # the bf16 grouped GEMM as on CUDA: torch._grouped_mm, its tail rows zeroed by the operator
    # (tail_rows.zero_rows_after_trusted's CUDA branch, without its out.is_cuda)
    ops_gemm.on_torch_grouped_mm = lambda a, b: a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16

    def zero_rows_after_trusted(out, offs):
        if resolve_kernel("auto", out.device, "dim0") == "cuda":
            return cuda_cast.zero_rows_after(out, offs)
        raise RuntimeError("the cuda stand-ins are not installed")

    tail_rows.zero_rows_after_trusted = zero_rows_after_trusted
    # the GEMMs (aten::mm, aten::_grouped_mm on CPU; what torch.mm, torch._grouped_mm and their
    # backward formulas dispatch to, for the native rows and inside the MX ops alike) as stand-ins too:
    # their outputs preallocated per shape, nothing computed (a CPU's bf16 GEMM would be timed else)
    aten = torch.library.Library("aten", "IMPL")
    _standin_lib.append(aten)

    def mm(a, b):
        M, N = a.shape[0], b.shape[1]
        return alloc(("mm", M, N, a.dtype), lambda: torch.empty(M, N, dtype=a.dtype))

    def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
        dt = a.dtype if out_dtype is None else out_dtype
        shape = (a.shape[0], b.shape[-1]) if b.ndim == 3 else (offs.shape[0], a.shape[0], b.shape[-1])
        return alloc(("gmm", shape, dt), lambda: torch.empty(shape, dtype=dt))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (overriding a previously registered kernel)
        aten.impl("mm", mm, "CPU")
        aten.impl("_grouped_mm", grouped_mm, "CPU")
    # offs live on the device on a GPU: the ops do not read them on the host there
    ops_grouped.check_offsets = lambda *a, **k: None
    ops_gemm.check_offsets = lambda *a, **k: None


def _cuda_cases(M: int, K: int, E: int):
    """The rows of `mxmoe bench overhead` (its inputs: x (M, K), the GEMMs' weights as the modules
    hand them over, w (K, N) = an (N, K) weight transposed, w3 (E, K, N) = (E, N, K) transposed; dy;
    the default recipe, "auto"), gemm_dtype bf16 as the default recipe has on CUDA."""
    from mxmoe.quant import to_mx_dim0_dim1
    from mxmoe.recipe import DEFAULT_RECIPE

    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, dtype=dt, generator=g)
    dy = torch.randn(M, K, dtype=dt, generator=g)
    wl = torch.randn(K, K, dtype=dt, generator=g).requires_grad_()  # (N, K) leaf
    w3l = torch.randn(E, K, K, dtype=dt, generator=g).requires_grad_()  # (E, N, K) leaf
    w, w3 = wl.detach().t(), w3l.detach().transpose(-2, -1)  # (K, N), (E, K, N), column-major
    xg = x.clone().requires_grad_()
    offs = (torch.arange(1, E + 1, dtype=torch.int32) * (M // E)).contiguous()
    r = DEFAULT_RECIPE.replace(gemm_dtype=torch.bfloat16)  # compute_dtype as on CUDA
    rk = DEFAULT_RECIPE
    mx0 = to_mx(x, -1, recipe=rk)
    standin = torch.ops.mxmoe_cuda.quantize_dim0.default
    bs, e4 = rk.block_size, torch.float8_e4m3fn

    def fwd_bwd(f):
        def run():
            f().backward(dy)
            xg.grad = wl.grad = w3l.grad = None

        return run

    return [
        ("x.to(float8_e4m3fn)", lambda: x.to(torch.float8_e4m3fn)),
        ("stand-in op alone", lambda: standin(x, bs, 1, e4)),
        ("to_mx dim0", lambda: to_mx(x, -1, recipe=rk)),
        ("to_mx dim1", lambda: to_mx(x, 0, recipe=rk)),
        ("to_mx_dim0_dim1", lambda: to_mx_dim0_dim1(x, recipe=rk)),
        ("dequantize", lambda: mx0.dequantize(recipe=rk)),
        ("qdq dim0", lambda: qdq(x, -1, recipe=rk)),
        ("qdq dim1", lambda: qdq(x, -2, recipe=rk)),
        ("torch.mm fwd", lambda: torch.mm(x, w)),
        ("mx_mm fwd", lambda: mx_mm(x, w, r)),
        ("torch.mm fwd+bwd", fwd_bwd(lambda: torch.mm(xg, wl.t()))),
        ("mx_mm fwd+bwd", fwd_bwd(lambda: mx_mm(xg, wl.t(), r))),
        ("torch._grouped_mm fwd", lambda: torch._grouped_mm(x, w3, offs=offs)),
        ("mx_grouped_mm fwd", lambda: mx_grouped_mm(x, w3, offs, r)),
        ("torch._grouped_mm fwd+bwd", fwd_bwd(lambda: torch._grouped_mm(xg, w3l.mT, offs=offs))),
        ("mx_grouped_mm fwd+bwd", fwd_bwd(lambda: mx_grouped_mm(xg, w3l.mT, offs, r))),
    ]


def _calls(fn) -> int:
    """Python and builtin function calls made by one call of fn (deterministic, unlike time)."""
    n = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call"):
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def _time(fn, iters: int) -> float:
    """CPU µs per call of this process (steadier than wall time on a shared machine: the timed work
    is single-threaded and never waits), the best of 5 rounds."""
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(iters):
            fn()
        rounds.append((time.process_time() - t0) / iters * 1e6)
    return min(rounds)


def _model_steps(torchtitan02: str):
    """(name, step) of the torchtitan 0.2 debug model, bf16 and mxmoe (see the module docstring)."""
    import copy
    from types import SimpleNamespace

    sys.path.insert(0, torchtitan02)
    import torch.nn.functional as F
    import torchtitan.models.moe.kernels as tt_kernels
    from torchtitan.config import ConfigManager
    from torchtitan.models.deepseek_v3 import get_train_spec
    from torchtitan.protocols.model_converter import build_model_converters

    from mxmoe.nn import experts as nn_experts
    from mxmoe.ops import gemm as ops_gemm
    from mxmoe.ops import tail_rows

    histc = torch.histc  # the router counts int64 indices with torch.histc, which only CUDA has

    def cpu_histc(x, *a, **k):
        return histc(x, *a, **k) if x.is_floating_point() else histc(x.float(), *a, **k).to(x.dtype)

    torch.histc = cpu_histc
    # bf16's token-group padding: its Triton kernel's launch counted, its indices (the same every
    # step: no optimizer step) from torchtitan's CPU version, once per input
    filled = {}

    def fill_indices(counts, *args):
        key = (tuple(counts.tolist()), args[2:])
        if key not in filled:
            filled[key] = tt_kernels.fill_indices_cpu(counts, *args)
        LAUNCHES[0] += 1
        return filled[key]

    tt_kernels.fill_indices_wrapper = fill_indices
    # grouped GEMMs as on CUDA: torch._grouped_mm for bf16 operands, its tail rows zeroed by a launch
    on_grouped = lambda a, b: a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16  # noqa: E731
    ops_gemm.on_torch_grouped_mm = nn_experts.on_torch_grouped_mm = on_grouped
    tail_rows._zero_rows_after_kernel = _NoLaunch()

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    toml = os.path.join(root, "mxmoe/configs/torchtitan/deepseek_v3_debug_0.2.toml")
    mx = ["--mx.mxfp8_dim0_cast_kernel_choice", "triton", "--mx.mxfp8_dim1_cast_kernel_choice", "triton",
          "--mx.gemm_dtype", "bfloat16"]  # fmt: skip
    spec = get_train_spec()
    logging.getLogger().setLevel(logging.ERROR)  # (no tokenizer, no GPU: warnings)
    warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")  # rms_norm under autocast
    out = []
    for name, converters in (("bf16", []), ("mxmoe", ["--model.converters", "mxmoe"])):
        cli = ["--job.config_file", toml, "--training.seq_len", "64", *converters, *mx]
        jc = ConfigManager().parse_args(cli)
        args = copy.deepcopy(spec.model_args[jc.model.flavor])
        args.update_from_config(jc)
        args.dim = args.inter_dim = args.moe_inter_dim = args.kv_lora_rank = 64
        args.n_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim = 2, 32, 32, 32
        args.vocab_size = 256
        args.moe_args.use_grouped_mm = True  # (off without an sm_90 GPU)
        with torch.device("meta"):
            model = spec.model_cls(args)
        build_model_converters(jc, SimpleNamespace(tp=1, ep=1)).convert(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        tokens = torch.randint(0, args.vocab_size, (1, 64))
        labels = torch.randint(0, args.vocab_size, (1, 64))

        def step(model=model, tokens=tokens, labels=labels, params=tuple(model.parameters())):  # noqa: B008
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            for p in params:
                p.grad = None

        out.append((name, step))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--shape", default="64x64", help="MxK (default 64x64)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ops", action="store_true", help="list the aten ops of each row")
    p.add_argument("--profile", help="cProfile the row with this op name")
    p.add_argument("--only", action="append", help="only the rows whose name starts so (repeatable)")
    p.add_argument("--model", action="store_true", help="a training step of the torchtitan 0.2 debug model")
    p.add_argument("--cuda-route", action="store_true",
                   help="the GPU's CUDA route, its C++ operators replaced by CPU stand-ins (docstring)")
    p.add_argument("--torchtitan02", default=".venv/torchtitan-0.2", help="the folder of torchtitan 0.2.2")
    args = p.parse_args()
    torch.set_num_threads(1)
    _stub_triton()
    if args.cuda_route:
        _install_cuda_standins()
        M, K = (int(t) for t in args.shape.split("x"))
        cases = _cuda_cases(M, K, args.groups)
        print(f"torch {torch.__version__}, {M}x{K} bf16, {args.groups} groups, {args.iters} calls x 5; "
              "CUDA route on CPU stand-ins: Python overhead, not kernel time")
    elif args.model:
        cases = _model_steps(os.path.abspath(args.torchtitan02))
        print(f"torch {torch.__version__}, torchtitan 0.2 DeepSeek-V3 debug model (dims 64), 1 x 64 tokens, "
              f"{args.iters} steps x 5")
    else:
        M, K = (int(t) for t in args.shape.split("x"))
        cases = _cases(M, K, args.groups)
        print(f"torch {torch.__version__}, {M}x{K} bf16, {args.groups} groups, {args.iters} calls x 5")
    print(f"{'op':28s} {'us':>8s} {'aten':>6s} {'launches':>9s} {'pycalls':>8s}")
    for name, fn in cases:
        if args.only and not any(name.startswith(o) for o in args.only):
            continue
        fn()
        with _Count() as c:
            LAUNCHES[0] = 0
            fn()
        n_launch = LAUNCHES[0]
        calls = _calls(fn)
        us = _time(fn, args.iters)
        print(f"{name:28s} {us:8.1f} {c.n:6d} {n_launch:9d} {calls:8d}")
        if args.ops:
            print("   ", " ".join(c.names))
        if args.profile == name:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.iters):
                fn()
            pr.disable()
            st = pstats.Stats(pr).sort_stats("tottime")
            st.print_stats(40)
            if not args.cuda_route:
                st.print_callers("jit.py")


if __name__ == "__main__":
    main()
