"""The `mxmoe` command: `mxmoe train ...`, `mxmoe plot ...`, `mxmoe compare ...`,
`mxmoe bench {cast,a2a,linear,grouped_mm,overhead,train} ...`.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; it is imported
only when used, so `mxmoe --help` stays fast. Lists are given one way everywhere: comma separated
(`--mx.filter_fqns=output,router`, `mxmoe plot --labels a,b`, `mxmoe bench a2a --dims 5120,7168`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

def comma_list(
    item: Callable[[str], T] = str,
    choices: Sequence[str] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> Callable[[str], list[T]]:
    """An argparse `type` for list options: "a,b,c" -> [item("a"), item("b"), item("c")]. With
    `action="extend"` the option may also be repeated (`--k a,b --k c` == `--k a,b,c`). renamed:
    old spellings of choices -> their new ones, named in the error an old one gets."""

    def parse(text: str) -> list[T]:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r} is empty; expected a comma-separated list")
        bad = [t for t in parts if choices is not None and t not in choices]
        if bad:
            new = (renamed or {}).get(bad[0])
            now = f" ({bad[0]!r} is now {new!r})" if new else ""
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)}{now}")
        try:
            return [item(t) for t in parts]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    parse.__name__ = "comma list"  # argparse names the type in its errors
    return parse


def positive_int(text: str) -> int:
    """An argparse `type` for counts: an int >= 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return v


COMMANDS = {
    "train": "mxmoe.train.trainer",
    "plot": "mxmoe.train.plot",
    "compare": "mxmoe.train.compare",
}
BENCHES = {
    "cast": "mxmoe.bench.cast",
    "a2a": "mxmoe.bench.a2a",
    "linear": "mxmoe.bench.linear",
    "grouped_mm": "mxmoe.bench.grouped_mm",
    "overhead": "mxmoe.bench.overhead",
    "train": "mxmoe.bench.train",
    "fidelity": "mxmoe.bench.fidelity",
}

USAGE = f"""usage: mxmoe COMMAND [ARGS...]
       mxmoe --version

commands:
  train            train a model (TOML config + --section.key=value overrides)
  plot             draw loss curves of runs to a PNG
  compare          run (or read) variants x seeds: paired loss differences, a table and a plot
  bench NAME       benchmarks on a GPU; NAME is one of {", ".join(BENCHES)}

`mxmoe COMMAND --help` describes each command; lists are comma separated everywhere."""

BENCH_USAGE = f"""usage: mxmoe bench NAME [ARGS...]

benchmarks (each but fidelity needs a CUDA GPU; `mxmoe bench NAME --help` lists its options):
  cast             MX cast kernels (torch, triton, cuda): time and bandwidth per shape
  a2a              MXFP8 vs bf16 all-to-all dispatch/combine (run under torchrun)
  linear           MXLinear vs nn.Linear forward + backward
  grouped_mm       MX grouped GEMM of the experts vs the high-precision one
  fidelity         MX variants' gradient and loss error vs fp32 at bf16-trained weights (CPU too)

NAME is one of {", ".join(BENCHES)}."""


def main(argv: list[str] | None = None) -> int:
    """Run `mxmoe ARGS`; returns the exit status (0 ok, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command is a usage error: help on stderr, status 2 (as argparse does)
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from mxmoe import __version__

        print(f"mxmoe {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(BENCH_USAGE)
            return 0
        if not rest or rest[0] not in BENCHES:
            got = repr(rest[0]) if rest else "nothing"
            err = f"mxmoe bench: expected a benchmark name, one of {list(BENCHES)}; got {got}"
            print(err, file=sys.stderr)
            print(f"\n{BENCH_USAGE}", file=sys.stderr)
            return 2
        module, rest = BENCHES[rest[0]], rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(f"mxmoe: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
