"""torch.profiler over training steps (`--profiling.enable_profiling`, torchtitan's flag names).

Every `profile_freq` steps the last `profiler_active` steps are recorded (the step before them warms
the profiler up); each recording writes, per rank, a Chrome trace `rank{R}_step{S}.json` (open in
chrome://tracing or https://ui.perfetto.dev) and `rank{R}_step{S}.txt`, the operator table sorted by
device time on CUDA (CPU time on CPU). S is the last recorded step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from mxmoe.train.config import Profiling


def check(cfg: Profiling) -> None:
    """ValueError naming the setting if the profiling section is inconsistent."""
    if not cfg.enable_profiling:
        return
    if cfg.profile_freq < 2:
        raise ValueError(f"profiling.profile_freq={cfg.profile_freq}: expected >= 2")
    if not 1 <= cfg.profiler_active < cfg.profile_freq:
        raise ValueError(
            f"profiling.profiler_active={cfg.profiler_active}: expected 1 .. profile_freq - 1 "
            f"(= {cfg.profile_freq - 1})"
        )
    if cfg.profile_repeat < 0:
        raise ValueError(f"profiling.profile_repeat={cfg.profile_repeat}: expected >= 0 (0 = no limit)")


def check_folder(cfg: Profiling, dump_folder: str) -> None:
    """With profiling on: ValueError naming profiling.save_traces_folder unless its folder can be
    created and written (checked at start, not at the first trace)."""
    if not cfg.enable_profiling:
        return
    import tempfile

    folder = traces_folder(cfg, dump_folder)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(
            f"profiling.save_traces_folder={cfg.save_traces_folder!r}: cannot write traces in {folder!r} "
            f"({e.strerror or e}); give a writable folder"
        ) from None


def traces_folder(cfg: Profiling, dump_folder: str) -> str:
    return cfg.save_traces_folder if os.path.isabs(cfg.save_traces_folder) else os.path.join(
        dump_folder, cfg.save_traces_folder
    )


@contextlib.contextmanager
def step_profiler(cfg: Profiling, dump_folder: str, rank: int, device: torch.device, first_step: int):
    """Context yielding `step()`, to call after every training step; a no-op when disabled.
    `first_step` is the number of the first step run under it (resumed runs start later)."""
    if not cfg.enable_profiling:
        yield lambda: None
        return
    folder = traces_folder(cfg, dump_folder)
    os.makedirs(folder, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    done = [first_step - 1]  # the last finished step, for file names

    def on_ready(prof) -> None:
        stem = os.path.join(folder, f"rank{rank}_step{done[0]:08d}")
        prof.export_chrome_trace(stem + ".json")
        with open(stem + ".txt", "w") as fh:
            fh.write(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=80))
        if rank == 0:
            logging.getLogger("mxmoe.train").info("profiler: wrote %s.json and .txt", stem)

    active = cfg.profiler_active
    sched = schedule(
        wait=cfg.profile_freq - active - 1, warmup=1, active=active, repeat=cfg.profile_repeat
    )
    with profile(activities=activities, schedule=sched, on_trace_ready=on_ready, record_shapes=True) as prof:

        def step() -> None:
            done[0] += 1
            prof.step()

        yield step


# Kernel names -> what they do, first match wins (attention before GEMMs: cuDNN's attention kernels
# name sm90 and wgmma; GEMMs before casts: an MX GEMM kernel's name may have "mx").
KERNEL_CATEGORIES = (
    ("attention", r"flash|fmha|attn|attention|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul|_mm_|sm90_"),
    ("mx cast / qdq", r"qdq|dim0|dim1|dequant|quant|_mx_|e8m0"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy / index / pad", r"copy|index|gather|scatter|\bcat\b|catarray|fill|memset|memcpy|zero|pad|sort"),
    ("inductor fused", r"^triton_"),
    ("other", r""),
)


_PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in KERNEL_CATEGORIES]


def kernel_category(kernel_name: str) -> str:
    """The `KERNEL_CATEGORIES` name of a GPU kernel's name."""
    return next(name for name, p in _PATTERNS if p.search(kernel_name))


def kernel_breakdown(prof) -> dict[str, float]:
    """GPU time in ms per category of kernel (`KERNEL_CATEGORIES`) over everything `prof` recorded
    (kernels and copies; not the annotations that span them);
    "total" is their sum (the GPU's busy time when kernels do not overlap)."""
    from torch.autograd import DeviceType

    out = {name: 0.0 for name, _ in KERNEL_CATEGORIES}
    for evt in prof.key_averages():
        if evt.device_type == DeviceType.CUDA and not evt.is_user_annotation:
            out[kernel_category(evt.key)] += evt.self_device_time_total / 1e3
    out["total"] = sum(out.values())
    return out


# The MX cast operators (eager: the profiler ranges of `mxmoe.quant`; compiled: the custom ops and
# the C++ operators inductor calls), whose kernels `cast_breakdown` sorts by what they cast.
_CAST_OP = re.compile(r"^mxmoe(_cuda)?::(qdq|quantize|dequantize|swiglu|zero_rows)")


def cast_breakdown(prof, weight_shapes: set[tuple[int, ...]], forward_thread: int) -> dict[str, float]:
    """GPU ms of the MX cast operators recorded by `prof` (record_shapes=True), by what each casts:
    "weights" (its input has a parameter's shape), "activations" (run on `forward_thread`, the
    thread that ran the forward), "gradients" (run elsewhere: autograd's backward thread), and the
    SwiGLU kernels with their casts fused ("swiglu+qdq fwd" / "swiglu+qdq bwd"); each also split by
    operator ("weights: mxmoe_cuda::qdq_dim1"). Only the outermost cast operator of a nest counts.
    CUDA graph replays record no operators: profile an ungraphed mode for this split."""
    out: dict[str, float] = {}

    def outer(evt) -> bool:
        p = evt.cpu_parent
        while p is not None:
            if _CAST_OP.search(p.name):
                return False
            p = p.cpu_parent
        return True

    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CPU or not _CAST_OP.search(evt.name):
            continue
        if not outer(evt):
            continue
        ms = evt.device_time_total / 1e3
        shaped = evt  # an eager profiler range has no shapes: the first operator under it has
        while not shaped.input_shapes and shaped.cpu_children:
            shaped = shaped.cpu_children[0]
        if "swiglu" in evt.name:
            role = "swiglu+qdq bwd" if "bwd" in evt.name else "swiglu+qdq fwd"
        elif shaped.input_shapes and tuple(shaped.input_shapes[0]) in weight_shapes:
            role = "weights"
        elif evt.thread == forward_thread:
            role = "activations"
        else:
            role = "gradients"
        out[role] = out.get(role, 0.0) + ms
        key = f"{role}: {evt.name}"
        out[key] = out.get(key, 0.0) + ms
    return dict(sorted(out.items(), key=lambda kv: (":" in kv[0], kv[0])))
