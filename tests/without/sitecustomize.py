"""Put this folder first on PYTHONPATH of a subprocess to run it as on a machine without the
packages named in MXMOE_TEST_WITHOUT (comma separated): `import NAME` fails as for a package that
is not installed, `importlib.util.find_spec(NAME)` is None and `importlib.metadata.version(NAME)`
raises PackageNotFoundError."""

import importlib.metadata
import os
import sys

_WITHOUT = [n for n in os.environ.get("MXMOE_TEST_WITHOUT", "").split(",") if n]
for _name in _WITHOUT:
    sys.modules[_name] = None  # what the import system reads as "no such module"
_version = importlib.metadata.version


def _version_without(name: str) -> str:
    if name in _WITHOUT:
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)


importlib.metadata.version = _version_without
