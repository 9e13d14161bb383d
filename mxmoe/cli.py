"""The `mxmoe` command: `mxmoe train ...`, `mxmoe export ...`, `mxmoe plot ...`, `mxmoe compare ...`,
`mxmoe config ...`, `mxmoe bench {cast,a2a,linear,grouped_mm,overhead,train,fidelity} ...`.

Each subcommand lives in its own module exposing `main(argv: list[str]) -> int`; it is imported
only when used, so `mxmoe --help` stays fast. Options are spelled one way everywhere: words joined
by underscores, as the trainer's (torchtitan's) keys (`--training.local_batch_size`, `mxmoe bench
train --warmup_steps 5`); dashes are accepted too (`--warmup-steps`), in every command
(`ArgumentParser` here, tyro in the trainer). Lists are comma separated everywhere
(`--mx.filter_fqns=output,router`, `mxmoe plot --labels a,b`, `mxmoe bench a2a --dims 5120,7168`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def _underscored(option: str) -> str:
    """`--warmup-steps` -> `--warmup_steps` (a long option's name; its `=value` is kept as is)."""
    if not option.startswith("--") or option == "--":
        return option
    name, eq, value = option[2:].partition("=")
    return "--" + name.replace("-", "_") + eq + value


class ArgumentParser(argparse.ArgumentParser):
    """argparse with mxmoe's one option spelling: long options are declared and shown with
    underscores (`--no_graph`, `--no_deterministic` for a BooleanOptionalAction), and given with
    either underscores or dashes (`--no-graph`)."""

    def add_argument(self, *names, **kwargs):
        return _underscored_action(self, super().add_argument(*names, **kwargs))

    def add_argument_group(self, *args, **kwargs):
        return _underscoring(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return _underscoring(super().add_mutually_exclusive_group(**kwargs))

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        end = args.index("--") if "--" in args else len(args)  # after "--": positionals only
        return super().parse_known_args([_underscored(a) for a in args[:end]] + args[end:], namespace)


def _underscored_action(container, action: argparse.Action) -> argparse.Action:
    """`action`'s long option strings (those argparse made too: BooleanOptionalAction's `--no-x`)
    respelled with underscores, in the action and in `container`'s lookup table."""
    table = container._option_string_actions
    if isinstance(action, argparse.BooleanOptionalAction):
        action.__class__ = _BooleanOptional
    for i, old in enumerate(action.option_strings):
        new = _underscored(old)
        if new != old:
            action.option_strings[i] = new
            table[new] = table.pop(old)
    return action


class _BooleanOptional(argparse.BooleanOptionalAction):
    """BooleanOptionalAction whose negative option is `--no_x` (argparse's own tests for `--no-`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, not option_string.startswith("--no_"))


def _underscoring(group):
    add = group.add_argument
    group.add_argument = lambda *names, **kwargs: _underscored_action(group, add(*names, **kwargs))
    return group


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


def _probe_folder(folder: Path, option: str, value: str) -> None:
    """ValueError naming `option` unless a file can be created in the existing `folder`."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{option} {value!r}: cannot write in {str(folder)!r} ({e.strerror or e})") from None


def _existing_parent(path: Path, option: str, value: str) -> Path:
    """The nearest existing folder above `path`; ValueError naming `option` if that is not a folder."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {value!r}: {str(parent)!r} is a file, not a folder")
    return parent


def check_out_folder(value: str, option: str = "--out") -> None:
    """ValueError naming `option` unless `value` is a folder this process can write in, or can be
    created as one: checked before any work, so a run does not end at its last step on a file, a
    device or a read-only folder."""
    path = Path(value)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{option} {value!r}: {_what(path)}, expected a folder (created if missing)")
        _probe_folder(path, option, value)
    else:
        _probe_folder(_existing_parent(path, option, value), option, value)


def check_out_file(value: str, option: str = "--out", example: str = "loss.png") -> None:
    """ValueError naming `option` unless `value` is a regular file or a new file in a folder this
    process can write in (missing folders above it are created later)."""
    path = Path(value)
    if path.exists() and not path.is_file():
        raise ValueError(f"{option} {value!r}: {_what(path)}, expected a file path, e.g. {example}")
    parent = path.parent if path.parent.is_dir() else _existing_parent(path, option, value)
    _probe_folder(parent, option, value)


def _what(path: Path) -> str:
    """What `path` is, in words ("a folder", "a character device", ...)."""
    import stat

    mode = path.stat().st_mode
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return f"is {name}"
    return "is a special file"


COMMANDS = {
    "train": "mxmoe.train.trainer",
    "export": "mxmoe.train.export",
    "plot": "mxmoe.train.plot",
    "compare": "mxmoe.train.compare",
    "config": "mxmoe.configs",
}
"""Command -> the module whose `main(argv)` runs it; its docstring's first line is its help line."""
BENCHES = {
    "cast": "mxmoe.bench.cast",
    "a2a": "mxmoe.bench.a2a",
    "linear": "mxmoe.bench.linear",
    "grouped_mm": "mxmoe.bench.grouped_mm",
    "overhead": "mxmoe.bench.overhead",
    "train": "mxmoe.bench.train",
    "fidelity": "mxmoe.bench.fidelity",
    "trace": "mxmoe.bench.trace",
    "overlap": "mxmoe.bench.overlap",
}
"""Benchmark -> its module, as COMMANDS."""


def summary(module: str) -> str:
    """The first line of `module`'s docstring without its "`mxmoe ...`: " prefix, read from its
    source (the module, which may import torch or a GPU stack, is not imported)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    with open(spec.origin) as fh:
        doc = ast.get_docstring(ast.parse(fh.read())) or ""
    first = doc.split("\n")[0]
    return first.split("`: ", 1)[1] if first.startswith("`mxmoe") and "`: " in first else first


def _listing(entries: dict[str, str]) -> str:
    return "\n".join(f"  {name:16s} {summary(module)}" for name, module in entries.items())


def usage() -> str:
    return (
        "usage: mxmoe COMMAND [ARGS...]\n       mxmoe --version\n\ncommands:\n"
        + _listing(COMMANDS)
        + "\n  bench NAME       benchmarks: `mxmoe bench --help`\n\n"
        "`mxmoe COMMAND --help` describes each command's options; options are written with underscores "
        "(dashes accepted), lists comma separated, everywhere."
    )


def bench_usage() -> str:
    return (
        "usage: mxmoe bench NAME [ARGS...]\n\nbenchmarks (`mxmoe bench NAME --help` lists the options of "
        "each):\n" + _listing(BENCHES)
    )


def main(argv: list[str] | None = None) -> int:
    """Run `mxmoe ARGS`; returns the exit status (0 ok, 2 usage error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # no command is a usage error: help on stderr, status 2 (as argparse does)
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from mxmoe import __version__

        print(f"mxmoe {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help"):
            print(bench_usage())
            return 0
        if not rest or rest[0] not in BENCHES:
            got = repr(rest[0]) if rest else "nothing"
            err = f"mxmoe bench: expected a benchmark name, one of {list(BENCHES)}; got {got}"
            print(err, file=sys.stderr)
            print(f"\n{bench_usage()}", file=sys.stderr)
            return 2
        module, rest = BENCHES[rest[0]], rest[1:]
    elif cmd in COMMANDS:
        module = COMMANDS[cmd]
    else:
        print(f"mxmoe: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
