"""The torchtitan adapters' version floors: which adapter a (torchtitan, torch) pair gets, and the
errors that name the versions and the fix otherwise. The checks are pure functions of version
strings, but importing them imports the package, which needs a torchtitan installed (either version)."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip(
        "importing mxmoe.integrations.torchtitan needs torchtitan (0.2.x or 0.3)", allow_module_level=True
    )

from mxmoe.integrations.torchtitan.common import check_trainer_torch, check_versions


@pytest.mark.parametrize(
    "torchtitan, torch, adapter",
    [
        ("0.2.2", "2.11.0+cu130", (0, 2)),
        ("0.2.2", "2.13.0+cpu", (0, 2)),
        ("0.2.0", "2.14.1", (0, 2)),
        ("0.3.0", "2.14.1", (0, 3)),
        ("0.3.0", "2.13.0+cpu", (0, 3)),  # models and converters import; the trainer needs 2.14
        ("0.3.0", "2.12.0", (0, 3)),
    ],
)
def test_adapter_per_version(torchtitan, torch, adapter):
    assert check_versions(torchtitan, torch) == adapter


@pytest.mark.parametrize(
    "torchtitan, torch, match",
    [
        ("0.3.0", "2.11.0+cu130", r"0.3 needs torch >= 2.14, this is torch 2.11.0\+cu130.*set_timeout"),
        ("0.3.0", "2.11.0", r"torchtitan 0.2.x runs on torch 2.11: pip install 'mxmoe\[torchtitan02\]'"),
        ("0.2.2", "2.10.0", r"torchtitan 0.2 needs torch >= 2.11, this is torch 2.10.0"),
        ("0.1.0", "2.13.0", r"supports torchtitan 0.2.x and 0.3.x, this is torchtitan 0.1.0"),
        ("0.4.0", "2.15.0", r"supports torchtitan 0.2.x and 0.3.x, this is torchtitan 0.4.0"),
    ],
)
def test_unsupported_versions_name_both(torchtitan, torch, match):
    with pytest.raises(ImportError, match=match):
        check_versions(torchtitan, torch)


def test_trainer_floor_is_set_timeout():
    old = SimpleNamespace(__version__="2.13.0", distributed=SimpleNamespace())
    with pytest.raises(ImportError, match=r"trainer needs torch >= 2.14 .*set_timeout.*this is torch 2.13.0"):
        check_trainer_torch(old)
    check_trainer_torch(SimpleNamespace(__version__="2.14.1", distributed=SimpleNamespace(set_timeout=print)))


def test_without_torchtitan_the_data_tool_runs_and_adapter_names_fail_in_one_line(tmp_path):
    """Without torchtitan: `python -m mxmoe.integrations.torchtitan.data` (which needs none) shows
    its help and writes its dataset; an adapter's name raises the ImportError naming what to
    install; `--tokenizer` without the tokenizers package is one line (issue 57)."""
    from conftest import run_without

    module = ["-m", "mxmoe.integrations.torchtitan.data"]
    done = run_without(["torchtitan"], [*module, "--help"], tmp_path)
    assert done.returncode == 0 and "usage: python -m mxmoe.integrations.torchtitan.data" in done.stdout
    src = tmp_path / "a.py"
    src.write_text("print('hello')\n")
    done = run_without(["torchtitan", "tokenizers"], [*module, "out", "--path", str(src)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert [json.loads(x) for x in (tmp_path / "out" / "data.json").read_text().splitlines()] == [
        {"text": "print('hello')\n"}
    ]
    done = run_without(["torchtitan", "tokenizers"], [*module, "o2", "--tokenizer", "tok"], tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("--tokenizer needs the tokenizers package: pip install tokenizers")
    code = "from mxmoe.integrations.torchtitan import MXMoEConverter"
    done = run_without(["torchtitan"], ["-c", code], tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: mxmoe.integrations.torchtitan needs torchtitan 0.2.x (torch >= 2.11) or 0.3 (torch >= "
        "2.14): pip install 'mxmoe[torchtitan02]' or 'mxmoe[torchtitan]'"
    )


def test_the_data_tool_names_a_bad_argument_in_one_line(tmp_path, capsys):
    """`python -m mxmoe.integrations.torchtitan.data`: an out_dir or --tokenizer that is a file or
    cannot be written, a --path that is missing, holds no matching file or only blank ones, is a
    usage error naming the argument (tracebacks from mkdir and the trainer's data.path before)."""
    from mxmoe.integrations.torchtitan.data import main

    (tmp_path / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.py").write_text("  \n")
    (tmp_path / "src.py").write_text("print(1)\n")
    src = str(tmp_path / "src.py")
    for argv, needle in [
        ([str(tmp_path / "f"), "--path", src], f"out_dir {str(tmp_path / 'f')!r}: is a file"),
        (["/proc/no/out", "--path", src], "out_dir '/proc/no/out': cannot write in"),
        ([str(tmp_path / "o"), "--path", src, "--tokenizer", str(tmp_path / "f")], "--tokenizer "),
        ([str(tmp_path / "o"), "--path", str(tmp_path / "none")], f"--path={str(tmp_path / 'none')!r}: "),
        ([str(tmp_path / "o"), "--path", str(tmp_path / "empty")], "holds no files ending in ['.py']"),
        ([str(tmp_path / "o"), "--path", str(tmp_path / "blank")], "every file it names is empty or blank"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and "data.path" not in err, err
    assert not (tmp_path / "o" / "data.json").exists()
