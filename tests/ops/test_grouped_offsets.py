"""`mx_grouped_mm`'s group ends (offs) are checked: negative, decreasing or past the rows of `a` is
a ValueError naming offs (once uncovered rows came out as zeros); ends below the rows stay
accepted (torch._grouped_mm's contract, torchtitan's padded token buffer)."""

import pytest
import torch

from mxmoe.ops import check_offsets, mx_grouped_mm, mx_grouped_mm_shared


def _operands(rows: int = 64, experts: int = 3):
    torch.manual_seed(0)
    return torch.randn(rows, 64), torch.randn(experts, 32, 64).transpose(-2, -1)


@pytest.mark.parametrize(
    "ends, message",
    [
        ([10, -5, 30], r"offs\[1\]=-5: expected group ends >= 0"),
        ([30, 20, 64], r"offs\[1\]=20 < offs\[0\]=30: expected non-decreasing cumulative group ends"),
        ([10, 20, 65], r"offs\[-1\]=65 is past the 64 rows of a: expected group ends <= 64"),
    ],
)
def test_bad_offsets_are_refused_naming_them(ends, message):
    a, b_t = _operands()
    offs = torch.tensor(ends, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        mx_grouped_mm(a, b_t, offs)
    with pytest.raises(ValueError, match=message):
        mx_grouped_mm_shared(a, [b_t, b_t], offs)
    with pytest.raises(ValueError, match=message):
        check_offsets(offs, 64)


def test_ends_below_the_rows_stay_accepted_and_give_zeros():
    a, b_t = _operands()
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    y = mx_grouped_mm(a, b_t, offs)
    assert y.shape == (64, 32) and bool((y[40:] == 0).all()) and bool((y[:40] != 0).any())
    check_offsets(offs, 64)
