"""`mxmoe config`: the configs that ship with mxmoe, by name.

    mxmoe config list                                   # every name, what it is, its first comment line
    mxmoe config path moe_1b                            # the file's path
    mxmoe config show moe_1b                            # its text
    mxmoe config copy moe_1b my_run.toml                # a copy to edit
    mxmoe train --config moe_1b                         # the trainer takes a name or a TOML file's path
    torchtitan's train --job.config_file "$(mxmoe config path torchtitan/deepseek_v3_debug_0.2)"

Trainer configs are this package's NAME.toml files (`mxmoe train --config NAME`); torchtitan job
configs are torchtitan/NAME.toml, named `torchtitan/NAME`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from importlib import resources
from pathlib import Path

from mxmoe.cli import ArgumentParser

TORCHTITAN = "torchtitan/"
"""The name prefix of torchtitan's job configs."""


def _root() -> Path:
    return Path(str(resources.files(__name__)))


def names(kind: str | None = None) -> list[str]:
    """The shipped configs' names, sorted: kind "trainer" (`mxmoe train --config NAME`), "torchtitan"
    (torchtitan job configs, `torchtitan/NAME`) or None for both."""
    root = _root()
    trainer = sorted(p.stem for p in root.glob("*.toml"))
    titan = sorted(TORCHTITAN + p.stem for p in (root / "torchtitan").glob("*.toml"))
    return {"trainer": trainer, "torchtitan": titan, None: trainer + titan}[kind]


def path(name: str) -> Path:
    """The file of the shipped config `name`; ValueError listing the names if there is none."""
    if name not in names():
        raise ValueError(f"{name!r} is not a config that ships with mxmoe; expected one of {names()}")
    return _root() / f"{name}.toml"


def resolve(config: str, kind: str | None = None) -> Path:
    """`config` as a file: a shipped config's name (of `kind`, if given) or else a path. A
    torchtitan config named where a trainer config is expected is a ValueError saying where it goes."""
    if config in names():
        if kind == "trainer" and config.startswith(TORCHTITAN):
            raise ValueError(
                f"--config {config!r} is a torchtitan job config, not mxmoe train's: give it to torchtitan "
                f'as --job.config_file "$(mxmoe config path {config})"'
            )
        return path(config)
    if not config.strip():  # Path("") is the current folder: "is a folder" would be the error
        raise ValueError(
            f"--config {config!r} is empty; expected a config name (`mxmoe config list`) or a TOML file"
        )
    return Path(config)


def hint(config: str) -> str:
    """For a path that does not exist: a pointer to the shipped config of the same stem, or to the list."""
    p = Path(config)
    name = f"{TORCHTITAN}{p.stem}" if p.parent.name == "torchtitan" else p.stem
    if name in names():
        return f" (the configs that ship with mxmoe go by name: {name})"
    return f"; the configs that ship with mxmoe: {', '.join(names('trainer'))}"


def summary(name: str) -> str:
    """The first comment line of a shipped config."""
    for line in path(name).read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="mxmoe config", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="every shipped config: its name, kind and first comment line")
    for action, what in (("path", "print the file's path"), ("show", "print the file's text")):
        p = sub.add_parser(action, help=what)
        p.add_argument("name", help="a config name (mxmoe config list)")
    p = sub.add_parser("copy", help="copy a config to a file or folder, to edit it")
    p.add_argument("name", help="a config name (mxmoe config list)")
    p.add_argument("dest", help="the copy's path, or a folder to put NAME.toml in")
    p.add_argument("--force", action="store_true", help="replace DEST if it exists")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.action == "list":
            for kind in ("trainer", "torchtitan"):
                where = "mxmoe train --config NAME" if kind == "trainer" else "torchtitan --job.config_file"
                print(f"{kind} configs ({where}):")
                for name in names(kind):
                    print(f"  {name:34s} {summary(name)}")
            return 0
        src = path(args.name)
        if args.action == "path":
            print(src)
        elif args.action == "show":
            print(src.read_text(), end="")
        else:
            dest = Path(args.dest)
            if dest.is_dir():
                dest = dest / src.name
            elif args.dest.endswith(("/", os.sep)):  # Path drops the slash: it would be a file named so
                raise ValueError(f"DEST {args.dest!r}: no such folder; create it first, or give a file path")
            elif not dest.parent.is_dir():
                raise ValueError(
                    f"DEST {args.dest!r}: folder {str(dest.parent)!r} does not exist; expected a file path "
                    "in an existing folder, or an existing folder"
                )
            if dest.exists() and not args.force:
                raise ValueError(f"{str(dest)!r} exists; give --force to replace it")
            try:
                shutil.copyfile(src, dest)
            except shutil.SameFileError:
                raise ValueError(
                    f"DEST {args.dest!r} is the shipped config itself; give a path to copy it to"
                ) from None
            except OSError as e:
                raise ValueError(
                    f"DEST {args.dest!r}: cannot write {str(dest)!r} ({e.strerror or e})"
                ) from None
            print(dest)
    except (ValueError, OSError) as e:
        print(f"mxmoe config: error: {e}", file=sys.stderr)
        return 2
    return 0
