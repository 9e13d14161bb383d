"""Packaging: licence, extras that match the imports, the `mxmoe` command's help, version and status."""

import ast
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import mxmoe
from mxmoe import cli

REPO = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# import name -> distribution name, where they differ
DIST = {"torch.utils.tensorboard": "tensorboard"}


def test_licence_is_bsd_3_clause():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Copyright (c) 2026, mxmoe contributors" in text
    assert PYPROJECT["license"] == "BSD-3-Clause" and PYPROJECT["license-files"] == ["LICENSE"]


def _third_party_imports() -> set[str]:
    found = set()
    for path in (REPO / "mxmoe").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top in ("mxmoe", "__future__") or top in sys.stdlib_module_names:
                    continue
                found.add(next((d for m, d in DIST.items() if name.startswith(m)), top))
    return found


def _names(reqs: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}


def test_every_imported_package_is_a_dependency_or_an_extra():
    extras = PYPROJECT["optional-dependencies"]
    assert {"triton", "plot", "tensorboard"} <= set(extras)
    assert _names(extras["triton"]) >= {"triton"} and _names(extras["plot"]) == {"matplotlib"}
    assert _names(extras["tensorboard"]) == {"tensorboard"}
    declared = _names(PYPROJECT["dependencies"]) | set().union(
        *(_names(v) for k, v in extras.items() if k != "dev")
    )
    imported = _third_party_imports()
    assert {"torch", "triton", "matplotlib", "tensorboard"} <= imported
    assert imported <= declared, f"imported but not declared: {imported - declared}"


def test_version_comes_from_the_package():
    assert PYPROJECT["dynamic"] == ["version"] and "version" not in PYPROJECT
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools_cfg["dynamic"]["version"] == {"attr": "mxmoe.__version__"}


@pytest.mark.parametrize(
    "argv, status, stream, text",
    [
        ([], 2, "err", "usage: mxmoe COMMAND"),
        (["--help"], 0, "out", "usage: mxmoe COMMAND"),
        (["--version"], 0, "out", f"mxmoe {mxmoe.__version__}"),
        (["bench", "--help"], 0, "out", "usage: mxmoe bench NAME"),
        (["config", "list"], 0, "out", "torchtitan/deepseek_v3_debug_0.2"),
        (["config", "path", "nope"], 2, "err", "'nope' is not a config that ships with mxmoe"),
        (["bench", "-h"], 0, "out", "grouped_mm"),
        (["bench"], 2, "err", "expected a benchmark name"),
        (["bench", "nope"], 2, "err", "got 'nope'"),
        (["nope"], 2, "err", "unknown command 'nope'"),
    ],
)
def test_cli_help_version_and_status(capsys, argv, status, stream, text):
    assert cli.main(argv) == status
    out, err = capsys.readouterr()
    assert text in (out if stream == "out" else err)


def test_lists_are_comma_separated_in_every_subcommand(capsys):
    from mxmoe.bench import cast, linear
    from mxmoe.train.config import parse_args
    from mxmoe.train.plot import main as plot_main

    assert parse_args(["--mx.filter_fqns=output,router"]).mx.filter_fqns == ["output", "router"]
    args = cast.build_parser().parse_args(["--kernel", "triton,cuda", "--shape", "64x64,8x64x64"])
    assert args.kernel == ["triton", "cuda"] and args.shape == [(64, 64), (8, 64, 64)]
    again = cast.build_parser().parse_args(["--kernel", "triton", "--kernel", "cuda"])  # repeating adds
    assert again.kernel == ["triton", "cuda"]
    with pytest.raises(SystemExit):
        cast.build_parser().parse_args(["--kernel", "triton,cutlass"])
    assert "'cutlass' is not one of torch, triton, cuda, all" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        linear.main(["--recipes", "mxfp8,nope"])
    assert "'nope' is not one of" in capsys.readouterr().err
    if not torch.cuda.is_available():  # parsed fine; then refused for want of a GPU
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            linear.main(["--recipes", "mxfp8,mxfp8_rceil", "--shape", "64x64x64,32x32x32"])
    assert plot_main(["/nonexistent", "--labels", "a,b"]) == 2
    assert "labels has 2 names for 1 runs" in capsys.readouterr().err


def _options(parser):
    """(prog, option strings, help) of every option of an argparse parser and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, action.option_strings or [action.dest], action.help


COMMANDS = [*(c for c in cli.COMMANDS if c != "train"), *(f"bench {b}" for b in cli.BENCHES)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_every_subcommand_has_help(command):
    """Each command's module builds its parser with `build_parser()`; every option says what it does
    (`mxmoe train`'s options are its config's fields: tests/train/test_config.py checks their docs)."""
    import importlib

    name = command.split()
    module = cli.BENCHES[name[1]] if name[0] == "bench" else cli.COMMANDS[name[0]]
    parser = importlib.import_module(module).build_parser()
    assert parser.prog == f"mxmoe {command}"
    options = list(_options(parser))
    assert options
    for prog, flags, text in options:
        assert text and text.strip() and text != "==SUPPRESS==", f"{prog} {flags[0]}: no help"


def test_command_and_bench_help_come_from_the_registries(capsys):
    """`mxmoe --help` and `mxmoe bench --help` list every registered command and benchmark with the
    first line of its module's docstring (issue 48: bench --help described 5 of its 7 benchmarks)."""
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command, module in cli.COMMANDS.items():
        line = next(x for x in out.splitlines() if x.startswith(f"  {command} "))
        assert line.split(None, 1)[1] == cli.summary(module) and len(cli.summary(module)) > 20
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for bench, module in cli.BENCHES.items():
        line = next(x for x in out.splitlines() if x.startswith(f"  {bench} "))
        assert line.split(None, 1)[1] == cli.summary(module) and len(cli.summary(module)) > 20


def test_config_command_reaches_the_shipped_configs(tmp_path, capsys, monkeypatch):
    """`mxmoe config path|show|copy NAME` from any folder; copy refuses to overwrite without --force."""
    from mxmoe import configs

    monkeypatch.chdir(tmp_path)
    name = "torchtitan/deepseek_v3_debug_0.2"
    assert cli.main(["config", "path", name]) == 0
    path = capsys.readouterr().out.strip()
    assert path == str(configs.path(name)) and "custom_config_module" in open(path).read()
    assert cli.main(["config", "show", "debug_moe"]) == 0
    assert capsys.readouterr().out == configs.path("debug_moe").read_text()
    assert cli.main(["config", "copy", "debug_moe", "."]) == 0
    assert (tmp_path / "debug_moe.toml").read_text() == configs.path("debug_moe").read_text()
    assert cli.main(["config", "copy", "debug_moe", "debug_moe.toml"]) == 2
    assert "exists; give --force to replace it" in capsys.readouterr().err
    assert cli.main(["config", "copy", "moe_1b", "debug_moe.toml", "--force"]) == 0
    assert "moe_1b" in (tmp_path / "debug_moe.toml").read_text()


def test_configs_ship_as_package_data():
    """pyproject's package data names every shipped config (the wheel check installs them)."""
    import fnmatch

    from mxmoe import configs

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = tool["package-data"]["mxmoe.configs"]
    for name in configs.names():
        rel = str(configs.path(name).relative_to(REPO / "mxmoe" / "configs"))
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
    assert len(configs.names("trainer")) >= 6 and configs.names("torchtitan")


def test_package_metadata_is_complete():
    assert PYPROJECT["authors"] == [{"name": "mxmoe developers"}]
    assert any(c.startswith("Development Status") for c in PYPROJECT["classifiers"])
    assert "tyro" in _names(PYPROJECT["dependencies"])


@pytest.mark.parametrize("command", COMMANDS)
def test_one_option_spelling_in_every_command(command):
    """Every command's options are shown with underscores, as the trainer's keys (issue 57)."""
    import importlib

    name = command.split()
    module = cli.BENCHES[name[1]] if name[0] == "bench" else cli.COMMANDS[name[0]]
    for prog, flags, _ in _options(importlib.import_module(module).build_parser()):
        for flag in flags:
            assert not flag.startswith("--") or "-" not in flag[2:], f"{prog} {flag}: dashed"


def test_dashes_and_underscores_are_one_spelling_everywhere():
    from mxmoe.bench import a2a, train
    from mxmoe.train.compare import build_parser as compare_parser
    from mxmoe.train.config import parse_args

    bench = train.build_parser()
    dashed, _ = bench.parse_known_args(["--warmup-steps", "3", "--profile-steps=2", "--same-process"])
    under, _ = bench.parse_known_args(["--warmup_steps", "3", "--profile_steps=2", "--same_process"])
    assert dashed == under and (under.warmup_steps, under.profile_steps, under.same_process) == (3, 2, True)
    assert a2a.build_parser().parse_args(["--no-check"]).check is False
    for flag in ("--no-deterministic", "--no_deterministic"):
        args = compare_parser().parse_args(["--config", "debug_moe", "--out", "o", flag])
        assert args.deterministic is False
    # after "--" nothing is respelled (compare hands those to the trainer)
    assert cli._underscored("--a-b=c-d") == "--a_b=c-d" and cli._underscored("-x") == "-x"
    t = parse_args(["--training.local-batch-size=3", "--training.local_batch_size", "4"])
    assert t.training.local_batch_size == 4


def test_shipped_help_messages_and_configs_name_no_repository_path():
    """A pip user has the package, not the repository: the strings mxmoe shows (help, messages; not
    docstrings) and the configs it ships name `mxmoe` commands, not `make train`, docs/ or scripts/
    (issue 57)."""
    import re

    repo_path = re.compile(r"\bdocs/|\bscripts/|\btests/|\bmake (train|test|lint|wheel-check)\b")
    found = []
    for path in sorted((REPO / "mxmoe").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
        found += [
            f"{path.relative_to(REPO)}:{n.lineno}: {n.value[:80]!r}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
            and repo_path.search(n.value)
        ]
    for path in sorted((REPO / "mxmoe" / "configs").rglob("*.toml")):
        lines = path.read_text().splitlines()
        found += [f"{path.relative_to(REPO)}: {x}" for x in lines if repo_path.search(x)]
    assert not found, "\n".join(found)


def test_readme_installs_from_a_clone_or_a_wheel():
    text = (REPO / "README.md").read_text()
    install = text[text.index("## Install") : text.index("\n## ", text.index("## Install") + 1)]
    assert "pip install ." in install and "pip wheel --no-deps -w dist ." in install
    assert "pip install mxmoe" not in install  # on no index yet
