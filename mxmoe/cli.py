"""The `mxmoe` command: `mxmoe train ...`, `mxmoe plot ...`,
`mxmoe bench {cast,a2a,linear,grouped_mm,overhead,train} ...`.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; it is imported
only when used, so `mxmoe --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "mxmoe.train.trainer",
    "plot": "mxmoe.train.plot",
}
BENCHES = {
    "cast": "mxmoe.bench.cast",
    "a2a": "mxmoe.bench.a2a",
    "linear": "mxmoe.bench.linear",
    "grouped_mm": "mxmoe.bench.grouped_mm",
    "overhead": "mxmoe.bench.overhead",
    "train": "mxmoe.bench.train",
}

USAGE = f"""usage: mxmoe COMMAND [ARGS...]

commands:
  train            train a model (TOML config + --section.key=value overrides)
  plot             draw loss curves of runs to a PNG
  bench NAME       benchmarks on a GPU; NAME is one of {", ".join(BENCHES)}

`mxmoe COMMAND --help` describes each command."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            got = rest[0] if rest else "nothing"
            print(f"mxmoe bench: expected one of {list(BENCHES)}, got {got}", file=sys.stderr)
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
