"""tests/triton_interpreter.py: its speed-ups are installed with the pinned Triton (else the
interpreter tests silently run at the old speed) and change nothing a kernel sees."""

import numpy as np
import pytest

pytestmark = pytest.mark.interpreter


def test_every_speed_up_is_installed():
    from conftest import INTERPRETER_SPEED_UPS

    assert INTERPRETER_SPEED_UPS == ["block types", "numpy dtypes", "language patches"]


def test_memoized_types_are_the_types_triton_builds():
    from triton.language import core
    from triton.runtime import interpreter as ti

    a, b = core.block_type(core.float32, [4, 8]), core.block_type(core.float32, [core.constexpr(4), 8])
    assert a is not b and a == b and a.shape == [4, 8] and a.numel == 32 and str(a) == "<['4', '8'], fp32>"
    assert core.block_type(core.float32, [8, 4]) != a and core.block_type(core.int32, [4, 8]) != a
    ptr = core.block_type(core.pointer_type(core.float32), [16])
    assert ptr == core.block_type(core.pointer_type(core.float32), [16])
    assert ptr != core.block_type(core.pointer_type(core.float32, const=True), [16])
    assert ptr.element_ty == core.pointer_type(core.float32)
    t = core.tensor(None, a)
    assert [s.value for s in t.shape] == [4, 8] and t.numel.value == 32 and t.dtype == core.float32
    s = core.tensor(None, core.int32)
    assert len(s.shape) == 0 and s.numel.value == 1 and s.dtype == core.int32
    assert t.shape == [4, 8] and t.shape != [8, 4] and t.shape == core.tuple([4, 8])
    assert ti._get_np_dtype(a) == np.float32 and ti._get_np_dtype(ptr) == np.uint64
    assert ti._get_np_dtype(core.bfloat16) == np.uint16 and ti._get_np_dtype(core.int1) == np.bool_
    with pytest.raises(ValueError, match="power of 2"):  # the checks still run for new shapes
        core.block_type(core.float32, [3])
