"""Both spellings of an `[mx]` boolean on torchtitan 0.2's command line.

torchtitan 0.2's parser (tyro) makes each boolean a pair of flags, `--mx.convert-linears` /
`--mx.no-convert-linears`, and refuses `--mx.convert_linears=false`, the spelling of `mxmoe train`
(and of every other `--mx.*` option here). `respell` rewrites the `[mx]` booleans given with a value
(`--mx.B=V`, `--mx.B V`, V one of true/false/1/0/yes/no/on/off) into the flag of that value, in the
argument list torchtitan is about to parse; `install` hooks it into torchtitan's `ConfigManager`.

torchtitan imports `--job.custom_config_module` from inside `ConfigManager._maybe_add_custom_config`,
before tyro reads the arguments, and tyro reads that same list: `install` (run when this adapter is
imported) respells the list of the parse in progress, found as that method's argument, and wraps the
method so that every later parse in the process is respelled too. Only `--mx.*` booleans change.
"""

from __future__ import annotations

import dataclasses
import sys

from mxmoe.options import MXOptions

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bools() -> set[str]:
    return {f.name for f in dataclasses.fields(MXOptions) if f.type in (bool, "bool")}


def respell(args: list[str]) -> None:
    """In place: each `[mx]` boolean given with a value becomes the flag of that value
    (`--mx.convert_linears=false` -> `--mx.no-convert-linears`); the other arguments are kept."""
    bools, out, i = _bools(), [], 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg[len("--mx.") :].partition("=") if arg.startswith("--mx.") else ("", "", "")
        field = name.replace("-", "_")
        if field in bools:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in _TRUE + _FALSE:
                i, value, eq = i + 1, args[i + 1], "="
            if eq and value.lower() in _TRUE + _FALSE:
                flag = field.replace("_", "-")
                arg = f"--mx.{flag}" if value.lower() in _TRUE else f"--mx.no-{flag}"
        out.append(arg)
        i += 1
    args[:] = out


def install() -> None:
    """Respell the arguments of torchtitan's parse in progress and of every later one (module
    docstring). Idempotent."""
    from torchtitan.config.manager import ConfigManager

    method = ConfigManager._maybe_add_custom_config
    original = getattr(method, "__wrapped_by_mxmoe__", method)
    frame = sys._getframe(1)
    while frame is not None:  # the parse that is importing this adapter
        if frame.f_code is original.__code__ and isinstance(frame.f_locals.get("args"), list):
            respell(frame.f_locals["args"])
            break
        frame = frame.f_back
    if method is not original:
        return

    def respelled(self, args, toml_values):
        if isinstance(args, list):
            respell(args)
        return original(self, args, toml_values)

    respelled.__wrapped_by_mxmoe__ = original
    ConfigManager._maybe_add_custom_config = respelled
