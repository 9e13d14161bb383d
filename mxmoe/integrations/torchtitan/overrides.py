"""Moved to `mxmoe.integrations.torchtitan.v0_3.overrides` (the torchtitan 0.3 adapter's package); importing
it from here warns and re-exports it."""

import warnings

import mxmoe.integrations.torchtitan.v0_3.overrides as _moved

warnings.warn(
    "mxmoe.integrations.torchtitan.overrides is now mxmoe.integrations.torchtitan.v0_3.overrides",
    DeprecationWarning,
    stacklevel=2,
)
globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
