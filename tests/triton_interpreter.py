"""Faster Triton interpreter for the CPU tests: the same launches and results, less of its Python.

Under TRITON_INTERPRET=1 (a CPU host) most of an interpreted kernel's time is Triton's own Python:
every `tl` operation on a block builds new type objects (a `block_type`, whose shape is a
`tl.tuple` of `constexpr_type`s, and a tensor whose shape is another `tl.tuple` of constexprs),
and every NumPy conversion rebuilds a dtype table. `speed_up()` memoizes what is rebuilt the same
each time, and stops the re-patching of triton.language at every helper call:

- `block_type(element_ty, shape)`: the attributes of the first instance built for an (element
  type, int shape) pair are copied into later ones (an instance's attributes are never changed);
  the constexpr shape tuple that every tensor of that type gets is built once with them;
- `tensor.__init__` of a block type built so: that tuple instead of a new one;
- `interpreter._get_np_dtype`: a lookup instead of a dict literal per call;
- `interpreter._patch_lang` (`_patch_the_language_once_per_launch`).

The kernels, their launches and everything they compute are unchanged: the interpreted cast, qdq
and exchange kernels' tests compare bit for bit against the oracle as before. Where the interpreter
lacks one of these internals (another Triton version) that speed-up is skipped.
"""

from __future__ import annotations

import builtins
import inspect


def speed_up() -> list[str]:
    """Install what this Triton has the internals for; returns their names."""
    try:
        from triton.language import core
        from triton.runtime import interpreter as ti
    except ImportError:
        return []
    done = []
    for name, fn in (
        ("block types", _memoize_block_types),
        ("numpy dtypes", _memoize_np_dtypes),
        ("language patches", _patch_the_language_once_per_launch),
    ):
        if fn(core, ti):
            done.append(name)
    return done


def _memoize_block_types(core, ti) -> bool:
    needed = ("block_type", "pointer_type", "tensor", "tuple", "constexpr", "base_value")
    if not all(hasattr(core, n) for n in needed) or getattr(core.block_type, "_mxmoe_memo", False):
        return False
    build_block_type, build_tensor = core.block_type.__init__, core.tensor.__init__
    if list(inspect.signature(build_tensor).parameters) != ["self", "handle", "type"]:
        return False
    known: dict = {}  # (element type, int dims) -> the first instance's attributes

    def block_type_init(self, element_ty, shape):
        # pointer types compare (and are hashed here) by their fields
        ty = element_ty
        if type(ty) is core.pointer_type:
            ty = ("pointer", ty.element_ty, ty.address_space, ty.const)
        try:
            key = (type(element_ty), ty, builtins.tuple(shape.values if type(shape) is core.tuple else shape))
            attrs = known.get(key)
        except TypeError:  # an unhashable element type, or no sequence: built as before
            attrs = key = None
        if attrs is not None:
            self.__dict__.update(attrs)
            return
        build_block_type(self, element_ty, shape)
        if key is not None and all(type(d) is int for d in key[2]):  # only int shapes are remembered
            attrs = dict(self.__dict__)
            attrs["_mxmoe_tensor_shape"] = core.tuple([core.constexpr(s) for s in self.shape])
            known[key] = attrs

    scalar_shape = core.tuple([])

    def tensor_init(self, handle, type):
        shape = getattr(type, "_mxmoe_tensor_shape", None)
        if shape is None:
            if type.is_block():
                build_tensor(self, handle, type)
                return
            shape = scalar_shape  # a scalar's shape: (), the same for all
        # what tensor.__init__ sets for a block type, with the shape tuple built once
        core.base_value.__init__(self)
        self.handle = handle
        self.numel = core.constexpr(type.numel if shape is not scalar_shape else 1)
        self.type = type
        self.dtype = type.scalar
        self.shape = shape

    compare_tuple = core.tuple.__eq__

    def tuple_eq(self, other):
        # a shape compared with a list of ints (broadcasting does at every binary op) without first
        # building a tl.tuple of the list
        if isinstance(other, (list, builtins.tuple)):
            return core.constexpr(self.values == list(other))
        return compare_tuple(self, other)

    core.block_type.__init__ = block_type_init
    core.tensor.__init__ = tensor_init
    core.tuple.__eq__ = tuple_eq
    core.block_type._mxmoe_memo = True
    return True


def _memoize_np_dtypes(core, ti) -> bool:
    get = getattr(ti, "_get_np_dtype", None)
    if get is None or getattr(get, "_mxmoe_memo", False):
        return False
    known: dict = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, core.block_type) else tt_dtype
        try:
            return known[key]
        except KeyError:
            known[key] = found = get(tt_dtype)
            return found
        except TypeError:  # unhashable: not a type the table knows
            return get(tt_dtype)

    np_dtype._mxmoe_memo = True
    ti._get_np_dtype = np_dtype
    return True


def _patch_the_language_once_per_launch(core, ti) -> bool:
    """Triton's interpreter (3.x) patches triton.language's builtins into interpreted ones when a
    launch starts (restoring them when it ends), and again at every call of a @triton.jit helper
    inside the kernel (`_patch_lang`, a walk of the modules with `inspect.getmembers`): the same
    modules, with equivalent functions, over and over (our kernels call helpers, and tl.max/tl.sum,
    in loops). Here a helper's call patches only the modules the running launch has not patched yet
    (tl.core, say, for tl.max); as before, what a helper's call patched stays patched. Launches are
    unchanged."""
    if not all(hasattr(ti, n) for n in ("_patch_lang", "_LangPatchScope", "tl")):
        return False
    interpreter_patch = ti._patch_lang
    if getattr(interpreter_patch, "_mxmoe_memo", False):
        return False
    patched: set[int] = set()  # the modules patched since the running launch started (empty: none runs)

    def patch_lang(fn):
        mods = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (ti.tl, ti.tl.core)}
        if patched and mods <= patched:  # a helper's call inside a launch: nothing new to patch
            return ti._LangPatchScope()
        launch = not patched  # helpers are only called inside a launch: the first call is the launch's
        scope = interpreter_patch(fn)
        patched.update(mods)
        if launch:
            restore = scope.restore

            def restore_and_end() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_end
        return scope

    patch_lang._mxmoe_memo = True
    ti._patch_lang = patch_lang
    return True
