"""`MXGatheredWeight`: a weight that FSDP2 all-gathered already cast to MX (`mxmoe.nn.fsdp`).

It stands where the unsharded weight stands (the module's `weight`, `w1`, ...): a tensor of the
weight's logical shape ((N, K) or (E, N, K)) and compute dtype, whose data are the MX elements and
scales of one layout, the cast along the last dim ("dim0", what the forward GEMM reads) or along
dim -2 ("dim1", the dgrad's). The MX ops take it through `mx(axis, recipe)` and cast nothing.

Gathered buffers (concatenations over the ranks' shards along dim 0):
  dim0, 2D: elements (N, K), scales (N, K/bs)     (the storage of to_mx(w, -1))
  dim1, 2D: elements (N, K), scales (N/bs, K)     (the transpose of to_mx(w, -2)'s storage)
  dim0, 3D: elements (E, N, K), scales (E, N, K/bs)
  dim1, 3D: elements (E, K, N), scales (E, K, N/bs) (to_mx(w, -2)'s storage)
A GEMM that asks for the layout this tensor does not hold (its module is not resharded after the
forward, or the forward is recomputed in the backward) gets it from `regather`, a collective that
all-gathers that layout of the shards (exact: the same cast of the same shards).

Any other op on it raises: its values are MX data, not the weight's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from mxmoe.quant.mx_tensor import MXTensor, mx_tensor_trusted
from mxmoe.recipe import MXRecipe

LAYOUTS = ("dim0", "dim1")
"""dim0: blocks along the last dim (the forward GEMM's weight); dim1: along dim -2 (the dgrad's)."""

Regather = Callable[[str], tuple[Tensor, Tensor]]
"""layout -> (elements, scales) of that layout, gathered (a collective over the shard group)."""

class _Data:
    """The gathered elements, scales and their layout, shared by a gathered weight and its views."""

    def __init__(self, q: Tensor, s: Tensor, layout: str, regather: Regather | None):
        self.q, self.s, self.layout, self.regather = q, s, layout, regather


_VIEW_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class MXGatheredWeight(Tensor):
    """The unsharded weight as MX data of one layout (module doc). shape/dtype: the weight's
    logical shape and compute dtype (autograd's view of it; its gradient is a plain tensor)."""

    _data: _Data
    _recipe: MXRecipe
    _transposed: bool
    _cast_dtype: torch.dtype

    @staticmethod
    def __new__(
        cls, shape, dtype: torch.dtype, q, s: Tensor | None, layout: str, recipe: MXRecipe,
        regather: Regather | None = None, transposed: bool = False, requires_grad: bool = False,
        cast_dtype: torch.dtype | None = None,
    ):
        shape = tuple(shape)
        if transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=(q.q if isinstance(q, _Data) else q).device,
            requires_grad=requires_grad,
        )

    def __init__(
        self, shape, dtype: torch.dtype, q, s: Tensor | None, layout: str, recipe: MXRecipe,
        regather: Regather | None = None, transposed: bool = False, requires_grad: bool = False,
        cast_dtype: torch.dtype | None = None,
    ):
        """cast_dtype: the dtype the weight was converted to before its MX cast (None: dtype); a
        `.to(cast_dtype)` of this tensor is then this tensor in that dtype (the same MX data)."""
        self._data = q if isinstance(q, _Data) else _Data(q, s, layout, regather)
        self._cast_dtype = cast_dtype or dtype
        self._recipe, self._transposed = recipe, transposed

    def set_data(self, q: Tensor, s: Tensor, layout: str, regather: Regather | None = None) -> None:
        """Refill in place (FSDP2's later all-gathers write into the same unsharded parameter); its
        views (transposes, detached copies autograd saved for the backward) see the new data."""
        d = self._data
        d.q, d.s, d.layout, d.regather = q, s, layout, regather

    @property
    def layout(self) -> str:
        return self._data.layout

    @property
    def _q(self) -> Tensor:
        return self._data.q

    @property
    def _s(self) -> Tensor:
        return self._data.s

    def _weight_shape(self) -> tuple[int, ...]:
        s = tuple(self.shape)
        return (*s[:-2], s[-1], s[-2]) if self._transposed else s

    def _rewrap(self, transposed: bool) -> MXGatheredWeight:
        return self._rewrap_as(transposed, self.dtype)

    def _rewrap_as(self, transposed: bool, dtype: torch.dtype) -> MXGatheredWeight:
        return MXGatheredWeight(self._weight_shape(), dtype, self._data, None, "", self._recipe, None,
                                transposed, cast_dtype=self._cast_dtype)

    def mx(self, axis: int, recipe: MXRecipe) -> MXTensor:
        """The weight (N, K) / (E, N, K) cast along `axis` (-1: dim0, -2: dim1) as `to_mx(w, axis,
        recipe=recipe)` returns it (bit for bit). ValueError when `recipe`'s format is not the one
        the weight was gathered in."""
        if self._transposed:
            raise ValueError("MXGatheredWeight.mx takes the weight (N, K), not its transposed view")
        r = self._recipe
        if (r.elem_dtype, r.block_size, r.scaling_mode) != (recipe.elem_dtype, recipe.block_size,
                                                            recipe.scaling_mode):
            raise ValueError(
                f"weight gathered as {r.elem_dtype}/{r.block_size}/{r.scaling_mode} but the op's recipe "
                f"is {recipe.elem_dtype}/{recipe.block_size}/{recipe.scaling_mode}"
            )
        if self.dtype != self._cast_dtype:
            raise ValueError(
                f"this weight was cast to MX from {self._cast_dtype}; read it in that dtype, not {self.dtype}"
            )
        if axis not in (-1, -2):
            raise ValueError(f"axis={axis}: expected -1 (dim0) or -2 (dim1)")
        layout = "dim0" if axis == -1 else "dim1"
        d = self._data
        q, s = (d.q, d.s) if layout == d.layout else self._fetch(layout)
        nd = q.ndim
        if layout == "dim1" and nd == 2:  # gathered (N, K) / (N/bs, K): to_mx's storage is (K, N)
            q, s = q.t().contiguous(), s.t().contiguous()
        return mx_tensor_trusted(q, s, nd - 1 if layout == "dim0" else nd - 2, r.block_size,
                                 r.scaling_mode, self._cast_dtype)

    def _fetch(self, layout: str) -> tuple[Tensor, Tensor]:
        if self._data.regather is None:
            raise RuntimeError(
                f"this weight was gathered as MX {self.layout} and the GEMM needs {layout}, with no "
                "shard group to gather it from"
            )
        return self._data.regather(layout)

    def __repr__(self) -> str:
        return (f"MXGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, layout={self.layout}, "
                f"transposed={self._transposed})")

    def __tensor_flatten__(self):
        return ["_q", "_s"], (self._weight_shape(), self.dtype, self.layout, self._recipe,
                              self._transposed, self._cast_dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        shape, dtype, layout, recipe, transposed, cast_dtype = meta
        return MXGatheredWeight(shape, dtype, inner["_q"], inner["_s"], layout, recipe, None, transposed,
                                cast_dtype=cast_dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func in _VIEW_OPS:
            return w._rewrap(w._transposed)
        if func is torch.ops.aten.as_strided.default and tuple(args[1]) == tuple(w.shape):
            return w._rewrap(w._transposed)  # FSDP2's unsharded view (same shape)
        if func is torch.ops.aten.view.default and tuple(args[1]) == tuple(w.shape):
            return w._rewrap(w._transposed)
        if func is torch.ops.aten._to_copy.default and set(kwargs) <= {"dtype"} and len(args) == 1:
            if kwargs.get("dtype", w.dtype) in (w.dtype, w._cast_dtype):  # e.g. experts' .bfloat16()
                return w._rewrap_as(w._transposed, kwargs.get("dtype", w.dtype))
        if func is torch.ops.aten.t.default or (
            func is torch.ops.aten.transpose.int
            and sorted(d % w.ndim for d in args[1:3]) == [w.ndim - 2, w.ndim - 1]
        ):
            return w._rewrap(not w._transposed)
        names = [type(a).__name__ for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
        raise NotImplementedError(
            f"{func} on a weight that FSDP2 gathered as MXFP8 (MXGatheredWeight, args {names}): only "
            "mxmoe's MX GEMMs read it. Use the module through its forward, or turn off "
            "mx.fsdp_mxfp8_all_gather"
        )


def gathered_mx(w: Tensor, axis: int, recipe: MXRecipe) -> MXTensor | None:
    """`w.mx(axis, recipe)` for an MXGatheredWeight, else None (the ops then cast w themselves)."""
    return w.mx(axis, recipe) if isinstance(w, MXGatheredWeight) else None
