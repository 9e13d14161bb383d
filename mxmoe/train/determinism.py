"""`--debug.deterministic=true`: bit-reproducible runs.

Two runs of the same config and seed, on the same GPU model and the same software (torch, CUDA,
NCCL, Triton, driver), one GPU or expert parallel, give the same loss bits at every step.

`seed_everything` runs in every run (it is free): Python's `random`, NumPy (when importable) and
torch on every device, from `debug.seed`. The data order has its own seeded generator
(`mxmoe.train.data.ShardedSampler`), and the validation windows are fixed (`eval_windows`).

`deterministic_mode(True)`, around the whole run, adds what costs time:
  - CUBLAS_WORKSPACE_CONFIG=:4096:8 when the variable is unset: torch refuses cuBLAS GEMMs in this
    mode without one of the reproducible settings. Torch checks it once, at the process's first
    cuBLAS GEMM, so the trainer enters the mode in its own process before any CUDA work; a value the
    user set is kept (torch raises if it is not one of the reproducible ones). What makes the GEMMs
    reproducible is torch's own workspace for each cuBLAS handle and stream (cuBLAS's documented
    condition); the variable sets its size. But torch (2.11's `at::cuda::getChosenWorkspaceSize`)
    parses the variable again, with a `std::regex`, at every cuBLAS GEMM while it is set: in a
    profile of moe_1b (per-block compile, one H100) each `aten::mm` took 53-76 µs more host time in
    this mode than without it, 16-22 ms a step, at the same GPU time, and no other op's host time
    rose by 1 ms a step. So where torch's default workspace is the same size as this
    setting's (32 MiB on sm90: H100, H200), the mode runs that first GEMM itself with the variable
    set and then removes the variable it set (`settle_cublas_config`, called by the trainer once its
    device is set): the check has passed, every GEMM gets the same workspace as with the variable,
    and none parses it. On other GPUs, and a value the user set, the variable stays.
  - `torch.use_deterministic_algorithms(True)`, warn_only=False: ops with a deterministic variant
    use it (index_add, scatter_add, index_put with accumulate, index_copy, ... on CUDA) and an op that
    has none raises a RuntimeError naming itself, instead of the run quietly differing;
    `torch.utils.deterministic.fill_uninitialized_memory` is turned off: with it on (torch's
    default) every `torch.empty` on the device is first filled with NaN, one more write of every
    buffer the step allocates (each cast's outputs included) and one more launch each. No kernel
    of the step reads memory it did not write: mxmoe's cast kernels are tested with poisoned outputs
    (every element written), and two deterministic runs giving the same bits at every step is what
    the mode promises and its tests check.
  - cuDNN: deterministic=True, benchmark=False.
  - Inductor's deterministic mode (`torch._inductor.config.deterministic`; recent torch turns it on
    with use_deterministic_algorithms, set here for every supported version): no on-device
    benchmarking that changes numerics (reduction configs, GEMM template autotuning, matmul
    padding). What Inductor does not generate itself it leaves to the aten ops, which follow
    use_deterministic_algorithms; its scatter/index_put lowerings fall back to them in this mode.
All of it is restored on exit (runs in one process, such as tests, do not leak it).

Deterministic by construction, in every run:
  - the MoE token path (`mxmoe.models.routing.routed_experts`): tokens reach the experts
    and come back by gathers whose backward is the gather back (no index_add, which this mode would
    run as a sort and an ordered scatter) and each token's top-k rows, and their gradients, are
    summed by a reduction in a fixed order; the per-expert
    counts are int64 scatter-adds, and integer sums are exact in any order;
  - the all-to-alls (`mxmoe.comm`): every received row lands at an offset fixed by the splits, so
    the order in which pieces arrive (side streams, chunks) cannot change a bit; nothing is summed;
  - the MX cast kernels (`mxmoe/quant/csrc/*.cu`, `mxmoe/quant/triton_cast.py`,
    `mxmoe/quant/triton_qdq.py`, `mxmoe/comm/kernels.py`) have no atomics: each program computes and
    writes its own blocks. The symmetric-memory exchange (`mxmoe/comm/symm_kernel.py`) uses atomics
    only as work tickets and ready flags, never on data: which program moves a tile varies, the
    bytes written do not;
  - the gradient reductions over ranks (NCCL all-reduce / reduce-scatter, gloo on CPU) are
    deterministic for a fixed world size, topology and library version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator

import torch

log = logging.getLogger("mxmoe.train")

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""The cuBLAS workspace setting that makes its GEMMs reproducible (the larger of CUDA's two)."""


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator (if NumPy is installed) and torch (CPU and
    every CUDA device) with `seed`."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)  # NumPy accepts 0 <= seed < 2**32
    torch.manual_seed(seed)  # also seeds every CUDA device


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True) -> Iterator[None]:
    """Within the block: deterministic algorithms everywhere (see the module docstring); a no-op
    when `enabled` is False. Restores torch's previous settings on exit."""
    global _cublas_set_here
    if not enabled:
        yield
        return
    cublas_set_here = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    if cublas_set_here:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    import torch._inductor.config as inductor_config

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        getattr(inductor_config, "deterministic", None),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if saved[4] is not None:  # the flag exists in every torch mxmoe supports; checked all the same
        inductor_config.deterministic = True
    _cublas_set_here = cublas_set_here
    log.info(
        "deterministic mode: torch.use_deterministic_algorithms(True) (no NaN fill of new buffers), "
        "cuDNN deterministic, Inductor deterministic, CUBLAS_WORKSPACE_CONFIG=%s",
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
    )
    try:
        yield
    finally:
        _cublas_set_here = False
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[5]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        if saved[4] is not None:
            inductor_config.deterministic = saved[4]


_cublas_set_here = False
"""Whether the active `deterministic_mode` set CUBLAS_WORKSPACE_CONFIG (not the user)."""


def settle_cublas_config(device: torch.device) -> bool:
    """Within `deterministic_mode`, once the run's device is set and before its first GEMM: where
    the mode set CUBLAS_WORKSPACE_CONFIG and torch's default cuBLAS workspace on `device` has the
    size it sets (8 x 4096 KiB = 32 MiB: sm90, i.e. H100 and H200), run one cuBLAS GEMM on `device`
    (torch's check of the variable, once a process; it raises there if a GEMM ran before without
    it) and remove the variable, so that no GEMM parses it again (module docstring). Returns
    whether it did; without CUDA, on ROCm, on other GPUs or with the user's value, a no-op."""
    global _cublas_set_here
    if not (_cublas_set_here and torch.are_deterministic_algorithms_enabled()):
        return False
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != CUBLAS_WORKSPACE_CONFIG:
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    _first_cublas_gemm(device)
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]
    _cublas_set_here = False
    log.info(
        "deterministic mode: CUBLAS_WORKSPACE_CONFIG=%s passed torch's check and is removed: torch's "
        "default workspace on %s is the same size, and none of the GEMMs parses it again",
        CUBLAS_WORKSPACE_CONFIG, device,
    )
    return True


def _first_cublas_gemm(device: torch.device) -> None:
    a = torch.ones(8, 8, device=device)
    torch.mm(a, a)


__all__ = ["CUBLAS_WORKSPACE_CONFIG", "deterministic_mode", "seed_everything", "settle_cublas_config"]
