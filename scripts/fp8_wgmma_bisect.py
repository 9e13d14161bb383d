"""Which launch of the fp8 Gluon kernel (mxmoe/ops/fp8_wgmma.py) traps on an sm_90 GPU: every launch
the GPU tests in tests/ops/test_fp8_gemm.py make directly, plus two probes of the diagnosed cause,
each alone in a fresh process with CUDA_LAUNCH_BLOCKING=1 (a trap is sticky: it would fail every
later launch of the same process). Temporary: delete once `pytest -m gpu tests/ops/test_fp8_gemm.py`
passes.

The diagnosed cause (fixed in mxmoe/ops/fp8_wgmma.py): a grouped-rows tile loaded its A-scale tile
(fp32, rows innermost) by TMA at the group's first row; TMA needs that innermost coordinate 16-byte
aligned, so a group starting at a row not a multiple of 4 trapped ("an illegal instruction was
encountered"). The probes: `rows/starts_mod4` (every group starts at a multiple of 4 rows) passes
with the old kernel; `rows/start_301` (one group starts at row 301) traps with it.

    python scripts/fp8_wgmma_bisect.py                          # the package's kernel
    python scripts/fp8_wgmma_bisect.py --kernel-file OLD.py     # another fp8_wgmma.py, e.g. the
        # pre-fix one: git show 3564a8f:mxmoe/ops/fp8_wgmma.py > OLD.py

Prints one line per launch: name, config (0-2 the single-partition kernel's, 3-4 the
warp-specialized one's), OK (max error / bound), the error, or HANG; a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import torch

# name -> (kind, shape args, config indices into CONFIGS), the GPU tests' launches in file order
LAUNCHES = {
    "test_gpu_dense[512]": ("dense", (512, 768, 1024), [0, 3, 4]),
    "test_gpu_dense[1000]": ("dense", (1000, 300, 4096), [0, 3, 4]),
    "test_gpu_exact_and_adversarial/exact": ("dense", (300, 264, 2048), [0, 3, 4]),
    "test_gpu_exact_and_adversarial/adv": ("dense", (256, 320, 1024), [0, 3, 4]),
    "test_gpu_grouped/rows": ("rows", ([0, 300, 1, 0, 555, 128, 0, 40], 17, 256, 512), [0, 3, 4]),
    "test_gpu_grouped/k": ("k", ([0, 320, 32, 0, 640, 96], 200, 136), [0, 3, 4]),
    "test_gpu_scale_byte_extremes": ("dense", (4, 4, 64), [0, 3, 4]),
    "test_gpu_wgmma_edges_and_tiles/dense": ("dense", (333, 250, 1056), [0, 1, 2, 3, 4]),
    "test_gpu_wgmma_edges_and_tiles/rows": ("rows", ([0, 130, 1, 0, 70, 128, 0], 9, 250, 1056),
                                            [0, 1, 2, 3, 4]),
    "test_gpu_wgmma_edges_and_tiles/k": ("k", ([0, 160, 32, 0, 416, 96, 224], 200, 136), [0, 1, 2, 3, 4]),
    "test_gpu_wgmma_persistent_many_tiles/dense": ("dense", (2048, 2304, 256), [0, 1, 2, 3, 4]),
    "test_gpu_wgmma_persistent_many_tiles/rows": ("rows", ([700, 0, 1, 1400, 0, 333, 900, 64], 40, 1024, 256),
                                                  [0, 1, 2, 3, 4]),
    "rows/starts_mod4": ("rows", ([0, 300, 4, 0, 552, 128, 0, 40], 17, 256, 512), [0, 1, 2, 3, 4]),
    "rows/start_301": ("rows", ([301, 723], 17, 256, 512), [0, 1, 2, 3, 4]),
}


def load_kernel_module(path: str | None):
    if path is None:
        from mxmoe.ops import fp8_wgmma

        return fp8_wgmma
    spec = importlib.util.spec_from_file_location("fp8_wgmma_under_test", os.path.abspath(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def configs(mod):
    """0-2: the single-partition kernel's configs; 3-4 (a module that has it): the warp-specialized
    kernel's (tests/ops/test_fp8_gemm.py WS_CONFIGS)."""
    single = [mod.WgmmaConfig(), mod.WgmmaConfig(128, 128, 256, 3, 8, persistent=True),
              mod.WgmmaConfig(128, 64, 128, 3, 4, persistent=True)]
    if not hasattr(mod, "_fp8_ws_kernel"):
        return single
    return single + [mod.WgmmaConfig(128, 128, 128, 4, 8, persistent=True, warp_specialized=True),
                     mod.WgmmaConfig(128, 64, 256, 3, 8, persistent=True, warp_specialized=True)]


def operand(rows, k, gen):
    """Random finite e4m3 (K innermost) and e8m0 scales 2^-17..2^12, on the GPU."""
    q = torch.randint(-448, 449, (rows, k), generator=gen).float().to(torch.float8_e4m3fn)
    s = torch.randint(110, 140, (rows, k // 32), generator=gen).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q.cuda(), s.cuda()


def dq64(q, s):
    f = torch.exp2(s.view(torch.uint8).cpu().double() - 127)
    return q.cpu().double() * torch.repeat_interleave(f, 32, dim=-1)


def run_one(name: str, cfg_index: int, kernel_file: str | None) -> None:
    mod = load_kernel_module(kernel_file)
    cfg = configs(mod)[cfg_index]
    kind, args, _ = LAUNCHES[name]
    gen = torch.Generator().manual_seed(0)
    if kind == "dense":
        M, N, K = args
        aq, as_ = operand(M, K, gen)
        bq, bs = operand(N, K, gen)
        offs, out = None, torch.empty(M, N, device="cuda")
        A, B = dq64(aq, as_), dq64(bq, bs)
        ref, mag = A @ B.t(), A.abs() @ B.abs().t()
    elif kind == "rows":
        counts, extra, N, K = args
        E, T = len(counts), sum(counts) + extra
        aq, as_ = operand(T, K, gen)
        bq, bs = operand(E * N, K, gen)
        ends = torch.tensor(counts).cumsum(0).tolist()
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        bq, bs = bq.view(E, N, K), bs.view(E, N, K // 32)
        out = torch.empty(T, N, device="cuda")
        A, B = dq64(aq, as_), dq64(bq, bs)
        ref, mag = torch.zeros(T, N, dtype=torch.float64), torch.zeros(T, N, dtype=torch.float64)
        lo = 0
        for e, hi in enumerate(ends):
            ref[lo:hi], mag[lo:hi] = A[lo:hi] @ B[e].t(), A[lo:hi].abs() @ B[e].abs().t()
            lo = hi
    else:
        kc, M, N = args
        T = max(32, sum(kc))
        aq, as_ = operand(M, T, gen)
        bq, bs = operand(N, T, gen)
        ends = torch.tensor(kc).cumsum(0).tolist()
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        out = torch.empty(len(kc), M, N, device="cuda")
        A, B = dq64(aq, as_), dq64(bq, bs)
        ref = torch.zeros(len(kc), M, N, dtype=torch.float64)
        mag = torch.zeros_like(ref)
        lo = 0
        for e, hi in enumerate(ends):
            ref[e], mag[e] = A[:, lo:hi] @ B[:, lo:hi].t(), A[:, lo:hi].abs() @ B[:, lo:hi].abs().t()
            lo = hi
    mod.launch(aq, as_, bq, bs, offs, out, cfg)
    torch.cuda.synchronize()
    err = (out.cpu().double() - ref).abs()
    bound = mag * 2.0**-7 + 2.0**-120  # the GPU tests' bound (the MMA's adder; fp32 output)
    worst = (err / bound).max().item()
    print(f"{'OK' if worst <= 1 else 'WRONG'} max err/bound {worst:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernel-file", help="an fp8_wgmma.py to load instead of the package's")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--cfg", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        run_one(a.one, a.cfg, a.kernel_file)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("needs an sm_90 GPU")
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    extra = ["--kernel-file", a.kernel_file] if a.kernel_file else []
    n_cfgs = len(configs(load_kernel_module(a.kernel_file)))
    for name, (_, _, cfgs) in LAUNCHES.items():
        for i in (i for i in cfgs if i < n_cfgs):
            try:
                r = subprocess.run([sys.executable, __file__, "--one", name, "--cfg", str(i), *extra],
                                   env=env, capture_output=True, text=True, timeout=180)
            except subprocess.TimeoutExpired:  # a kernel that never finishes (an mbarrier hang)
                print(f"{name:45s} cfg{i}  HANG (no result in 180 s)", flush=True)
                continue
            lines = (r.stdout + r.stderr).strip().splitlines()
            errors = [ln for ln in lines if "Error" in ln or "error" in ln]
            what = lines[-1] if r.returncode == 0 and lines else (errors or [f"rc={r.returncode}"])[-1]
            print(f"{name:45s} cfg{i}  {what[:150]}", flush=True)


if __name__ == "__main__":
    main()
