"""Run torchtitan 0.2's trainer (`torchtitan.train.main`) on CPU, one gloo rank; arguments as for
`python -m torchtitan.train`, or several runs one after another in this process, their arguments
separated by `--next-run` (each run's log starts with a line `=== run N ===`). For tests only:
torchtitan 0.2's trainer assumes CUDA, so this process patches what stands in the way (torchtitan
itself stays unchanged on disk):

- the device: torch reports "cpu" as the available device type before torchtitan reads it;
- torch.histc on int64 (the router's token counts), which only CUDA implements: counted as floats;
- the device-memory monitor (CUDA memory statistics): zeros;
- the barrier after step 1 (`set_pg_timeouts`, CUDA device ids): skipped;
- token-group padding (a Triton kernel): torchtitan's own CPU version (`use_cpu=True`);
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

if __name__ == "__main__":
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    import sys

    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer, main

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
    for i, args in enumerate(runs):
        print(f"=== run {i} ===", flush=True)
        sys.argv[1:] = args
        main(Trainer)
