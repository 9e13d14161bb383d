"""Integrations of mxmoe into other training frameworks (each an optional extra).

- `mxmoe.integrations.torchtitan`: mxmoe's converter (MX Linear layers, MX experts, the MXFP8
  expert-parallel exchange) for torchtitan 0.2.x (`--model.converters mxmoe`,
  `pip install mxmoe[torchtitan02]`) and 0.3 (`MXMoEConverter`, `--override.imports
  mxmoe.integrations.torchtitan.mxmoe`, `pip install mxmoe[torchtitan]`); docs/torchtitan.md.
"""
