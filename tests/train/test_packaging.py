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
