"""Benchmarks. `mxmoe.bench.timing` is the one timing utility and table printer they all use."""
