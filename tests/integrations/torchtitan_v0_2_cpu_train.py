"""Run torchtitan 0.2's trainer (`torchtitan.train.main`) on CPU as one gloo rank (RANK / WORLD_SIZE
from the environment: one process per rank; default one rank); arguments as for
`python -m torchtitan.train`, or several runs one after another in this process, their arguments
separated by `--next-run` (each run's log starts with a line `=== run N ===`, and each step's loss
and gradient norm are also printed at full precision: `mxmoe-test step N loss X grad_norm Y`).
Per run, two test options:
`--mxmoe.test_transport NAME` makes "auto" take a test transport of tests/comm/transports_for_tests.py
(e.g. rounded_bf16), and `--mxmoe.exchange_log PATH` writes what the exchange handed to the
collective (tests/comm/transports_for_tests.ExchangeLog) to PATH.rank<RANK> as JSON. Run i of several
ranks rendezvouses on the i-th port of MXMOE_TEST_PORTS. For tests only:
torchtitan 0.2's trainer assumes CUDA, so this process patches what stands in the way (torchtitan
itself stays unchanged on disk):

- the device: torch reports "cpu" as the available device type before torchtitan reads it;
- torch.histc on int64 (the router's token counts), which only CUDA implements: counted as floats;
- the device-memory monitor (CUDA memory statistics): zeros;
- the barrier after step 1 (`set_pg_timeouts`, CUDA device ids): skipped;
- token-group padding (a Triton kernel): torchtitan's own CPU version (`use_cpu=True`);
- FSDP's gradient division (ReduceOp.PREMUL_SUM, which gloo lacks): a sum, then the division;
- the command line its config manager reads: each run's arguments.
"""

import functools
import os

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"
_histc = torch.histc


def _cpu_histc(x, *args, **kwargs):
    if x.is_floating_point():
        return _histc(x, *args, **kwargs)
    return _histc(x.float(), *args, **kwargs).to(x.dtype)


torch.histc = _cpu_histc

import torchtitan.components.metrics as metrics  # noqa: E402
import torchtitan.distributed.utils as dist_utils  # noqa: E402
import torchtitan.models.moe.utils as moe_utils  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402


class _CPUMemoryMonitor:
    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.device_name = "cpu"
        self.device_capacity = 1 << 30
        self.device_capacity_gib = 1.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


metrics.DeviceMemoryMonitor = _CPUMemoryMonitor
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)
_set_divide_factor = FSDPModule.set_gradient_divide_factor


def _divide_after_a_sum(self, factor: float) -> None:
    _set_divide_factor(self, factor)
    self.set_force_sum_reduction_for_comms(True)


FSDPModule.set_gradient_divide_factor = _divide_after_a_sum

_log_metrics = metrics.MetricsProcessor.log


def _log_with_full_loss(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
    line = f"mxmoe-test step {step} loss {float(global_avg_loss)!r} grad_norm {float(grad_norm)!r}"
    print(line, flush=True)
    return _log_metrics(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)


metrics.MetricsProcessor.log = _log_with_full_loss


def _pop(args: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` in args (removed), or None."""
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1]
    del args[i : i + 2]
    return value


if __name__ == "__main__":
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    import contextlib
    import json
    import sys
    from pathlib import Path

    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer, main

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comm"))
    import transports_for_tests as doubles

    # its default arguments are sys.argv[1:] as it was at import: each run's own instead
    parse_args = ConfigManager.parse_args
    ConfigManager.parse_args = lambda self, args=None: parse_args(
        self, sys.argv[1:] if args is None else args
    )

    runs, args = [], []
    for arg in sys.argv[1:] + ["--next-run"]:
        if arg == "--next-run":
            runs.append(args)
            args = []
        else:
            args.append(arg)
    # a rendezvous port per run (MXMOE_TEST_PORTS, comma-separated), so that a rank starting the
    # next run never joins the previous run's store, which its peer may not have closed yet
    ports = os.environ.get("MXMOE_TEST_PORTS", "").split(",")
    for i, args in enumerate(runs):
        if i < len(ports) and ports[i]:
            os.environ["MASTER_PORT"] = ports[i]
        transport, log_path = _pop(args, "--mxmoe.test_transport"), _pop(args, "--mxmoe.exchange_log")
        doubles.activate(*([transport] if transport else []))
        print(f"=== run {i} ===", flush=True)
        sys.argv[1:] = args
        with doubles.ExchangeLog() if log_path else contextlib.nullcontext() as log:
            main(Trainer)
        if log_path:
            calls = [[str(dtype), list(shape)] for dtype, shape in log.calls]
            Path(f"{log_path}.rank{os.environ['RANK']}").write_text(json.dumps(calls))
