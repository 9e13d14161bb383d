"""Integrations of mxmoe into other training frameworks (each an optional extra).

- `mxmoe.integrations.torchtitan`: MX converters and an MXFP8 token dispatcher for torchtitan 0.3
  (`pip install mxmoe[torchtitan]`; docs/torchtitan.md).
"""
