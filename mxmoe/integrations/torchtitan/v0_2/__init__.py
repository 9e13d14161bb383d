"""mxmoe's adapter for torchtitan 0.2.x (torch >= 2.11): the TOML-era job config.

`--job.custom_config_module mxmoe.integrations.torchtitan --model.converters mxmoe` (or `mx`) with
the options (`mxmoe.MXOptions`) in an `[mx]` section or as `--mx.*` flags: `converter`. Expert
parallelism through mxmoe's exchange: `expert_parallel`. Both spellings of an `[mx]` boolean on
the command line: `spellings`. Built on the shared core
(`mxmoe.integrations.torchtitan.common`) and mxmoe's dispatch seam (`mxmoe.token_dispatch`).
"""

from mxmoe.integrations.torchtitan.v0_2 import config
from mxmoe.integrations.torchtitan.v0_2.converter import MX, JobConfig, MXGroupedExperts, MXMoEConverter
from mxmoe.integrations.torchtitan.v0_2.expert_parallel import MXExpertParallel
from mxmoe.integrations.torchtitan.v0_2.spellings import install as _install_spellings

_install_spellings()  # `--mx.convert_linears=false` as well as `--mx.no-convert-linears`

config.install()  # [mx] errors in a TOML job config name the file and the key

__all__ = ["MX", "JobConfig", "MXExpertParallel", "MXGroupedExperts", "MXMoEConverter"]
