"""The Triton kernels built ahead of time for an H100/H200 (sm_90) on a machine without a GPU:
Triton's compiler with its bundled ptxas and cuobjdump, what each kernel's launch would compile.

The test processes run Triton through its interpreter (which replaces the jit functions), so these
checks run in a process of their own with TRITON_INTERPRET=0: `python -m tests.triton_sm90 OUT.json`
runs every check and writes {check name: "ok" or the failure}; the suite starts it once, with the
session (the `triton_sm90` subprocess job of tests/conftest.py), and each check's test reads its
entry. A check raises AssertionError with what it found.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, aligned=(), **options):
    """fn compiled for sm_90 with `signature` (Triton type strings; constexprs added), the pointer /
    integer arguments named in `aligned` specialized as 16-byte aligned, as a launch with such
    arguments compiles it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    names = fn.arg_names
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(kernel, *flags: str) -> str:
    """Triton's bundled cuobjdump on the kernel's cubin (-res-usage: registers, stack, local memory;
    -sass: the machine code)."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout


def res_usage(kernel) -> dict[str, int]:
    out = cuobjdump(kernel, "-res-usage")
    return {key: int(re.search(key + r":(\d+)", out)[1]) for key in ("REG", "STACK", "LOCAL")}


def global_ops(ptx: str, op: str) -> set[str]:
    """The kinds of global loads or stores (op: 'ld' or 'st') in the PTX, e.g. {'st.global.v4.b32'}."""
    return set(re.findall(op + r"\.global[.\w]*", ptx))


@check
def symm_exchange_kernel() -> None:
    """The symmetric-memory exchange kernel, every specialization its launch makes, with the argument
    types the launch gives it (tests/comm/test_symm.py::test_exchange_kernel_compiles_for_sm90 says
    what is checked)."""
    import torch

    from mxmoe.comm import symm, symm_kernel
    from mxmoe.quant.triton_cast import _spec_args

    # as the launch compiles it: Python ints below 2**31 are int32 arguments, the timeout (ns) is int64
    sig = dict(x_ptr="*i16", y_ptr="*i16", ys_ptr="*u8", meta_ptr="*i64", ctr_ptr="*i32", def_ptr="*i32",
               err_ptr="*i64", epoch="i32", n_store="i32", n_own="i32", n_recv="i32", delay="i32",
               own_xblk="i32", own_yblk="i32", own_nblk="i32", timeout="i64", nprog="i32")
    lines, first = inspect.getsourcelines(symm_kernel._store_item.fn)
    store_item = range(first, first + len(lines))
    SSUB = symm._STORE_SUB_BLOCKS
    F = symm._FAST_BIT_FLAGS
    RB, RF = (symm._RECV_SUB_BLOCKS[t] for t in (torch.bfloat16, torch.float32))
    for bf16, deq, peers, item, ssub, sflag, rsub in (
        (True, True, 1, 2, SSUB, F, RB), (False, True, 3, 2, SSUB, F, RF), (True, False, 1, 1, SSUB, F, RB),
        (False, False, 7, 2, SSUB, F, RF), (True, True, 1, 1, SSUB, F, RB), (True, False, 3, 2, SSUB, F, RB),
        (True, True, 1, 4, SSUB, F, RB), (True, True, 1, 2, 128, F, RB), (False, True, 1, 4, 128, F, RF),
        (True, True, 1, 8, SSUB, F, RB), (True, True, 1, 16, SSUB, F, RB), (True, False, 1, 16, SSUB, F, RB),
        (False, True, 3, 8, 64, F, RF), (True, True, 1, 4, 128, True, RB), (True, True, 3, 1, 64, True, RB),
        (False, True, 1, 8, 128, True, RF), (True, False, 1, 4, 128, True, RB),
        (True, True, 1, 4, 128, False, 128), (True, True, 1, 16, 128, True, 128),
        (True, False, 3, 2, 128, F, 128),
    ):
        xt = "*i16" if bf16 else "*i32"
        s = dict(sig, x_ptr=xt, y_ptr=xt if deq else "*u8")
        stages = symm._STAGES[torch.bfloat16 if bf16 else torch.float32]
        ce = dict(PEERS=peers, NB=symm.TILE_BLOCKS, ITEM=item, SUB=symm._SUB_BLOCKS, SSUB=ssub, RSUB=rsub,
                  STAGES=stages[0], RSTAGES=stages[1], IN_BF16=bf16, DEQUANT=deq, CLOCK=True, SFLAG=sflag,
                  **_spec_args(symm._SPEC, False))
        # torch's allocations are 16-byte aligned: the launch specializes the pointers so
        k = compile_sm90(symm_kernel.exchange_kernel, s, ce, aligned=[n for n, t in s.items() if t[0] == "*"],
                         num_warps=symm._WARPS, maxnreg=symm._MAXNREG)
        what = (bf16, deq, peers, item, ssub, sflag, rsub)
        ptx = k.asm["ptx"]
        for op in ("atom.global.sys.release.exch.b32", "ld.global.sys.acquire.b32", "trap;", "%globaltimer"):
            assert op in ptx, (what, op)
        # the quantize's non-finite blocks: 0x7F bytes selected a word of four elements at a time
        assert "0x7F7F7F7F, 0xB8;" in ptx, what
        usage, sass = res_usage(k), cuobjdump(k, "-sass")
        regs, stack = usage["REG"], usage["STACK"]
        # registers for _PROGS_PER_SM programs of _WARPS warps per SM
        assert regs <= symm._MAXNREG and regs * 32 * symm._WARPS * symm._PROGS_PER_SM <= 65536, (what, regs)
        # Spills: at most a few values that stay the same over the work-item loop (stored once,
        # reloaded once a work item), none in a loop inside it (the register-tile loops, the spins):
        # loops are the spans of backward branches.
        code = [(int(a, 16), i) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
        loops = [(int(m[1], 16), a) for a, i in code for m in [re.search(r"\bBRA\s+.*?(0x[0-9a-f]+)", i)]
                 if m and int(m[1], 16) < a]
        assert len(loops) >= 3, (what, "the work-item and register-tile loops not found", loops)
        deep = [(hex(a), i) for a, i in code
                if re.search(r"\b(LDL|STL)\b", i) and sum(lo <= a <= hi for lo, hi in loops) > 1]
        # receive register tiles of 128 blocks (bf16) spill 48 bytes, also only outside the loops
        assert stack <= (48 if rsub == 128 else 32) and not deep, (what, "spills", stack, deep)
        # one system-scope fence per store item (its flags' release, from one warp), vector stores
        # (8 elements a thread), and a work item's register tiles loaded STAGES - 1 ahead of their
        # use by asynchronous vector copies into shared memory (cp.async)
        assert sass.count("MEMBAR.ALL.SYS") == 1 and "ATOMG.E.EXCH.STRONG.SYS" in sass, what
        assert re.search(r"STG\.E\.(64|128) ", sass), what
        assert re.search(r"LDGSTS\.E\.BYPASS\.128 ", sass), what
        assert re.search(r"LDGSTS\.E\.(64|BYPASS\.128) ", sass), what
        waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
        assert max(waits) >= max(stages) - 2, (what, waits)  # copies still in flight while one is used
        # shared memory of the programs of an SM (228 KiB an SM on sm_90, 1 KiB of it per program
        # reserved)
        assert (k.metadata.shared + 1024) * symm._PROGS_PER_SM <= 228 * 1024, (what, k.metadata.shared)
        # The store item's stores into the peer's slot (PTX lines of _store_item): the elements as
        # one vector a thread, SSUB * 32 / (32 * warps) bytes (a warp's 32 cover consecutive bytes),
        # the scales as int32 words of four blocks; nothing narrower (single-byte scale stores were
        # what it did before).
        files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M))
        ops, loc = collections.Counter(), None
        for line in ptx.splitlines():
            line = line.strip()
            m = re.match(r"\.loc\s+(\d+)\s+(\d+)", line)
            if m:
                loc = (files.get(m[1], ""), int(m[2]))
                continue
            m = re.match(r"(?:@!?%p\d+\s+)?(st\.global\S*)\s", line)
            if m and loc and loc[0].endswith("symm_kernel.py") and loc[1] in store_item:
                ops[m[1]] += 1
        elem = {8: "st.global.v2.b32", 16: "st.global.v4.b32"}[ssub * 32 // (32 * symm._WARPS)]
        assert set(ops) == {elem, "st.global.b32"}, (what, dict(ops))


@check
def exchange_helper_kernels() -> None:
    """The standalone kernels that share the exchange kernel's tile helpers build."""
    from mxmoe.comm import kernels as kk

    compile_sm90(kk._qdq_kernel,
                 dict(x_ptr="*i16", out_ptr="*i16", n_blocks="i64", rceil_c="fp32", T127="i32", T126="i32"),
                 dict(NB=64, IN_BF16=True, FORCE_SLOW=False, SATFINITE=True))
    compile_sm90(kk._dequant_e4m3_kernel, dict(q_ptr="*u8", s_ptr="*u8", out_ptr="*i16", n="i64"),
                 dict(BLOCK=4096, BS=32, OUT_BF16=True))


@check
def qdq_rows_kernel() -> None:
    """The rows kernel, its variants with the register counts measured when each was tuned
    (tests/quant/test_qdq.py::test_qdq_rows_kernel_compiles_for_sm90 says what is checked)."""
    import torch

    from mxmoe.quant.checks import spec_of
    from mxmoe.quant.triton_cast import _spec_args
    from mxmoe.quant.triton_qdq import _ROWS_ITERS, _ROWS_WARPS, _rows_tile, qdq_rows_kernel

    spec = spec_of(32, "rceil", torch.float8_e4m3fn)
    # (DIM0, DIM1, GROUPED, MATRICES, IN_BF16, most registers)
    for dim0, dim1, grouped, matrices, in_bf16, max_regs in (
        (True, False, False, False, True, 96), (False, True, False, False, True, 96),
        (True, True, False, False, True, 149), (True, True, True, False, True, 150),
        (False, True, False, True, True, 128), (False, True, False, False, False, 112),
    ):
        sig = {"x_ptr": "*bf16" if in_bf16 else "*fp32", "y0_ptr": "*bf16", "y1_ptr": "*bf16",
               "offs_ptr": "*i32", "T": "i32", "R": "i32", "C": "i32", "E": "i32"}
        const = dict(BS=32, N_ITER=_ROWS_ITERS, EP=128, I64=False, GROUPED=grouped, MATRICES=matrices,
                     IN_BF16=in_bf16, OUT_BF16=True, DIM0=dim0, DIM1=dim1,
                     **_rows_tile(32, 2 if in_bf16 else 4), **_spec_args(spec, False))
        k = compile_sm90(qdq_rows_kernel, sig, const, aligned=("x_ptr", "y0_ptr", "y1_ptr", "offs_ptr", "C"),
                         num_warps=_ROWS_WARPS)
        ptx = k.asm["ptx"]
        what = (dim0, dim1, grouped, matrices, in_bf16)
        # x and the outputs move in 16-byte vectors; the only scalar loads are offs entries
        assert global_ops(ptx, "st") == {"st.global.v4.b32"}, what
        assert global_ops(ptx, "ld") <= {"ld.global.v4.b32", "ld.global.b32"}, what
        assert ("ld.global.b32" in ptx) == grouped, what
        usage = res_usage(k)
        assert usage["STACK"] == 0 and usage["LOCAL"] == 0 and usage["REG"] <= max_regs, (what, usage)


@check
def zero_rows_after_kernel() -> None:
    """bf16 and fp32 outputs: 16-byte stores only."""
    from mxmoe.ops.tail_rows import _BLOCK_N, _BLOCK_R, _zero_rows_after_kernel

    for dt in ("bf16", "fp32"):
        sig = {"out_ptr": f"*{dt}", "offs_ptr": "*i32", "last": "i32", "T": "i32", "N": "i32",
               "stride": "i32"}
        k = compile_sm90(_zero_rows_after_kernel, sig, {"BLOCK_R": _BLOCK_R, "BLOCK_N": _BLOCK_N},
                         aligned=("out_ptr", "N", "stride"), num_warps=4)
        assert global_ops(k.asm["ptx"], "st") == {"st.global.v4.b32"}, dt


@check
def qdq_decomposes_into_kernel_launches() -> None:
    """`mxmoe::qdq` traced as AOTAutograd does, on fake CUDA tensors with compiled Triton kernels
    (interpreted kernels are never decomposed): the Triton kernel's calls become launches of the rows
    kernel (the 2D grouped call and the 3D per-matrix one), the torch kernel's stays the op."""
    import logging

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mxmoe.quant.qdq import qdq_op
    from tests.quant.test_qdq_compile import ARGS, _launched_kernels, _opaque_calls, _trace

    # without a GPU driver torch cannot analyze which arguments a kernel writes and says so at
    # length (then assumes every argument is written: the graph is still the decomposed one)
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)

    def f(x, w, offs):
        a, b = qdq_op(x, *ARGS, True, True, "triton", offs)  # 2D, grouped, both directions
        (c,) = qdq_op(w, *ARGS, False, True, "triton")  # 3D weights along N, per matrix (short last block)
        (d,) = qdq_op(x, *ARGS, True, False, "torch")  # the torch kernel: stays the op
        return a, b, c, d

    with FakeTensorMode():
        x = torch.empty(256, 128, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 48, 128, dtype=torch.bfloat16, device="cuda")
        offs = torch.empty(3, dtype=torch.int32, device="cuda")
        gm = _trace(f, x, w, offs)
    got = (_launched_kernels(gm), _opaque_calls(gm))
    assert got == (["qdq_rows_kernel", "qdq_rows_kernel"], 1), got


def unavailable() -> str | None:
    """Why these checks cannot run here (no Triton, or a Triton without its CUDA backend), or None."""
    try:
        import triton
    except ImportError:
        return "could not import triton"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return f"triton {triton.__version__} has no CUDA backend here"
    return None


def main(out: str) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run with TRITON_INTERPRET=0: the interpreter replaces the jit functions")
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=6)[-4000:]
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
