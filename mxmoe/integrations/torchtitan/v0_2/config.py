"""Errors of the `[mx]` section of a torchtitan 0.2 TOML job config that name the file and the key.

torchtitan 0.2's `ConfigManager` builds each section of a TOML file with `_dict_to_dataclass`,
which checks no types and gives an unknown key a message that names neither the file nor the
section; `mxmoe.MXOptions` then refuses a bad value naming only the field (`recipe_name='x'`).
`install()` wraps `_dict_to_dataclass` once per process so that, for the `[mx]` section only, an
unknown key or a bad value is a ValueError / TypeError naming the TOML file (`--job.config_file`),
`mx.<key>`, the value and what is accepted. Every other section, and every valid `[mx]`, is built
by torchtitan's own code as before.
"""

from __future__ import annotations

import sys
from dataclasses import fields

from torchtitan.config import ConfigManager

from mxmoe.options import MXOptions

_CONFIG_FILE_KEYS = ("--job.config_file", "--job.config-file")


def config_file(args: list[str]) -> str | None:
    """The TOML file `args` name, as torchtitan 0.2's ConfigManager finds it (None: none)."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in _CONFIG_FILE_KEYS:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _parsed_file() -> str | None:
    """The TOML file of the `ConfigManager.parse_args` call on the stack (its `args`), else the
    process's command line's."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "parse_args" and isinstance(frame.f_locals.get("self"), ConfigManager):
            args = frame.f_locals.get("args")
            if isinstance(args, list):
                return config_file(args)
        frame = frame.f_back
    return config_file(sys.argv[1:])


def _where() -> str:
    file = _parsed_file()
    return f"{file}: [mx]" if file else "the TOML job config's [mx] section"


def install() -> None:
    """Wrap torchtitan 0.2's `ConfigManager._dict_to_dataclass` (once) for the [mx] errors above."""
    original = ConfigManager._dict_to_dataclass
    if getattr(original, "_mxmoe", False):
        return

    def _dict_to_dataclass(self, cls, data):
        if isinstance(cls, type) and issubclass(cls, MXOptions) and isinstance(data, dict):
            known = [f.name for f in fields(cls)]
            unknown = sorted(set(data) - set(known))
            if unknown:
                raise ValueError(f"{_where()}: unknown key(s) {unknown}; [mx] has {known}")
            try:
                return original(self, cls, data)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{_where()}: mx.{e}") from None
        return original(self, cls, data)

    _dict_to_dataclass._mxmoe = True
    ConfigManager._dict_to_dataclass = _dict_to_dataclass
