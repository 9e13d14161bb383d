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

torch.compile: dynamo does not trace a subclass's Python methods, so a compiled graph reads the
weight through the custom op `mxmoe::gathered_weight`, which `__torch_dispatch__` answers with the
buffers. A graph cannot gather, and its backward is traced with the forward's metadata: with
`phase_layouts` (`mxmoe.nn.fsdp` sets it where the module reshards after the forward and
recomputes nothing) the backward's read takes the same buffers in the backward's
layout, which FSDP2's backward gather has written into them by then (`mxmoe::gathered_as`, whose
input `after`, the gradient, keeps the read in the backward: a read of primal inputs alone may be
scheduled in the forward, before the refill). Each gather carries a layout tag (one uint8 per rank),
which the compiled reads check (`mxmoe::gathered_scales` in the forward, `mxmoe::gathered_as` in
the backward): a graph that re-reads the buffers in the other phase (a forward recomputed by
`torch.utils.checkpoint` inside a compiled block, invisible to FSDP2's state) stops there.

Any other op on it raises: its values are MX data, not the weight's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from mxmoe.formats import get_format
from mxmoe.quant.mx_tensor import MXTensor, mx_tensor_trusted
from mxmoe.recipe import MXRecipe

LAYOUTS = ("dim0", "dim1")
"""dim0: blocks along the last dim (the forward GEMM's weight); dim1: along dim -2 (the dgrad's)."""

Regather = Callable[[str], tuple[Tensor, Tensor]]
"""layout -> (elements, scales) of that layout, gathered (a collective over the shard group)."""

LAYOUT_IDS = {"dim0": 0, "dim1": 1}
"""A layout's id in the gathered layout tag (one uint8 per rank, gathered with the data)."""


def layout_tag(layout: str, device: torch.device) -> Tensor:
    """One rank's layout tag: a uint8 holding LAYOUT_IDS[layout]."""
    return torch.full((1,), LAYOUT_IDS[layout], dtype=torch.uint8, device=device)


class _Data:
    """The gathered elements, scales, layout tag (uint8, one per rank: the layout the data hold,
    which compiled graphs check) and layout, shared by a gathered weight and its views."""

    def __init__(self, q: Tensor, s: Tensor, layout: str, regather: Regather | None, tag: Tensor | None):
        self.q, self.s, self.layout, self.regather = q, s, layout, regather
        self.tag = layout_tag(layout, q.device) if tag is None else tag


_VIEW_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class MXGatheredWeight(Tensor):
    """The unsharded weight as MX data of one layout (module doc). shape/dtype: the weight's
    logical shape and compute dtype (autograd's view of it; its gradient is a plain tensor)."""

    _data: _Data
    _fmt: str
    _transposed: bool
    _cast_dtype: torch.dtype
    _phase_layouts: bool

    @staticmethod
    def __new__(
        cls, shape, dtype: torch.dtype, q, s: Tensor | None, layout: str, fmt: str,
        regather: Regather | None = None, transposed: bool = False, requires_grad: bool = False,
        cast_dtype: torch.dtype | None = None, phase_layouts: bool = False, tag: Tensor | None = None,
    ):
        shape = tuple(shape)
        if transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=(q.q if isinstance(q, _Data) else q).device,
            requires_grad=requires_grad,
        )

    def __init__(
        self, shape, dtype: torch.dtype, q, s: Tensor | None, layout: str, fmt: str,
        regather: Regather | None = None, transposed: bool = False, requires_grad: bool = False,
        cast_dtype: torch.dtype | None = None, phase_layouts: bool = False, tag: Tensor | None = None,
    ):
        """cast_dtype: the dtype the weight was converted to before its MX cast (None: dtype); a
        `.to(cast_dtype)` of this tensor is then this tensor in that dtype (the same MX data).
        phase_layouts: the forward reads only the forward's gather and the backward only the
        backward's (its module reshards after the forward and recomputes nothing), which a
        compiled graph relies on (module doc). tag: the gathered layout tag (None: this layout's)."""
        self._data = q if isinstance(q, _Data) else _Data(q, s, layout, regather, tag)
        self._cast_dtype = cast_dtype or dtype
        self._fmt, self._transposed, self._phase_layouts = fmt, transposed, phase_layouts

    def set_data(
        self, q: Tensor, s: Tensor, layout: str, regather: Regather | None = None, tag: Tensor | None = None
    ) -> None:
        """Refill in place (FSDP2's later all-gathers write into the same unsharded parameter); its
        views (transposes, detached copies autograd saved for the backward) see the new data."""
        d = self._data
        d.q, d.s, d.layout, d.regather = q, s, layout, regather
        d.tag = layout_tag(layout, q.device) if tag is None else tag

    @property
    def layout(self) -> str:
        return self._data.layout

    @property
    def _q(self) -> Tensor:
        return self._data.q

    @property
    def _s(self) -> Tensor:
        return self._data.s

    @property
    def _tag(self) -> Tensor:
        return self._data.tag

    def _weight_shape(self) -> tuple[int, ...]:
        s = tuple(self.shape)
        return (*s[:-2], s[-1], s[-2]) if self._transposed else s

    def _rewrap(self, transposed: bool) -> MXGatheredWeight:
        return self._rewrap_as(transposed, self.dtype)

    def _rewrap_as(self, transposed: bool, dtype: torch.dtype) -> MXGatheredWeight:
        return MXGatheredWeight(self._weight_shape(), dtype, self._data, None, "", self._fmt, None,
                                transposed, cast_dtype=self._cast_dtype, phase_layouts=self._phase_layouts)

    def mx(self, axis: int, recipe: MXRecipe) -> MXTensor:
        """The weight (N, K) / (E, N, K) cast along `axis` (-1: dim0, -2: dim1) as `to_mx(w, axis,
        recipe=recipe)` returns it (bit for bit). ValueError when `recipe`'s format is not the one
        the weight was gathered in."""
        q, s = self._layout_data(axis, recipe.fmt.name, traced=False)
        return mx_tensor_trusted(q, s, q.ndim - 1 if axis == -1 else q.ndim - 2, recipe.block_size,
                                 recipe.scaling_mode, self._cast_dtype)

    def _layout_data(
        self, axis: int, fmt: str, traced: bool, after: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(elements, scales) of the cast along `axis`, in to_mx's storage. Eager (traced=False): a
        layout this tensor does not hold is gathered (`_fetch`). Traced by torch.compile: the
        buffers hold the layout of the phase that reads them (phase_layouts), so the backward's read
        (`after`: a tensor of the backward, which keeps the read there) takes the buffers in the
        layout it asks for."""
        if self._transposed:
            raise ValueError("MXGatheredWeight.mx takes the weight (N, K), not its transposed view")
        if fmt != self._fmt:
            raise ValueError(f"weight gathered in format {self._fmt} but the op's recipe is {fmt}")
        if self.dtype != self._cast_dtype:
            raise ValueError(
                f"this weight was cast to MX from {self._cast_dtype}; read it in that dtype, not {self.dtype}"
            )
        if axis not in (-1, -2):
            raise ValueError(f"axis={axis}: expected -1 (dim0) or -2 (dim1)")
        layout = "dim0" if axis == -1 else "dim1"
        d = self._data
        if layout != d.layout and not traced:
            q, s = self._fetch(layout)
        elif layout != d.layout:
            if not self._phase_layouts or after is None:
                raise RuntimeError(
                    f"torch.compile reads this MXFP8-gathered weight ({d.layout}) as {layout}"
                    + (" in the forward" if after is None else "") + ": a compiled graph reads only "
                    "the layout of its phase (the module must reshard after the forward and recompute "
                    "nothing in the backward, as mxmoe.nn.fsdp checks at the first gather)"
                )
            q_shape, s_shape = _gathered_shapes(self._weight_shape(), layout, get_format(fmt).block_size)
            return torch.ops.mxmoe.gathered_as(d.q, d.s, d.tag, after, LAYOUT_IDS[layout], q_shape, s_shape,
                                               len(q_shape) == 2)
        elif traced:  # the scales through the tag's check: a graph that re-reads the buffers later
            # (a forward recomputed in the backward that FSDP2's state did not show) stops there
            q, s = d.q, torch.ops.mxmoe.gathered_scales(d.s, d.tag, LAYOUT_IDS[layout])
        else:
            q, s = d.q, d.s
        if layout == "dim1" and q.ndim == 2:  # gathered (N, K) / (N/bs, K): to_mx's storage is (K, N)
            q, s = q.t().contiguous(), s.t().contiguous()
        return q, s

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
        return ["_q", "_s", "_tag"], (self._weight_shape(), self.dtype, self.layout, self._fmt,
                                      self._transposed, self._cast_dtype, self._phase_layouts)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        shape, dtype, layout, fmt, transposed, cast_dtype, phase_layouts = meta
        return MXGatheredWeight(shape, dtype, inner["_q"], inner["_s"], layout, fmt, None, transposed,
                                cast_dtype=cast_dtype, phase_layouts=phase_layouts, tag=inner["_tag"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0]
        if func is torch.ops.mxmoe.gathered_weight.default:  # traced by torch.compile only
            return w._layout_data(args[1], args[2], traced=True, after=args[3])
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


def _gathered_shapes(weight_shape: tuple[int, ...], layout: str, bs: int) -> tuple[tuple, tuple]:
    """Shapes of the gathered (elements, scales) of `layout` for a weight (N, K) / (E, N, K)."""
    *e, n, k = weight_shape
    if layout == "dim0":
        return (*e, n, k), (*e, n, k // bs)
    return ((n, k), (n // bs, k)) if not e else ((*e, k, n), (*e, k, n // bs))


@torch.library.custom_op("mxmoe::gathered_weight", mutates_args=())
def gathered_weight(w: Tensor, axis: int, fmt: str, after: Tensor | None) -> tuple[Tensor, Tensor]:
    """(elements, scales) of an MXGatheredWeight's cast along `axis` in format `fmt`: what
    `gathered_mx` reads while torch.compile traces (MXGatheredWeight.__torch_dispatch__ answers it:
    the traced graph reads its buffers). Any other tensor: TypeError."""
    raise TypeError(f"mxmoe::gathered_weight reads an MXGatheredWeight, got a {type(w).__name__}")


@gathered_weight.register_fake
def _(w, axis, fmt, after):
    raise TypeError(f"mxmoe::gathered_weight reads an MXGatheredWeight, got a {type(w).__name__}")


def _check_tag(tag: Tensor, layout_id: int) -> None:
    """The buffers hold layout `layout_id` (every rank's tag says so): RuntimeError on CPU; on a GPU
    an asynchronous device-side assert (no host synchronization), fatal to the process."""
    name = [k for k, v in LAYOUT_IDS.items() if v == layout_id][0]
    msg = (f"a compiled graph read an MXFP8-gathered weight as {name} but the buffers hold another "
           "layout: the module's forward is recomputed in the backward (torch.utils.checkpoint inside "
           "it, which FSDP2's state does not show) or it is not resharded after the forward; wrap its "
           "checkpointing in a CheckpointWrapper inside the FSDP module, or turn off "
           "mx.fsdp_mxfp8_all_gather")
    ok = (tag == layout_id).all()
    if tag.device.type == "cpu":
        if not bool(ok):
            raise RuntimeError(msg)
    else:
        torch._assert_async(ok, msg)


@torch.library.custom_op("mxmoe::gathered_scales", mutates_args=())
def gathered_scales(s: Tensor, tag: Tensor, layout_id: int) -> Tensor:
    """A copy of gathered scales, once the layout tag says the buffers hold `layout_id` (the
    compiled forward's read: the elements are read as they are, the scales, 1/32 of the bytes,
    through this check)."""
    _check_tag(tag, layout_id)
    return s.clone()


@gathered_scales.register_fake
def _(s, tag, layout_id):
    return torch.empty_like(s)


@torch.library.custom_op("mxmoe::gathered_as", mutates_args=())
def gathered_as(
    q: Tensor, s: Tensor, tag: Tensor, after: Tensor, layout_id: int, q_shape: list[int],
    s_shape: list[int], transpose: bool,
) -> tuple[Tensor, Tensor]:
    """Copies of gathered buffers read with another layout's shapes (then each transposed, for a 2D
    weight's cast along N), once the layout tag says they hold `layout_id`: the backward's read of a
    compiled graph. `after` (not read) is a tensor of the backward, so that the graph cannot read
    the buffers before the backward's gather has refilled them."""
    _check_tag(tag, layout_id)
    q, s = q.reshape(q_shape), s.reshape(s_shape)
    return (q.t().contiguous(), s.t().contiguous()) if transpose else (q.clone(), s.clone())


@gathered_as.register_fake
def _(q, s, tag, after, layout_id, q_shape, s_shape, transpose):
    if transpose:
        q_shape, s_shape = q_shape[::-1], s_shape[::-1]
    return q.new_empty(q_shape), s.new_empty(s_shape)


def gathered_mx(w: Tensor, axis: int, recipe: MXRecipe, after: Tensor | None = None) -> MXTensor | None:
    """`w.mx(axis, recipe)` for an MXGatheredWeight, else None (the ops then cast w themselves).
    While torch.compile traces: through the `mxmoe::gathered_weight` op (dynamo does not trace a
    tensor subclass's Python methods); `after`: in a backward, a tensor of the backward (the
    gradient), which keeps the read of the backward's gather in the backward."""
    if not isinstance(w, MXGatheredWeight):
        return None
    if not torch.compiler.is_compiling():
        return w.mx(axis, recipe)
    q, s = torch.ops.mxmoe.gathered_weight(w, axis, recipe.fmt.name, after)
    return mx_tensor_trusted(q, s, q.ndim - 1 if axis == -1 else q.ndim - 2, recipe.block_size,
                             recipe.scaling_mode, w.dtype)
