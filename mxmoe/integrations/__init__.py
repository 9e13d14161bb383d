"""Integrations of mxmoe into other training frameworks (each an optional extra).

- `mxmoe.integrations.torchtitan`: MX converters for torchtitan 0.2.x (`--model.converters mxmoe`,
  `pip install mxmoe[torchtitan02]`) and 0.3 (with an MXFP8 token dispatcher,
  `pip install mxmoe[torchtitan]`); docs/torchtitan.md.
"""
