"""The dispatch seam's inputs (issue 59, case 10): `LocalDispatcher.dispatch` (the default of every
MoE layer) checks them before any work, with an error naming the argument, the value received and
what is expected; and so does `routed_experts`, which every MoE layer runs. The expert-parallel
dispatcher's own checks, across ranks: tests/comm/test_dispatch_errors.py."""

from __future__ import annotations

import re

import pytest
import torch

from mxmoe.models.routing import routed_experts
from mxmoe.nn import GroupedExperts
from mxmoe.recipe import MXRecipe
from mxmoe.token_dispatch import UNQUANTIZED, ExpertRows, LocalDispatcher

T, D, K, E = 6, 64, 2, 4


def _inputs(d: int = D):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, d, generator=g)
    idx = torch.randint(0, E, (T, K), generator=g)
    scores = torch.rand(T, K, generator=g)
    return x, idx, scores


CASES = [  # (name, change to (x, idx, scores, num_experts, rows_as), error, message pieces)
    ("id out of range", lambda x, i, s: (x, i.clone().fill_(E), s, E, UNQUANTIZED), ValueError,
     ["idx holds expert id 4", "[0, num_experts=4)"]),
    ("negative id", lambda x, i, s: (x, torch.where(i == i[0, 0], -1, i), s, E, UNQUANTIZED), ValueError,
     ["idx holds expert id -1", "[0, num_experts=4)"]),
    ("float ids", lambda x, i, s: (x, i.float(), s, E, UNQUANTIZED), TypeError,
     ["idx has dtype torch.float32", "expected torch.int64"]),
    ("bool ids", lambda x, i, s: (x, i.bool(), s, E, UNQUANTIZED), TypeError, ["idx has dtype torch.bool"]),
    ("int32 ids", lambda x, i, s: (x, i.int(), s, E, UNQUANTIZED), TypeError, ["idx has dtype torch.int32"]),
    ("scores unlike idx", lambda x, i, s: (x, i, s[:, :1], E, UNQUANTIZED), ValueError,
     ["scores has shape (6, 1)", "idx's shape (6, 2)"]),
    ("1-D idx", lambda x, i, s: (x, i[:, 0], s, E, UNQUANTIZED), ValueError,
     ["idx has shape (6,)", "2-D (T, top_k)"]),
    ("3-D x", lambda x, i, s: (x.view(T, 2, D // 2), i, s, E, UNQUANTIZED), ValueError,
     ["x has shape (6, 2, 32)", "2-D (tokens T, dim D)"]),
    ("num_experts 0", lambda x, i, s: (x, i, s, 0, UNQUANTIZED), ValueError, ["num_experts=0", "int >= 1"]),
    ("num_experts float", lambda x, i, s: (x, i, s, 4.0, UNQUANTIZED), TypeError,
     ["num_experts=4.0 (float)", "int >= 1"]),
    ("num_experts below the ids", lambda x, i, s: (x, i.clone().fill_(3), s, 2, UNQUANTIZED), ValueError,
     ["idx holds expert id 3", "[0, num_experts=2)"]),
    ("MX rows, D not a multiple of 32", lambda x, i, s: (x[:, :40], i, s, E, ExpertRows(MXRecipe())),
     ValueError, ["D=40", "multiple of the block size 32"]),
]


@pytest.mark.parametrize("change,exc,pieces", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_local_dispatch_names_bad_input(change, exc, pieces):
    x, idx, scores, num_experts, rows_as = change(*_inputs())
    with pytest.raises(exc) as info:
        LocalDispatcher().dispatch(x, idx, scores, num_experts=num_experts, rows_as=rows_as)
    msg = str(info.value)
    assert msg.startswith("LocalDispatcher.dispatch: "), msg
    for p in pieces:
        assert p in msg, f"{p!r} not in {msg!r}"


def test_checked_at_dispatch_not_at_combine():
    """Scores unlike idx used to pass the dispatch and fail in combine; now routed_experts (every
    MoE layer) raises before running a single expert."""
    x, idx, scores = _inputs()
    calls = []

    class Experts(GroupedExperts):
        def forward(self, rows, counts):
            calls.append(rows.shape)
            return super().forward(rows, counts)

    experts = Experts(D, 32, E)
    with pytest.raises(ValueError, match=r"scores has shape \(6, 1\)"):
        routed_experts(x, idx, scores[:, :1], experts, E)
    assert calls == []


def test_combine_names_outputs_of_another_row_count():
    """combine(y) with y not one row per dispatched row: fewer rows failed with "index out of range
    in self", more were dropped without a word; both are a ValueError naming y and the count."""
    x, idx, scores = _inputs()
    d = LocalDispatcher()
    rows, _, h = d.dispatch(x, idx, scores, num_experts=E)
    for y in (rows[:-1], torch.cat([rows, rows[:1]]), rows.view(T * K, 2, D // 2)):
        shape = re.escape(str(tuple(y.shape)))
        with pytest.raises(ValueError, match=rf"^LocalDispatcher.combine: y has shape {shape}; "
                           rf"expected \({T * K}, D\): one output row per row the dispatch gave"):
            d.combine(y, h)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        d.combine(rows.tolist(), h)


def test_good_input_unchanged():
    """The checks change nothing of a valid dispatch: rows sorted by expert, counts, exact combine."""
    x, idx, scores = _inputs()
    d = LocalDispatcher()
    rows, counts, h = d.dispatch(x, idx, scores, num_experts=E)
    assert counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    order = torch.argsort(idx.reshape(-1), stable=True)
    assert torch.equal(rows, x.repeat_interleave(K, 0)[order])
    out = d.combine(rows, h)
    assert torch.equal(out, (x.unsqueeze(1) * scores.unsqueeze(-1)).sum(1))
    # the ids' range is checked where it costs no device sync: on the CPU here, skipped for CUDA
    # tensors (a device sync per layer); a caller may force it
    from mxmoe.token_dispatch import check_dispatch_args

    with pytest.raises(ValueError, match="expert id 4"):
        check_dispatch_args(x, idx.clone().fill_(E), scores, E, check_ids=True)
    check_dispatch_args(x, idx.clone().fill_(E), scores, E, check_ids=False)


def test_backward_is_gathers_not_index_add():
    """Rows move by gathers both ways, and so do their gradients: no index_add / index_put / scatter
    in the backward (the deterministic mode would run each as a sort and an ordered scatter; without
    it they add in the order atomics land). Gradients against a per-token loop written here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x, idx, scores = _inputs()
    x = x.to(torch.float64).requires_grad_()
    scores = scores.to(torch.float64).requires_grad_()
    w = torch.randn(E, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    d = LocalDispatcher()
    rows, counts, h = d.dispatch(x, idx, scores, num_experts=E)
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    out = d.combine(rows * w[expert_of_row], h)
    g = torch.randn_like(out)
    with Ops() as ops:
        out.backward(g)
    assert not {n for n in ops.names if "index_add" in n or "index_put" in n or "scatter" in n}, ops.names
    # oracle: out[t] = sum_j scores[t, j] * x[t] * w[idx[t, j]]
    gx = torch.zeros(T, D, dtype=torch.float64)
    gs = torch.zeros(T, K, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            gx[t] += scores[t, j].detach() * w[idx[t, j]] * g[t]
            gs[t, j] = (x[t].detach() * w[idx[t, j]] * g[t]).sum()
    # the combine sums in fp32: float64 inputs agree to fp32's precision
    torch.testing.assert_close(x.grad, gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.grad, gs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gathers_give_autograd_index_selects_bits(dtype):
    """The dispatch and combine with their gather backwards give the same bits (forward and every
    gradient; equal as values, so -0 and +0 alike) as the same gathers left to autograd, whose
    backward is index_add into zeros."""
    g = torch.Generator().manual_seed(3)
    T_, D_, K_, E_ = 40, 64, 3, 5
    x0 = torch.randn(T_, D_, generator=g).to(dtype)
    idx = torch.randint(0, E_, (T_, K_), generator=g)
    s0 = torch.rand(T_, K_, generator=g)
    w = torch.randn(E_, D_, generator=g).to(dtype)
    gout = torch.randn(T_, D_, generator=g).to(dtype)

    def ours():
        x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
        rows, counts, h = LocalDispatcher().dispatch(x, idx, s, num_experts=E_)
        out = LocalDispatcher().combine(rows * w[torch.repeat_interleave(torch.arange(E_), counts)], h)
        out.backward(gout)
        return out, x.grad, s.grad

    def autograd_gathers():
        x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
        perm = torch.argsort(idx.reshape(-1), stable=True)
        inv = torch.argsort(perm)
        rows = x.unsqueeze(1).expand(T_, K_, D_).reshape(T_ * K_, D_).index_select(0, perm)
        counts = torch.bincount(idx.reshape(-1), minlength=E_)
        y = rows * w[torch.repeat_interleave(torch.arange(E_), counts)]
        y = y.index_select(0, inv).view(T_, K_, D_).float()
        out = (y * s.unsqueeze(-1)).sum(1).to(dtype)
        out.backward(gout)
        return out, x.grad, s.grad

    for a, b in zip(ours(), autograd_gathers(), strict=True):
        assert torch.equal(a, b)
