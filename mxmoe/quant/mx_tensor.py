"""`MXTensor` and the public cast API: `to_mx`, `to_mx_dim0_dim1`.

Layout convention (docs/mx-format.md): an MXTensor quantized along `axis` *stores* its data with
that axis moved last, so every block of `block_size` elements is contiguous in memory:

    storage qdata: x.movedim(axis, -1).shape, contiguous
    storage scale: same with the last dim divided by block_size

`.qdata` and `.scale` are views with the *logical* shape (`qdata.shape == x.shape`, `scale.shape ==
x.shape` with `shape[axis] // block_size`), so `qdata[i, j]` is the element of `x[i, j]` whatever the
storage. `.qdata_blocked` / `.scale_blocked` give the storage itself, blocks contiguous (what GEMMs
and the all-to-all use). An MXTensor may also carry its scales swizzled (`scale_swizzled`: the
128x4 tiles torch's block-scaled GEMMs read, `mxmoe.quant.scale_layout`) beside them.

`MXTensor(...)` checks what it is given as `to_mx` checks its arguments (dtypes, shapes, axis, block
size, swizzled scales and offs); the casts and ops make theirs with `mx_tensor_trusted`, which
checks nothing. Its fields are read-only once it is made (they were checked together: another
`qdata_blocked`, `block_size` or `axis` alone would make the next op silently wrong): a changed one
is a new MXTensor, `dataclasses.replace(t, field=...)` (checked).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mxmoe.formats import (
    ELEM_FORMATS,
    INPUT_DTYPES,
    OUTPUT_DTYPES,
    SCALE_DTYPE,
    MXFormat,
    ScalingMode,
    check_block_size,
    check_elem_dtype,
    check_input_dtype,
    check_scaling_mode,
    format_of,
)
from mxmoe.quant import call_path
from mxmoe.quant import scale_layout as sl
from mxmoe.quant.backends import cast_kernel
from mxmoe.quant.checks import check_no_grad, check_x, checked_spec
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe, as_recipe


def _refuse_scale_layout(cls):
    """cls with an __init__ that refuses the `scale_layout` keyword of the old MXTensor, naming what
    replaced it (instead of Python's "unexpected keyword argument")."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        if "scale_layout" in kwargs:
            raise TypeError(
                f"MXTensor() takes no scale_layout (got scale_layout={kwargs['scale_layout']!r}): "
                "scale_blocked always holds the storage scales; pass swizzled ones as scale_swizzled= "
                "(with offs= for token groups), or make them with .to_scale_layout('swizzled', offs)"
            )
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_refuse_scale_layout
@dataclass(eq=False)
class MXTensor:
    """A tensor in MX format. `MXTensor(...)` checks its fields (TypeError / ValueError naming the
    field, its value and what is accepted); `mx_tensor_trusted` builds one without checks. The
    fields are read-only after that (assigning or deleting one is an AttributeError naming it;
    `dataclasses.replace(t, field=...)` makes a new, checked MXTensor).

    qdata_blocked: elem dtype, x.movedim(axis, -1).shape, contiguous.
    scale_blocked: e8m0 (`SCALE_DTYPE`), same shape with the last dim // block_size, contiguous.
    axis: the (non-negative) logical axis the blocks run along.
    orig_dtype: the dtype of the tensor that was quantized (default of `dequantize`).
    grad_anchor: optional zero-stride tensor of the logical shape (no memory) through which
        autograd routes the gradient of the dequantized value back to whatever produced this
        MXTensor (e.g. the MXFP8 dispatch). Ops that consume an MXTensor take it as their
        differentiable input and return the high-precision gradient for it.
    scale_swizzled: optional e8m0, the same scales swizzled for torch's block-scaled
        GEMMs (`to_scale_layout("swizzled")`; `mxmoe.quant.scale_layout`); None: not made.
    offs: with scale_swizzled of a grouped 2D tensor only: (E,) int32 cumulative ends of the token
        groups along the logical rows (the axis that is not blocked for a cast along dim 0, whose
        group ends are then multiples of block_size), each group swizzled on its own; else None.
    """

    qdata_blocked: Tensor
    scale_blocked: Tensor
    axis: int
    block_size: int = 32
    scaling_mode: str = "rceil"
    orig_dtype: torch.dtype = torch.bfloat16
    grad_anchor: Tensor | None = None
    scale_swizzled: Tensor | None = None
    offs: Tensor | None = None

    def __post_init__(self) -> None:
        """The public constructor's checks (`mx_tensor_trusted` skips them): TypeError / ValueError
        naming the argument, its value and what is accepted; scaling_mode normalized to its name."""
        if not torch.compiler.is_compiling():  # traced: mx_tensor_trusted's calls (see there)
            object.__setattr__(self, "scaling_mode", _check_fields(self))

    __hash__ = None  # (unhashable, as a dataclass of tensors)

    def __setattr__(self, name: str, value) -> None:
        """Each field is set once, as the MXTensor is made (the dataclass's `__init__`; torch.compile's
        rebuild of one made in a graph): after that, an AttributeError naming the field. Its fields
        were checked together (`_check_fields`), and one changed alone (another qdata_blocked of other
        dims, block_size, axis, scales) made later ops silently wrong."""
        if name in _FIELD_NAMES and name not in self.__dict__:
            object.__setattr__(self, name, value)
            return
        raise _read_only(name)

    def __delattr__(self, name: str) -> None:
        raise _read_only(name, "deleted")

    def __getstate__(self) -> dict:
        """Pickle state: the fields, the one-byte float tensors (elements, scales) as their bytes
        (uint8 views) with their dtypes under "_bytes_of". torch pickles a float8 tensor but cannot
        unpickle it (torch 2.13: "'UntypedStorage' has no attribute 'dtype'"); bytes it can."""
        state = dict(self.__dict__)
        dtypes = {}
        for k, v in self.__dict__.items():
            if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() == 1:
                state[k], dtypes[k] = v.view(torch.uint8), v.dtype
        state["_bytes_of"] = dtypes
        return state

    def __setstate__(self, state: dict) -> None:
        """The fields of `__getstate__`'s state, checked as `MXTensor(...)` checks them (a pickle, or
        a file `torch.load(..., weights_only=True)` reads, is an outside input)."""
        state = dict(state)
        for k, dtype in state.pop("_bytes_of", {}).items():
            state[k] = state[k].view(dtype)
        self.__dict__.update(state)
        self.__dict__["scaling_mode"] = _check_fields(self)

    def __deepcopy__(self, memo: dict) -> MXTensor:
        """A copy of every field (tensors deep-copied). RuntimeError naming the grad anchor when it is
        part of an autograd graph (e.g. the MXFP8 dispatch's output), which torch cannot deep-copy
        (it failed inside torch, with a hint about weight_norm)."""
        a = self.grad_anchor
        if isinstance(a, Tensor) and a.grad_fn is not None:
            raise RuntimeError(
                "deepcopy of an MXTensor whose grad_anchor is part of an autograd graph (its gradient goes "
                "back to what made it): torch deep-copies no such tensor. Copy it without the link, "
                "copy.deepcopy(dataclasses.replace(t, grad_anchor=None)), or use it as it is"
            )
        new = _new(MXTensor)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def __eq__(self, other):
        """Identity, as a dataclass of tensors compares; two distinct MXTensors have no `==` (the
        dataclass's failed with "Boolean value of Tensor ... is ambiguous"): TypeError naming what to
        compare instead."""
        if self is other:
            return True
        if not isinstance(other, MXTensor):
            return NotImplemented
        raise TypeError(
            "MXTensor has no ==: compare the storage with torch.equal(a.qdata_blocked, b.qdata_blocked) "
            "and torch.equal(a.scale_blocked, b.scale_blocked), or the values with "
            "torch.equal(a.dequantize(), b.dequantize())"
        )

    @property
    def ndim(self) -> int:
        return self.qdata_blocked.ndim

    @property
    def qdata(self) -> Tensor:
        """Elements with the logical shape of the original tensor (a view of the storage)."""
        return self.qdata_blocked.movedim(-1, self.axis)

    @property
    def scale(self) -> Tensor:
        """E8M0 scales, logical shape = x.shape with shape[axis] // block_size (a view of
        scale_blocked)."""
        return self.scale_blocked.movedim(-1, self.axis)

    @property
    def scale_layout(self) -> str:
        """"swizzled" when the tensor carries its scales swizzled too (`scale_swizzled`), else
        "plain"."""
        return "plain" if self.scale_swizzled is None else "swizzled"

    def plain_scale(self) -> Tensor:
        """The scales in the storage layout: qdata_blocked's shape with the last dim // block_size,
        contiguous (scale_blocked)."""
        return self.scale_blocked

    def to_scale_layout(self, scale_layout: str, offs: Tensor | None = None) -> MXTensor:
        """This tensor with its scales also swizzled ("swizzled"; offs: the token groups of a 2D
        tensor, as `to_mx` takes them) or without the swizzled copy ("plain"). Same elements, same
        storage scales, same grad anchor; self when nothing changes. offs is checked as `to_mx`
        checks it (a host read)."""
        _check_layout_offs(self, self.axis, scale_layout, offs, self.block_size, "MXTensor")
        return self._with_scale_layout(scale_layout, offs)

    def _with_scale_layout(self, scale_layout: str, offs: Tensor | None) -> MXTensor:
        """`to_scale_layout` of checked arguments (to_mx checked them)."""
        if scale_layout == self.scale_layout and (scale_layout == "plain" or offs is self.offs):
            return self
        swizzled = None
        if scale_layout == "swizzled":
            swizzled = _swizzled_scales(self.scale_blocked, self.axis, self.block_size, offs)
        else:
            offs = None
        return mx_tensor_trusted(
            self.qdata_blocked, self.scale_blocked, self.axis, self.block_size, self.scaling_mode,
            self.orig_dtype, self.grad_anchor, swizzled, offs,
        )

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        return self.qdata_blocked.dtype

    @property
    def fmt(self) -> MXFormat:
        """This tensor's format (elements, block size, scale rule) as the registered value."""
        return format_of(self.elem_dtype, self.block_size, self.scaling_mode)

    @property
    def device(self) -> torch.device:
        return self.qdata_blocked.device

    def to(self, device: torch.device | str | int | None = None, dtype=None, *, non_blocking: bool = False):
        """This tensor on `device`: a new MXTensor whose fields (elements, scales, swizzled scales,
        offs) are those tensors' `.to(device, non_blocking=non_blocking)`, the grad anchor made again
        there (zero-stride; its gradient goes back to the original's device). self where nothing
        moves (device None, or already there), as torch.Tensor.to returns self.

        Only the device changes: a dtype (here or as `device`) is a TypeError; `dequantize(dtype)`
        gives a high-precision tensor."""
        if dtype is not None or isinstance(device, torch.dtype):
            got = dtype if dtype is not None else device
            raise TypeError(
                f"MXTensor.to takes a device only, got dtype {got}: its elements stay in their MX format "
                f"({self.elem_dtype}); use .dequantize(dtype) for a high-precision tensor"
            )
        if device is None:
            return self
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"MXTensor.to: device={device!r} is not a device ({e})") from None
        fields = (self.qdata_blocked, self.scale_blocked, self.scale_swizzled, self.offs)
        moved = [None if t is None else t.to(device, non_blocking=non_blocking) for t in fields]
        if all(m is t for m, t in zip(moved, fields, strict=True)):
            return self
        anchor = self.grad_anchor
        if anchor is not None:
            anchor = _MoveAnchor.apply(anchor, moved[0].device)
        q, s, sw, offs = moved
        return mx_tensor_trusted(
            q, s, self.axis, self.block_size, self.scaling_mode, self.orig_dtype, anchor, sw, offs
        )

    def cpu(self) -> MXTensor:
        """`.to("cpu")`."""
        return self.to("cpu")

    def dequantize(self, dtype: torch.dtype | None = None, *, recipe: MXRecipe | None = None) -> Tensor:
        """High-precision tensor of the logical shape (a view: the storage order is kept), in `dtype`
        (torch.bfloat16 | torch.float32; default orig_dtype).

        recipe: whose dim0_kernel runs the dequantize (None: DEFAULT_RECIPE, "auto"); only the kernel
        is read, the format is this tensor's own (its elem dtype and block_size)."""
        dtype = self.orig_dtype if dtype is None else dtype
        if dtype not in OUTPUT_DTYPES:
            what = "an output dtype" if isinstance(dtype, torch.dtype) else "a torch.dtype"
            raise TypeError(f"dtype={dtype!r} is not {what}; expected torch.bfloat16 or torch.float32")
        if type(recipe) is not MXRecipe:  # (None, or one to check: a call only then)
            recipe = as_recipe(recipe)
        return self.dequantize_trusted(dtype, cast_kernel(recipe, self.qdata_blocked.device, "dequant"))

    def dequantize_trusted(self, dtype: torch.dtype, kernel: str) -> Tensor:
        """`dequantize` without checks, for the ops layer: dtype bf16/fp32, kernel concrete (from
        `cast_kernel`). Returns the logical shape (a view of a contiguous (.., K) result)."""
        q, sc = self.qdata_blocked, self.scale_blocked
        if q.ndim == 2:
            out = call_path.dequantize(q, sc, self.block_size, dtype, kernel)
            return out if self.axis == 1 else out.t()
        shape = tuple(q.shape)
        rows = _rows(shape, 1)
        q2, s2 = q.view(rows, shape[-1]), sc.view(rows, sc.shape[-1])
        out = call_path.dequantize(q2, s2, self.block_size, dtype, kernel)
        return out.view(*shape).movedim(-1, self.axis)

    def index_rows(self, index: Tensor) -> MXTensor:
        """Rows `index` (int64, 1D) of a dim0-quantized 2D MXTensor, keeping the grad anchor."""
        if self.ndim != 2 or self.axis != 1:
            raise ValueError("index_rows needs a 2D MXTensor quantized along axis=-1")
        if self.scale_swizzled is not None:
            raise ValueError("index_rows needs a tensor without swizzled scales (scale_layout='plain')")
        anchor = self.grad_anchor
        if anchor is not None:
            anchor = _IndexAnchor.apply(anchor, index)
        return mx_tensor_trusted(
            self.qdata_blocked.index_select(0, index),
            self.scale_blocked.index_select(0, index),
            self.axis,
            self.block_size,
            self.scaling_mode,
            self.orig_dtype,
            anchor,
        )

    def __repr__(self) -> str:
        return (
            f"MXTensor(shape={tuple(self.shape)}, axis={self.axis}, elem={self.elem_dtype}, "
            f"block_size={self.block_size}, scaling_mode={self.scaling_mode!r})"
        )


def mx_tensor_trusted(
    qdata_blocked: Tensor,
    scale_blocked: Tensor,
    axis: int,
    block_size: int,
    scaling_mode: str,
    orig_dtype: torch.dtype,
    grad_anchor: Tensor | None = None,
    scale_swizzled: Tensor | None = None,
    offs: Tensor | None = None,
) -> MXTensor:
    """`MXTensor(...)` without its checks, for the code that made qdata and scales itself (the casts,
    the ops, the all-to-all): the caller guarantees what `MXTensor` would check."""
    if torch.compiler.is_compiling():
        # Dynamo (torch 2.11) cannot trace object.__new__; the dataclass constructor traces, and
        # its checks are skipped while tracing (they ran on the eager calls). Removable once
        # mxmoe's oldest torch traces object.__new__ (tests/quant/test_cast_compile.py says so).
        return MXTensor(
            qdata_blocked, scale_blocked, axis, block_size, scaling_mode, orig_dtype, grad_anchor,
            scale_swizzled, offs,
        )
    t = _new(MXTensor)
    # the fields straight into the new object's __dict__ (MXTensor.__setattr__ is Python code: nine
    # calls of it would cost the casts' hot path more than this one update)
    t.__dict__.update(
        qdata_blocked=qdata_blocked,
        scale_blocked=scale_blocked,
        axis=axis,
        block_size=block_size,
        scaling_mode=scaling_mode,
        orig_dtype=orig_dtype,
        grad_anchor=grad_anchor,
        scale_swizzled=scale_swizzled,
        offs=offs,
    )
    return t


_new = object.__new__
_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(MXTensor))


def _read_only(name: str, done: str = "assigned") -> AttributeError:
    """The error of assigning or deleting (`done`) attribute `name` of a made MXTensor."""
    if name in ("qdata", "scale"):
        what = f"MXTensor.{name} is a view of {name}_blocked (the storage) and cannot be {done}"
        fix = f"dataclasses.replace(t, {name}_blocked=...) with the storage tensor"
    elif name in _FIELD_NAMES:
        what = f"MXTensor.{name} cannot be {done}"
        fix = f"dataclasses.replace(t, {name}=...)"
    else:
        fields = ", ".join(f.name for f in dataclasses.fields(MXTensor))
        what = f"MXTensor has no field {name!r} ({fields}) and takes no other attribute"
        fix = "dataclasses.replace(t, field=...)"
    return dataclasses.FrozenInstanceError(
        f"{what}: an MXTensor's fields are read-only, checked together when it was made (one changed "
        "alone, such as another qdata_blocked, scale_blocked, axis or block_size, would make later ops "
        f"silently wrong); make a new MXTensor: {fix} (checked as MXTensor(...) checks) or mxmoe.to_mx "
        "of the new values"
    )


def _check_fields(t: MXTensor) -> str:
    """The checks of `MXTensor(...)` (see its docstring for what each field holds); returns the
    scaling mode's name."""
    q, s, bs, axis = t.qdata_blocked, t.scale_blocked, t.block_size, t.axis
    elems = [str(d) for d in ELEM_FORMATS]
    if not isinstance(q, Tensor) or q.dtype not in ELEM_FORMATS:
        got = q.dtype if isinstance(q, Tensor) else type(q).__name__
        raise TypeError(
            f"qdata_blocked is {got}; expected a tensor of an MX element dtype, one of {elems} (bytes "
            "of one: .view(torch.float8_e4m3fn))"
        )
    if not isinstance(s, Tensor) or s.dtype != SCALE_DTYPE:
        got = s.dtype if isinstance(s, Tensor) else type(s).__name__
        raise TypeError(f"scale_blocked is {got}; expected a {SCALE_DTYPE} tensor")
    if q.ndim < 1 or not q.is_contiguous() or not s.is_contiguous():
        raise ValueError(
            f"qdata_blocked {tuple(q.shape)} and scale_blocked {tuple(s.shape)} must be contiguous tensors "
            "of at least one dim (the storage: blocks run along the last dim)"
        )
    if s.device != q.device:
        raise ValueError(f"scale_blocked is on {s.device}, qdata_blocked on {q.device}: they must share one")
    check_block_size(bs)
    mode = check_scaling_mode(t.scaling_mode).value
    nd = q.ndim
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (nd - 1, nd - 2) or axis < 0:
        axes = [nd - 1] if nd == 1 else [nd - 2, nd - 1]
        raise ValueError(
            f"axis={axis!r}: expected one of {axes}, the non-negative logical axis of a {nd}D tensor that "
            "the blocks run along (one of the last two)"
        )
    if t.orig_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"orig_dtype={t.orig_dtype!r}: expected torch.bfloat16 or torch.float32")
    if q.shape[-1] % bs:
        raise ValueError(
            f"qdata_blocked {tuple(q.shape)}: its last dim {q.shape[-1]} is not divisible by block_size={bs}"
        )
    want = (*q.shape[:-1], q.shape[-1] // bs)
    if tuple(s.shape) != want:
        raise ValueError(
            f"scale_blocked has shape {tuple(s.shape)}; expected {want}: one scale per block_size={bs} "
            f"elements of qdata_blocked {tuple(q.shape)} in the storage layout (swizzled scales go in "
            "scale_swizzled)"
        )
    a = t.grad_anchor
    if a is not None and (not isinstance(a, Tensor) or a.shape != t.qdata.shape or a.device != q.device):
        got = f"{tuple(a.shape)} on {a.device}" if isinstance(a, Tensor) else type(a).__name__
        raise ValueError(
            f"grad_anchor is {got}; expected None or a tensor of the logical shape {tuple(t.qdata.shape)} "
            f"on {q.device}"
        )
    _check_swizzled(t)
    return mode


def _check_swizzled(t: MXTensor) -> None:
    """`MXTensor(...)`'s checks of scale_swizzled and offs (the other fields already checked): dtype,
    device and shape, offs as `to_mx` checks it, and the bytes those of scale_blocked swizzled (a
    block-scaled GEMM reads only scale_swizzled: other bytes would be a silently wrong product)."""
    q, s, sw, offs = t.qdata_blocked, t.scale_blocked, t.scale_swizzled, t.offs
    if sw is None:
        if offs is not None:
            raise ValueError(
                "offs groups the swizzled scales; pass scale_swizzled with it (or make both with "
                ".to_scale_layout('swizzled', offs))"
            )
        return
    if not isinstance(sw, Tensor) or sw.dtype != SCALE_DTYPE:
        got = f"{type(sw).__name__} {sw!r}" if not isinstance(sw, Tensor) else sw.dtype
        raise TypeError(
            f"scale_swizzled is {got}; expected None or a {SCALE_DTYPE} tensor, the scales in "
            "the swizzled layout (it replaced the scale_layout argument: .to_scale_layout('swizzled') "
            "makes them)"
        )
    if q.ndim < 2:
        raise ValueError(f"scale_swizzled needs qdata_blocked of at least 2 dims, got {tuple(q.shape)}")
    if not sw.is_contiguous() or sw.device != q.device:
        raise ValueError(
            f"scale_swizzled must be a contiguous tensor on qdata_blocked's device {q.device}, got one on "
            f"{sw.device}{'' if sw.is_contiguous() else ' (not contiguous)'}"
        )
    if offs is not None:
        _check_layout_offs(t.qdata, t.axis, "swizzled", offs, t.block_size)
    rows, cols = s.shape[-2:]
    R, C = sl.swizzled_shape(rows, cols)
    if offs is None:
        want = (*q.shape[:-2], R, C)
    else:  # every group's scales swizzled on their own (scale_layout's module docstring)
        groups = offs.shape[0]
        want = (rows + 128 * groups, C) if t.axis == 1 else (R, cols + 4 * groups)
    if tuple(sw.shape) != want:
        grouped = f" in {offs.shape[0]} token groups (offs)" if offs is not None else ""
        raise ValueError(
            f"scale_swizzled has shape {tuple(sw.shape)}; expected {want}: scale_blocked "
            f"{tuple(s.shape)} in the swizzled layout{grouped}"
        )
    made = _swizzled_scales(s, t.axis, t.block_size, offs)
    if not torch.equal(sw.view(torch.uint8), made.view(torch.uint8)):
        raise ValueError(
            "scale_swizzled is not scale_blocked in the swizzled layout (padding zero); pass None and "
            "call .to_scale_layout('swizzled', offs) to make it"
        )


def _swizzled_scales(scale: Tensor, axis: int, block_size: int, offs: Tensor | None) -> Tensor:
    """Storage scales -> the swizzled layout (`mxmoe.quant.scale_layout`; per token group with offs)."""
    if offs is None:
        return sl.to_swizzled(scale)
    if axis == 1:
        return sl.to_swizzled_m_groups(scale, offs)
    return sl.to_swizzled_k_groups(scale, offs // block_size)


def _check_layout_offs(x, ax: int, scale_layout: str, offs, block_size: int, name: str = "x") -> None:
    """The scale_layout / offs arguments of to_mx, to_mx_dim0_dim1 and MXTensor.to_scale_layout
    (x: the Tensor, or the MXTensor, called `name` in messages; ax: the non-negative axis or None for
    both casts)."""
    sl.check_scale_layout(scale_layout)
    if scale_layout == "swizzled" and x.ndim < 2:
        raise ValueError(
            f"scale_layout='swizzled' needs {name} of at least 2 dims (the swizzled tiles are 128 rows by 4 "
            f"scales), got shape {tuple(x.shape)}"
        )
    if offs is None:
        return
    if scale_layout != "swizzled":
        raise ValueError("offs groups the swizzled scales; pass scale_layout='swizzled' with it")
    if x.ndim != 2:
        raise ValueError(f"offs needs a 2D {name} (tokens, features), got shape {tuple(x.shape)}")
    if not isinstance(offs, Tensor) or offs.ndim != 1 or offs.dtype != torch.int32 or offs.numel() == 0:
        raise ValueError(f"offs must be a non-empty 1D int32 tensor of cumulative group ends, got {offs!r}")
    if offs.device != x.device:
        raise ValueError(f"offs is on {offs.device} but {name} on {x.device}; they must share a device")
    ends = offs.tolist()  # (the public API checks them once; the ops pass trusted offs)
    if any(b < a for a, b in zip([0, *ends], ends, strict=False)) or ends[-1] > x.shape[0]:
        raise ValueError(f"offs={ends} must be non-decreasing group ends <= {name}.shape[0]={x.shape[0]}")
    if ax != 1 and any(e % block_size for e in ends):
        raise ValueError(
            f"offs={ends}: a cast along dim 0 with grouped swizzled scales needs every group end a "
            f"multiple of block_size={block_size} (a block must not straddle two groups)"
        )


# torch.load(..., weights_only=True) takes an MXTensor (as torchao allowlists its tensor classes): its
# state is tensors, ints, a str and dtypes, which that unpickler takes, checked by __setstate__
torch.serialization.add_safe_globals([MXTensor])


def make_grad_anchor(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero-stride tensor of `shape` (one element of memory) to carry a gradient."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _IndexAnchor(torch.autograd.Function):
    """Row gather of a grad anchor: forward stays zero-stride, backward scatters the gradient."""

    @staticmethod
    def forward(ctx, anchor: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = anchor.shape[0]
        return make_grad_anchor((index.numel(), *anchor.shape[1:]), anchor.dtype, anchor.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_add_(0, index, grad), None


class _MoveAnchor(torch.autograd.Function):
    """A grad anchor made again on another device (zero-stride there too); backward: the gradient
    back on the original's device."""

    @staticmethod
    def forward(ctx, anchor: Tensor, device: torch.device) -> Tensor:
        ctx.device = anchor.device
        return make_grad_anchor(anchor.shape, anchor.dtype, device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.device), None


def _rows(shape: torch.Size, trailing: int) -> int:
    """Product of all but the last `trailing` dims: an explicit leading size for reshape, which
    cannot infer -1 when a trailing dim is 0."""
    return math.prod(shape[: len(shape) - trailing])


def _check_recipe_only(recipe, scaling_mode, elem_dtype, block_size) -> None:
    """to_mx's and to_mx_dim0_dim1's recipe beside format arguments: each one given (not None) is
    checked and must equal the recipe's own (ValueError naming both values where they differ)."""
    if not isinstance(recipe, MXRecipe):
        hint = f" (mxmoe.recipe({recipe!r}) makes one)" if isinstance(recipe, str) else ""
        raise TypeError(f"recipe must be an mxmoe.MXRecipe, got {type(recipe).__name__}{hint}")
    if scaling_mode is None and elem_dtype is None and block_size is None:
        return  # nothing given besides the recipe: the common case, checked cheaply
    differ = []
    mode = None if scaling_mode is None else check_scaling_mode(scaling_mode).value
    if mode is not None and mode != recipe.scaling_mode:
        differ.append(f"scaling_mode={mode!r} but recipe.scaling_mode={recipe.scaling_mode!r}")
    if elem_dtype is not None:
        check_elem_dtype(elem_dtype)
        if elem_dtype != recipe.elem_dtype:
            differ.append(f"elem_dtype={elem_dtype} but recipe.elem_dtype={recipe.elem_dtype}")
    if block_size is not None and check_block_size(block_size) != recipe.block_size:
        differ.append(f"block_size={block_size!r} but recipe.block_size={recipe.block_size}")
    if differ:
        raise ValueError(
            f"{'; '.join(differ)}: the recipe holds the format; pass the recipe alone, or arguments that "
            "agree with it"
        )


def _format_args(block_size, scaling_mode, elem_dtype) -> tuple:
    """The format arguments of a cast without a recipe, None the default format's (DEFAULT_RECIPE's)."""
    r = DEFAULT_RECIPE
    return (
        r.block_size if block_size is None else block_size,
        r.scaling_mode if scaling_mode is None else scaling_mode,
        r.elem_dtype if elem_dtype is None else elem_dtype,
    )


def to_mx(
    x: Tensor,
    axis: int = -1,
    scaling_mode: str | ScalingMode | None = None,
    elem_dtype: torch.dtype | None = None,
    block_size: int | None = None,
    *,
    recipe: MXRecipe | None = None,
    scale_layout: str = "plain",
    offs: Tensor | None = None,
) -> MXTensor:
    """Quantize x (bf16 or fp32, any shape with ndim >= 1) to MX along `axis`, one of the last two
    dims (-1: "dim0" cast, -2 / 0 of 2D: "dim1"); x.shape[axis] % block_size == 0.

    Returns an MXTensor whose storage is `x.movedim(axis, -1)` made contiguous: qdata_blocked in
    `elem_dtype` of that shape, scale_blocked e8m0 with the last dim // block_size
    (docs/mx-format.md, Layouts). Any input layout is accepted: if x already has `axis` innermost
    in memory (e.g. a transposed view) it is quantized without a copy; otherwise the dim1 kernel
    reads it row-major.

    scaling_mode, elem_dtype, block_size: the format; None: the recipe's, or without a recipe the
    default format's ("rceil", torch.float8_e4m3fn, 32).
    recipe: an `MXRecipe`; when given it supplies scaling_mode, elem_dtype and block_size (any of
    them also given must equal the recipe's: a ValueError names both values otherwise). The cast
    kernel comes from the recipe only (its dim0_kernel for a cast along the last dim, its
    dim1_kernel otherwise; chosen by `mxmoe.quant.backends.cast_kernel`); without a recipe it is
    "auto".
    scale_layout: "plain" (above) or "swizzled": the scales also in the layout of Blackwell's
    block-scaled GEMMs (`scale_swizzled`, torchao's swizzled scales), rearranged after the cast by
    a torch pass (every cast kernel writes the storage layout). ("blocked" is refused, naming
    "swizzled": in mxmoe it names only the storage with blocks contiguous.)
    offs: with "swizzled" and a 2D x (tokens, features) only: (E,) int32 cumulative ends of the
    token groups along dim 0 (the rows of a cast along the last dim; for a cast along dim 0 every
    end a multiple of the block size), each group's scales swizzled on their own as
    torch._scaled_grouped_mm takes them. Checked here with a host read.
    """
    if recipe is not None:
        # (the common call, a recipe alone with plain scales, costs no call of the checks that
        # would find nothing: each Python call is a tenth of a µs or more of host time)
        if type(recipe) is not MXRecipe or not (scaling_mode is elem_dtype is block_size is None):
            _check_recipe_only(recipe, scaling_mode, elem_dtype, block_size)
        bs = recipe.block_size
        ax = check_x(x, bs, axis)
        if scale_layout != "plain" or offs is not None:
            _check_layout_offs(x, ax, scale_layout, offs, bs)
        out = _cast(x, ax, recipe.fmt.spec, recipe)  # (mx_cast's body)
    else:
        spec = checked_spec(*_format_args(block_size, scaling_mode, elem_dtype))
        ax = check_x(x, spec.block_size, axis)
        _check_layout_offs(x, ax, scale_layout, offs, spec.block_size)
        out = _cast(x, ax, spec, DEFAULT_RECIPE)  # the format given, the default ("auto") kernels
    return out if scale_layout == "plain" else out._with_scale_layout(scale_layout, offs)


def mx_cast(x: Tensor, ax: int, recipe: MXRecipe) -> MXTensor:
    """`to_mx(x, ax, recipe=recipe)` without checks: the fast entry for the ops layer.

    The caller guarantees what `to_mx` would check: x is a bf16/fp32 tensor that does not need a
    gradient here (grad mode off or x detached), `ax` is x.ndim - 1 or x.ndim - 2 (non-negative),
    x.shape[ax] % recipe.block_size == 0; `recipe` is an MXRecipe (checked when it was made).
    Returns the same MXTensor as `to_mx`, bit for bit."""
    return _cast(x, ax, recipe.fmt.spec, recipe)


# ScalingMode -> its name (an enum's `.value` is a Python property: 0.1 µs, a dict lookup 0.02)
_MODE_NAMES = {m: m.value for m in ScalingMode}


def _cast(x: Tensor, ax: int, spec, recipe: MXRecipe) -> MXTensor:
    """x cast in format `spec` with the kernels `recipe` names (its format fields are not read)."""
    # The backends take and return the final shapes ((..., C) along the last dim, (..., R, C) ->
    # (..., C, R) along dim -2), so no reshape runs here: each Tensor.view costs about a µs of host time.
    nd = x.ndim
    if ax == nd - 1:
        q, s = call_path.quantize_dim0(x.contiguous(), spec, cast_kernel(recipe, x.device, "dim0"))
    elif x.is_contiguous() and (nd == 2 or x.shape[-1] != 1):
        # row-major with blocks along dim -2 (no transpose of x is contiguous): the transposing kernel
        q, s = call_path.quantize_dim1(x, spec, cast_kernel(recipe, x.device, "dim1"))
    else:
        xt = x.transpose(-2, -1)
        # blocks innermost in memory (e.g. x is a transposed view): the dim0 cast of that transpose,
        # without a copy; 2D asks for exact strides (is_contiguous ignores those of size-1 dims)
        if (xt.stride(-1) == 1 and xt.stride(-2) == x.shape[-2]) if nd == 2 else xt.is_contiguous():
            q, s = call_path.quantize_dim0(xt, spec, cast_kernel(recipe, x.device, "dim0"))
        else:
            q, s = call_path.quantize_dim1(x.contiguous(), spec, cast_kernel(recipe, x.device, "dim1"))
    return mx_tensor_trusted(q, s, ax, spec.block_size, _MODE_NAMES[spec.mode], x.dtype)


def to_mx_dim0_dim1(
    x: Tensor,
    scaling_mode: str | ScalingMode | None = None,
    elem_dtype: torch.dtype | None = None,
    block_size: int | None = None,
    *,
    recipe: MXRecipe | None = None,
    scale_layout: str = "plain",
    offs: Tensor | None = None,
) -> tuple[MXTensor, MXTensor]:
    """Both casts of a 2D x (R, C), bf16 or fp32, R and C divisible by block_size, from one read.

    Returns (along dim -1: storage qdata (R, C), scale (R, C // bs); along dim 0: storage qdata
    (C, R), scale (C, R // bs)), elements in `elem_dtype`, scales e8m0, all contiguous.
    scaling_mode, elem_dtype, block_size, recipe: as in `to_mx` (the fused cast runs the recipe's
    dim1_kernel; without a recipe "auto").
    scale_layout, offs: as in `to_mx`, for both results (offs: token groups along R).
    """
    if recipe is not None:
        if type(recipe) is not MXRecipe or not (scaling_mode is elem_dtype is block_size is None):
            _check_recipe_only(recipe, scaling_mode, elem_dtype, block_size)
        spec = recipe.fmt.spec
    else:
        spec = checked_spec(*_format_args(block_size, scaling_mode, elem_dtype))
        recipe = DEFAULT_RECIPE  # its ("auto") kernels; the format is `spec`
    if not isinstance(x, Tensor) or x.dtype not in INPUT_DTYPES:
        check_input_dtype("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2D for the fused dim0+dim1 cast, got shape {tuple(x.shape)}")
    R, C = x.shape
    bs = spec.block_size
    if R % bs or C % bs:
        ax, n = (0, R) if R % bs else (1, C)
        raise ValueError(f"x.shape[{ax}]={n} is not divisible by block_size={bs}")
    if x.requires_grad:
        check_no_grad(x)
    if scale_layout != "plain" or offs is not None:
        _check_layout_offs(x, None, scale_layout, offs, bs)
    d0, d1 = _cast_dim0_dim1(x, spec, recipe)
    if scale_layout == "plain":
        return d0, d1
    return d0._with_scale_layout(scale_layout, offs), d1._with_scale_layout(scale_layout, offs)


def mx_cast_dim0_dim1(x: Tensor, recipe: MXRecipe) -> tuple[MXTensor, MXTensor]:
    """`to_mx_dim0_dim1(x, recipe=recipe)` without checks: the fast entry for the ops layer.
    The caller guarantees x is a 2D bf16/fp32 tensor (no gradient wanted here) with both dims
    divisible by recipe.block_size."""
    spec = recipe.fmt.spec
    return _cast_dim0_dim1(x, spec, recipe)


def _cast_dim0_dim1(x: Tensor, spec, recipe: MXRecipe) -> tuple[MXTensor, MXTensor]:
    k = cast_kernel(recipe, x.device, "dim0_dim1")
    q0, s0, q1, s1 = call_path.quantize_dim0_dim1(x.contiguous(), spec, k)
    bs, mode = spec.block_size, _MODE_NAMES[spec.mode]
    return (
        mx_tensor_trusted(q0, s0, 1, bs, mode, x.dtype),
        mx_tensor_trusted(q1, s1, 0, bs, mode, x.dtype),
    )
