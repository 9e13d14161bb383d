"""Backends chosen by name: the cast kernels (`mxmoe.quant.backends.CAST_BACKENDS`), the GEMM
backends (`mxmoe.ops.gemm_backend.GEMM_BACKENDS`) and the expert-parallel exchange's transports
(`mxmoe.comm.transport.TRANSPORTS`) are each one `Registry`.

A backend declares, in the file that implements it, whether it can run in a context (a device, or
whatever its registry's consumers pass) and its rank for "auto"; choosing one is a lookup, not an
`if` chain, and adding one touches its own file and one `register` call. `Registry.resolve` answers
once per (choice, context) and keeps the answer in `RESOLVED`, the one cache of resolved choices
(every registry's, and what `mxmoe.quant.backends` derives from them), so that code traced by
torch.compile reads a dict instead of calling the availability checks (resolve before compiling,
e.g. when a module is built or converted; under tracing, an answer not resolved before is computed
and not kept).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from types import ModuleType

import torch

RESOLVED: dict[tuple, object] = {}
"""The one cache of resolved choices: each registry's answers under (its `what`, choice, *context),
and the answers `mxmoe.quant.backends` derives from them (`remember`). Cleared by
`mxmoe.quant.backends.clear_resolved` (everything) or a registry's `clear`."""


@dataclass(frozen=True)
class Backend:
    """One implementation of a registry's job."""

    name: str
    """What a user writes to choose it (e.g. "cuda", "symm")."""
    module: str
    """The module implementing it, imported on first use (`Registry.load`)."""
    why_unavailable: Callable[..., str | None]
    """(*context) -> None if it can run in that context, else the reason, said to a user who named it."""
    auto_rank: Callable[..., int | None]
    """(*context) -> its rank for "auto" in that context (the lowest available rank wins), or None
    when "auto" never takes it there."""
    ready: Callable[..., bool] | None = None
    """(*context) -> False when a costlier check (a first build, say) fails: "auto" then takes the
    next backend, while a user who named it gets the error of its first use."""


class Registry:
    """Backends of one job by name; "auto" picks the available one of lowest rank."""

    def __init__(self, what: str, *, keep: bool = True):
        self.what = what
        """What the backends do, for messages (e.g. "cast kernel"); the key of its answers in RESOLVED."""
        self.keep = keep
        """Keep the answers in RESOLVED (False: a registry whose costly checks keep their own answers
        there, so that resolving again is a few dict lookups that see a check replaced in tests)."""
        self._backends: dict[str, Backend] = {}

    def register(self, backend: Backend) -> Backend:
        if backend.name in self._backends or backend.name == "auto":
            raise ValueError(f"{self.what} {backend.name!r} is registered already (or is 'auto')")
        self._backends[backend.name] = backend
        self.clear()
        return backend

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._backends)

    def get(self, name: str, option: str | None = None) -> Backend:
        """The backend called `name`; ValueError naming `option` (or the registry) otherwise."""
        try:
            return self._backends[name]
        except (KeyError, TypeError):
            label = option or self.what
            raise ValueError(
                f"{label}={name!r} is not a {self.what}; expected 'auto' or one of {list(self._backends)}"
            ) from None

    def why_unavailable(self, name: str, *context: Hashable) -> str | None:
        """None if backend `name` can run in `context`, else the reason (ValueError for a bad name)."""
        return self.get(name).why_unavailable(*context)

    def available(self, *context: Hashable) -> list[str]:
        """Names of the backends that can run in `context`."""
        return [n for n, b in self._backends.items() if b.why_unavailable(*context) is None]

    def resolve(self, choice: str, *context: Hashable, option: str | None = None) -> str:
        """The concrete backend for `choice` ("auto" or a name) in `context`.

        "auto": the available, ready backend of lowest rank (RuntimeError if none). A name: itself,
        RuntimeError naming `option` and the reason when it cannot run here. Kept per (choice,
        context) outside torch.compile tracing.
        """
        key = (self.what, choice, *context)
        hit = RESOLVED.get(key) if self.keep else None
        if hit is not None:
            return hit
        if choice == "auto":
            ranked = []
            for b in self._backends.values():
                rank = b.auto_rank(*context)
                if rank is not None and b.why_unavailable(*context) is None:
                    ranked.append((rank, b))
            ranked.sort(key=lambda rb: rb[0])
            out = next((b.name for _, b in ranked if b.ready is None or b.ready(*context)), None)
            if out is None:
                raise RuntimeError(f"no {self.what} can run here ({context}); registered: {self.names()}")
        else:
            reason = self.get(choice, option).why_unavailable(*context)
            if reason is not None:
                raise RuntimeError(f"{option or self.what}={choice!r}: {reason}")
            out = choice
        if self.keep and not torch.compiler.is_compiling():
            RESOLVED[key] = out
        return out

    def load(self, name: str) -> ModuleType:
        """The module implementing backend `name`."""
        return importlib.import_module(self.get(name).module)

    def clear(self) -> None:
        """Forget this registry's resolved choices (after the environment changed, e.g. in tests)."""
        for key in [k for k in RESOLVED if k[0] == self.what]:
            del RESOLVED[key]
