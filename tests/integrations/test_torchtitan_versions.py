"""The torchtitan adapters' version floors: which adapter a (torchtitan, torch) pair gets, and the
errors that name the versions and the fix otherwise. The checks are pure functions of version
strings, but importing them imports the package, which needs a torchtitan installed (either version)."""

from __future__ import annotations

import importlib.util
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
