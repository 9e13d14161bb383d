"""Weight casts computed once per optimizer step and reused: `cache_weight_casts()`.

Inside `with cache_weight_casts():` the MX ops keep each weight cast they compute (the forward's
cast along K, the backward's along N; for the emulated GEMM these are the qdq'd bf16/fp32 values)
and reuse it in every later forward, backward, micro-batch and activation-checkpointing recompute
of the scope, as long as the weight is unchanged. Wrap one optimizer step's forward and backward
passes (all micro-batches) in it:

    for step in ...:
        with mxmoe.ops.cache_weight_casts():
            for micro_batch in ...:
                loss_fn(model(micro_batch)).backward()
        optimizer.step()

A cached cast is used only if all of these still hold, else it is recomputed:
- the weight is (a view of) the same `nn.Parameter` object, with the same `_version` (every
  autograd-visible in-place update bumps it), the same data pointer, shape, strides and offset;
- no optimizer has stepped since it was made (a global `torch.optim` step hook counts steps, so an
  optimizer step inside the scope invalidates every cached cast).
Changes that none of these see, e.g. writes through `param.data`, or FSDP's re-gather of a weight
after a `load_state_dict` of its shards within one scope, need the scope to end (or no scope).
The cache is dropped when the scope exits. It holds one copy of each cast weight per axis for the
scope's lifetime (for FSDP that keeps the casts of unsharded weights alive between forward and
backward). Under torch.compile the ops do not use it (the casts are part of the compiled graph).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

T = TypeVar("T")

_scopes: list[dict] = []
_steps = 0  # optimizer steps seen (any optimizer), via the global step hook


def _count_step(*_args) -> None:
    global _steps
    _steps += 1


register_optimizer_step_post_hook(_count_step)


@contextlib.contextmanager
def cache_weight_casts() -> Iterator[None]:
    """Reuse weight casts within the block (see the module docstring). Nests; each scope has its
    own cache, dropped on exit."""
    cache: dict = {}
    _scopes.append(cache)
    try:
        yield
    finally:
        _scopes.remove(cache)
        cache.clear()


def _fingerprint(w: Tensor, base: Tensor) -> tuple:
    return (base._version, w.data_ptr(), tuple(w.shape), w.stride(), w.storage_offset(), w.dtype, _steps)


def cached_cast(w: Tensor, key: tuple, make: Callable[[], T]) -> T:
    """`make()`, the cast of weight `w` described by the hashable `key` (cast kind, recipe, dtype),
    reused from the innermost active scope while `w` is unchanged; computed afresh outside a scope,
    under torch.compile, and for tensors that are not (views of) an nn.Parameter."""
    if torch.compiler.is_compiling() or not _scopes:  # (compiling first: dynamo never reads _scopes)
        return make()
    base = w if w._base is None else w._base
    if not isinstance(base, nn.Parameter):
        return make()
    cache = _scopes[-1]
    slot = (id(base), key)
    fp = _fingerprint(w, base)
    hit = cache.get(slot)
    if hit is not None and hit[0]() is base and hit[1] == fp:
        return hit[2]
    value = make()
    cache[slot] = (weakref.ref(base), fp, value)
    return value


def cache_size() -> int:
    """Number of casts held by the innermost active scope (0 outside a scope)."""
    return len(_scopes[-1]) if _scopes else 0
