"""MXFP8 all-to-all on gloo/CPU: bit-exact against the reference, forward and backward, for 1, 2
and 4 ranks, uneven/zero splits, chunked and simple paths, and every error case raising on every
rank. Many checks share one process launch (spawning costs seconds on a busy machine)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, free_port, spawn_ranks

from mxmoe.comm import (
    a2a_combine,
    a2a_dispatch_mxfp8,
    a2a_unquantized,
    dequantize_into,
    qdq_into,
    reference_mxfp8_a2a,
    to_mxfp8_a2a_dequant,
)
from mxmoe.comm.a2a import all_to_all_rows
from mxmoe.quant import custom_ops
from mxmoe.recipe import MXRecipe, recipe

# Recipes other than the default: the exchange follows them (FLOOR; e5m2 with blocks of 16, "even").
OTHER_RECIPES = (
    recipe("mxfp8", dim0_kernel="torch"),
    MXRecipe(elem_dtype=torch.float8_e5m2, block_size=16, scaling_mode="even", dim0_kernel="torch"),
)

TIMEOUT = datetime.timedelta(seconds=60)


def make_rows(n: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows with awkward blocks: zeros, subnormal-scale blocks, large values, NaN, Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    if n >= 4 and dim >= 64:
        x[0, :32] = 0.0
        x[1, :32] = torch.randn(32, generator=g) * 2.0**-130
        x[2, 32:64] = torch.randn(32, generator=g) * 2.0**100
        x[3, 5] = float("nan")
        x[3, 40] = float("inf")
    return x.to(dtype)


def split_matrix(world: int, kind: str) -> list[list[int]]:
    """S[r][p]: rows rank r sends to rank p."""
    if kind == "equal":
        return [[4] * world for _ in range(world)]
    if kind == "uneven":
        return [[(3 * r + 5 * p + 1) % 7 + 1 for p in range(world)] for r in range(world)]
    if kind == "zeros":  # zero rows between some pairs, rank 1 sends nothing at all
        return [[0 if r == 1 or (r + p) % 3 == 0 else 2 + r + p for p in range(world)] for r in range(world)]
    raise ValueError(kind)


def _check_all_paths(
    rank: int, world: int, dim: int, dtype: torch.dtype, kind: str, seed: int, group=None, device="cpu"
) -> None:
    S = split_matrix(world, kind)
    ins = S[rank]
    outs = [S[p][rank] for p in range(world)]
    x0 = make_rows(sum(ins), dim, dtype, seed + rank).to(device)
    g = make_rows(sum(outs), dim, dtype, seed + 100 + rank).to(device)

    xr = x0.clone().requires_grad_()
    yr = reference_mxfp8_a2a(xr, outs, ins, group)
    yr.backward(g)
    modes = [(None, "auto"), (None, "nccl"), (0, "auto"), (1, "auto"), (3, "nccl")]
    if device != "cpu":
        modes.append((None, "symm"))
    for chunks, transport in modes:
        for splits_as in ("list", "tensor"):
            o, i = (
                (outs, ins) if splits_as == "list" else (torch.tensor(outs, device=device), torch.tensor(ins))
            )
            what = f"rank {rank} {kind} {dtype} chunks={chunks} transport={transport} {splits_as}"
            x = x0.clone().requires_grad_()
            check = splits_as == "list"  # symm: the matrix from the check, or gathered without it
            y = to_mxfp8_a2a_dequant(x, o, i, group, chunks=chunks, transport=transport, check=check)
            assert_same_bits(y, yr.detach(), "forward " + what)
            y.backward(g)
            assert_same_bits(x.grad, xr.grad, "backward " + what)

        # dispatch: MX rows equal the reference; gradient goes back in high precision
        x = x0.clone().requires_grad_()
        mx = a2a_dispatch_mxfp8(x, outs, ins, group, chunks=chunks, transport=transport)
        assert mx.qdata_blocked.shape == (sum(outs), dim) and mx.axis == 1 and mx.orig_dtype == dtype
        assert_same_bits(mx.dequantize(), yr.detach(), "dispatch " + what)
        q_ref, s_ref = custom_ops.quantize_dim0(x0, "mxfp8_e4m3_rceil", "torch")
        q_exp = torch.empty(sum(outs), dim, dtype=torch.uint8, device=device)
        all_to_all_rows(q_exp, q_ref.view(torch.uint8), outs, ins, group)
        assert torch.equal(mx.qdata_blocked.view(torch.uint8), q_exp), "dispatch bytes " + what
        (mx.grad_anchor * g).sum().backward()
        g_back = torch.empty_like(x0)
        all_to_all_rows(g_back, g, ins, outs, group)
        assert_same_bits(x.grad, g_back, "dispatch backward " + what)

        # combine: exact high-precision forward, MXFP8 backward
        x = x0.clone().requires_grad_()
        y = a2a_combine(x, outs, ins, group, chunks=chunks, transport=transport, check=False)
        y_exp = torch.empty(sum(outs), dim, dtype=dtype, device=device)
        all_to_all_rows(y_exp, x0, outs, ins, group)
        assert_same_bits(y, y_exp, "combine " + what)
        y.backward(g)
        assert_same_bits(x.grad, reference_mxfp8_a2a(g, ins, outs, group), "combine backward " + what)

    _check_recipes(x0, g, outs, ins, group, f"rank {rank} {kind} {dtype}")

    # plain high-precision all-to-all, any dtype and trailing shape
    x = x0.clone().requires_grad_()
    y = a2a_unquantized(x, outs, ins, group)
    assert_same_bits(y, y_exp, "a2a_unquantized")
    y.backward(g)
    assert_same_bits(x.grad, g_back, "a2a_unquantized backward")
    xi = torch.arange(sum(ins) * 6, dtype=torch.int64, device=device).view(-1, 2, 3) + 1000 * rank
    yi = a2a_unquantized(xi, outs, ins, group)
    assert yi.shape == (sum(outs), 2, 3)
    yi_exp = torch.empty_like(yi)
    dist.all_to_all_single(yi_exp, xi, outs, ins, group=group)
    assert torch.equal(yi, yi_exp)


def _check_recipes(x0, g, outs, ins, group, what: str) -> None:
    """Every exchange quantizes with the recipe it is given, bit for bit the reference with that recipe."""
    for r in OTHER_RECIPES:
        xr = x0.clone().requires_grad_()
        yr = reference_mxfp8_a2a(xr, outs, ins, group, recipe=r)
        yr.backward(g)
        for chunks, transport in ((None, "auto"), (2, "nccl")):
            w = f"{what} {r.scaling_mode}/{r.elem_dtype}/{r.block_size} chunks={chunks}"
            x = x0.clone().requires_grad_()
            y = to_mxfp8_a2a_dequant(x, outs, ins, group, chunks=chunks, transport=transport, recipe=r)
            assert_same_bits(y, yr.detach(), "forward " + w)
            y.backward(g)
            assert_same_bits(x.grad, xr.grad, "backward " + w)
            mx = a2a_dispatch_mxfp8(x0, outs, ins, group, chunks=chunks, transport=transport, recipe=r)
            assert (mx.scaling_mode, mx.elem_dtype, mx.block_size) == (
                r.scaling_mode,
                r.elem_dtype,
                r.block_size,
            )
            assert_same_bits(mx.dequantize(), yr.detach(), "dispatch " + w)
            x = x0.clone().requires_grad_()
            a2a_combine(x, outs, ins, group, chunks=chunks, transport=transport, recipe=r).backward(g)
            expect = reference_mxfp8_a2a(g, ins, outs, group, recipe=r)
            assert_same_bits(x.grad, expect, "combine backward " + w)


def _expect_error_everywhere(rank: int, exc: type, needle: str, fn, *args, **kwargs) -> None:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert needle in str(info.value), f"rank {rank}: {needle!r} not in {info.value}"
    # The group is still in step: a collective right after the error completes.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()


def _check_errors(rank: int, world: int) -> None:
    ok = [2] * world
    x = torch.randn(2 * world, 64)
    fns = (to_mxfp8_a2a_dequant, a2a_dispatch_mxfp8, a2a_combine)
    for fn in fns:
        # a bad argument on rank 1 only: every rank raises
        bad_sum = [3] + [2] * (world - 1) if rank == 1 else ok
        _expect_error_everywhere(rank, ValueError, "input_splits", fn, x, ok, bad_sum)
        short = ok[:-1] if rank == 1 else ok
        _expect_error_everywhere(rank, ValueError, "output_splits has", fn, x, short, ok)
        neg = [-1, 3] + [2] * (world - 2) if rank == world - 1 else ok
        _expect_error_everywhere(rank, ValueError, "negative", fn, x, ok, neg)
        xh = x.half() if rank == 1 else x
        _expect_error_everywhere(rank, TypeError, "dtype", fn, xh, ok, ok)
        _expect_error_everywhere(rank, ValueError, "divisible", fn, torch.randn(2 * world, 48), ok, ok)
        xd = torch.randn(2 * world, 96) if rank == 0 else x
        _expect_error_everywhere(rank, ValueError, "same shape", fn, xd, ok, ok)
        xt = x.bfloat16() if rank == 0 else x
        _expect_error_everywhere(rank, TypeError, "same dtype", fn, xt, ok, ok)
        # rank 0 expects 3 rows from rank 1, which sends 2 (local checks cannot see it)
        outs = [2, 3] + [2] * (world - 2) if rank == 0 else ok
        _expect_error_everywhere(rank, ValueError, "output_splits[1]=3 on rank 0", fn, x, outs, ok)
        _expect_error_everywhere(rank, ValueError, "chunks", fn, x, ok, ok, chunks=2 if rank else None)
        # an invalid chunks on one rank: checked with the collective, so every rank raises
        bad_chunks = -1 if rank == 1 else None
        _expect_error_everywhere(rank, ValueError, "chunks=-1", fn, x, ok, ok, chunks=bad_chunks)
        _expect_error_everywhere(rank, TypeError, "not an int", fn, x, ok, [2.0] * world)
        tr = "nccl" if rank == 1 else "auto"
        _expect_error_everywhere(rank, ValueError, "transport='nccl' on rank 1", fn, x, ok, ok, transport=tr)
        bad_tr = "nvlink" if rank == 0 else "auto"
        _expect_error_everywhere(rank, ValueError, "transport='nvlink'", fn, x, ok, ok, transport=bad_tr)
        # recipes of another MX format on one rank (each fine on its own): the bytes of one format
        # were decoded as another's, without a word (e5m2 elements read as e4m3; blocks of 16 as 32)
        e4m3 = "quantized in torch.float8_e4m3fn blocks of"
        others = (
            (recipe("mxfp8_rceil", elem_dtype=torch.float8_e5m2), "torch.float8_e5m2 blocks of 32 (rceil)"),
            (recipe("mxfp8_rceil", block_size=16), f"{e4m3} 16 (rceil) on rank 1"),
            (recipe("mxfp8"), f"{e4m3} 32 (floor) on rank 1"),
        )
        for other, what in others:
            r = other if rank == 1 else recipe("mxfp8_rceil")
            _expect_error_everywhere(rank, ValueError, what, fn, x, ok, ok, recipe=r)
    _expect_error_everywhere(rank, ValueError, "input_splits", a2a_unquantized, x, ok, [1] * world)
    with pytest.raises(ValueError, match="chunks"):
        to_mxfp8_a2a_dequant(x, ok, ok, chunks=-1)
    # symmetric memory needs CUDA tensors: asked for on gloo/CPU, every rank says so (no collective ran)
    with pytest.raises(RuntimeError, match="transport='symm' needs CUDA tensors"):
        to_mxfp8_a2a_dequant(x, ok, ok, transport="symm", check=False)
    # the cast kernel comes only through the recipe (its dim0_kernel), which the error names
    with pytest.raises(TypeError, match="unexpected keyword argument 'kernel'"):
        to_mxfp8_a2a_dequant(x, ok, ok, kernel="torch", recipe=OTHER_RECIPES[0])
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="recipe dim0_kernel='cuda': kernel='cuda' needs a CUDA"):
            to_mxfp8_a2a_dequant(x, ok, ok, recipe=recipe("mxfp8", dim0_kernel="cuda"), check=False)
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
        a2a_dispatch_mxfp8(x, ok, ok, recipe="mxfp8")
    with pytest.raises(ValueError, match="not divisible by the MX block size 64"):
        a2a_combine(torch.randn(2 * world, 96), ok, ok, recipe=MXRecipe(block_size=64), check=False)


def _worker(rank: int, world: int, port: int, jobs: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        for job in jobs:
            if job == "errors":
                _check_errors(rank, world)
            elif job.startswith("subgroups:"):
                # ranks {0, 2} and {1, 3}: group ranks differ from global ranks
                groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
                group = groups[rank % 2]
                kind, dtype, dim = job.split(":")[1:]
                grank = dist.get_rank(group)
                _check_all_paths(grank, 2, int(dim), getattr(torch, dtype), kind, seed=rank % 2, group=group)
            else:
                kind, dtype, dim = job.split(":")
                _check_all_paths(rank, world, int(dim), getattr(torch, dtype), kind, seed=7 * world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(world: int, jobs: list[str]) -> None:
    spawn_ranks(_worker, world, jobs)


def test_two_ranks():
    _launch(2, ["equal:bfloat16:64", "uneven:float32:96", "zeros:bfloat16:64", "errors"])


def test_four_ranks():
    _launch(4, ["uneven:bfloat16:64", "zeros:float32:32", "subgroups:uneven:bfloat16:64", "errors"])


def test_single_rank_without_and_with_process_group():
    x0 = make_rows(6, 64, torch.bfloat16, 3)
    g = make_rows(6, 64, torch.bfloat16, 4)
    q, s = custom_ops.quantize_dim0(x0, "mxfp8_e4m3_rceil", "torch")
    expect = custom_ops.dequantize(q, s, 32, torch.bfloat16, "torch")
    for chunks in (None, 0, 4):
        x = x0.clone().requires_grad_()
        y = to_mxfp8_a2a_dequant(x, [6], [6], chunks=chunks)
        assert_same_bits(y, expect)
        y.backward(g)
        qg, sg = custom_ops.quantize_dim0(g, "mxfp8_e4m3_rceil", "torch")
        assert_same_bits(x.grad, custom_ops.dequantize(qg, sg, 32, torch.bfloat16, "torch"))
    with pytest.raises(ValueError, match="input_splits has 2 entries but the group has 1"):
        to_mxfp8_a2a_dequant(x0, [6], [3, 3])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=TIMEOUT
    )
    try:
        for chunks in (None, 0, 2):
            assert_same_bits(to_mxfp8_a2a_dequant(x0, torch.tensor([6]), [6], chunks=chunks), expect)
            assert_same_bits(a2a_dispatch_mxfp8(x0, [6], [6], chunks=chunks).dequantize(), expect)
        assert_same_bits(a2a_combine(x0, [6], [6]), x0)
        assert_same_bits(reference_mxfp8_a2a(x0, [6], [6]), expect)
    finally:
        dist.destroy_process_group()


def test_the_rows_a_rank_sends_itself_are_checked_locally():
    """output_splits[rank] must equal input_splits[rank] (the rows this rank sends itself): one rank
    (or check=False) got torch's "The size of tensor a (3) must match ..." or gloo's enforce."""
    x = make_rows(4, 64, torch.float32, 5)
    for fn in (to_mxfp8_a2a_dequant, a2a_dispatch_mxfp8, a2a_combine, a2a_unquantized):
        for check in (True, False):
            with pytest.raises(ValueError, match=rf"^{fn.__name__}: output_splits\[0\]=3 but "
                               r"input_splits\[0\]=4: rank 0 \(this rank\) sends itself 4 rows"):
                fn(x, [3], [4], check=check)


def test_check_must_be_a_bool():
    """check="no" was taken as true (a truthy string); every all-to-all refuses a non-bool check."""
    x = make_rows(4, 64, torch.float32, 5)
    for fn in (to_mxfp8_a2a_dequant, a2a_dispatch_mxfp8, a2a_combine, a2a_unquantized):
        with pytest.raises(TypeError, match=rf"^{fn.__name__}: check='no': expected a bool$"):
            fn(x, [4], [4], check="no")


def test_double_backward_through_the_mx_exchange_is_refused():
    """The exchanges whose backward sends the gradient as MXFP8 have no double backward: a backward
    with create_graph=True names the op (it failed at the second differentiation, in a cast)."""
    for f, name in ((to_mxfp8_a2a_dequant, "to_mxfp8_a2a_dequant"), (a2a_combine, "a2a_combine")):
        x = make_rows(6, 64, torch.float32, 5).requires_grad_()
        y = f(x, [6], [6])
        with pytest.raises(RuntimeError, match=rf"^mxmoe.comm.{name} has no double backward"):
            torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)


def _all_byte_scale_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every e4m3 byte under every e8m0 scale byte: q (2048, 32) uint8, s (2048, 1) uint8."""
    q = torch.arange(256, dtype=torch.uint8).view(8, 32).repeat(256, 1)
    s = torch.arange(256, dtype=torch.uint8).repeat_interleave(8).view(-1, 1)
    return q, s


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy overflow notes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_into_triton_matches_definition(dtype):
    device = _needs_triton_here()
    q, s = _all_byte_scale_pairs()
    # sorted scales: most programs take the fp32 path; shuffled: every program has a tiny scale
    shuffled = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(0))
    for perm in (torch.arange(q.shape[0]), shuffled):
        qq, ss = q[perm].contiguous(), s[perm].contiguous()
        q8, s8 = qq.view(torch.float8_e4m3fn), ss.view(torch.float8_e8m0fnu)
        expect = custom_ops.dequantize(q8, s8, 32, dtype, "torch")
        qq, ss = qq.to(device), ss.to(device)
        for impl in ("triton", "cuda") if torch.cuda.is_available() else ("triton",):
            big = torch.full((qq.shape[0] + 3, 32), 7.0, dtype=dtype, device=device)
            dequantize_into(qq, ss, big[2:-1], impl=impl)
            assert_same_bits(big[2:-1].cpu(), expect, impl)
            assert (big[:2] == 7).all() and (big[-1] == 7).all()  # nothing written outside the slice
        out = torch.empty(qq.shape, dtype=dtype)
        assert_same_bits(dequantize_into(qq.cpu(), ss.cpu(), out, impl="copy"), expect, "copy")


def _needs_triton_here() -> str:
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qdq_into_matches_quantize_then_dequantize(dtype):
    """The fused own-slice kernel against the torch backend, over every binade 2^-150..2^127 plus zero,
    subnormal, huge, NaN and Inf blocks. The integer path is checked everywhere; the fp32 path (which
    relies on the GPU's fp32 -> e4m3 convert) only on a GPU: the interpreter does not round like one."""
    device = _needs_triton_here()
    g = torch.Generator().manual_seed(1)
    e = torch.randint(-150, 128, (256, 1), generator=g).float()
    binades = (torch.randn(256, 32, generator=g) * torch.exp2(e)).to(dtype).view(-1, 128)
    # normal range only (every program takes the fp32 path on a GPU); bf16 data hits e4m3 ties often
    normal = (torch.randn(1024, 32, generator=g) * torch.exp2(e.repeat(4, 1).clamp(-100, 100))).to(dtype)
    # 37 x 96: 111 blocks, two programs of 64 blocks, the second masked
    for x in (make_rows(16, 128, dtype, 5), make_rows(37, 96, dtype, 6), binades, normal.view(-1, 256)):
        q, s = custom_ops.quantize_dim0(x, "mxfp8_e4m3_rceil", "torch")
        expect = custom_ops.dequantize(q, s, 32, dtype, "torch")
        for force_slow in (True, False) if device == "cuda" else (True,):
            big = torch.full((x.shape[0] + 2, x.shape[1]), 7.0, dtype=dtype, device=device)
            qdq_into(x.to(device), big[1:-1], impl="triton", force_slow=force_slow)
            assert_same_bits(big[1:-1].cpu(), expect, f"force_slow={force_slow} {tuple(x.shape)}")
            assert (big[0] == 7).all() and (big[-1] == 7).all()
        out = torch.empty_like(x)
        assert_same_bits(qdq_into(x, out, impl="copy"), expect, "copy")


def test_dequantize_into_rejects_bad_arguments():
    q = torch.zeros(4, 64, dtype=torch.uint8)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_into(q, s, torch.empty(4, 32))
    with pytest.raises(TypeError, match="dtype"):
        dequantize_into(q, s, torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="impl"):
        dequantize_into(q, s, torch.empty(4, 64), impl="fast")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="kernel='cuda' needs a CUDA tensor"):
            dequantize_into(q, s, torch.empty(4, 64), impl="cuda")
    with pytest.raises(TypeError, match="q has dtype torch.float8_e5m2"):
        dequantize_into(q.view(torch.float8_e5m2), s, torch.empty(4, 64))
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16"):
        dequantize_into(torch.zeros(4, 64, dtype=torch.bfloat16), s, torch.empty(4, 64))
    with pytest.raises(TypeError, match="s has dtype torch.float32"):
        dequantize_into(q, torch.zeros(4, 2), torch.empty(4, 64))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_into(q.view(-1), s, torch.empty(256))
    with pytest.raises(ValueError, match="one device"):
        dequantize_into(q, s.to("meta"), torch.empty(4, 64))
    with pytest.raises(ValueError, match="one device"):
        qdq_into(torch.empty(4, 64), torch.empty(4, 64, device="meta"))
    with pytest.raises(ValueError, match="equal 2D shapes"):
        qdq_into(torch.empty(4, 48), torch.empty(4, 48))
    with pytest.raises(TypeError, match="dtype"):
        qdq_into(torch.empty(4, 64), torch.empty(4, 64, dtype=torch.bfloat16))


def test_auto_pipeline_decision_is_the_same_on_every_rank():
    """Auto chooses the pipelined path from the group-wide row count of the checked plan, so ranks
    with very different local sizes (uneven MoE routing) never take different paths and hang."""
    from mxmoe.comm.a2a import PIPELINE_MIN_ELEMS, _use_pipeline
    from mxmoe.comm.transport import Plan

    dim = 4096
    big = PIPELINE_MIN_ELEMS // dim  # rows that alone cross the threshold
    # rank 0 sends almost everything, rank 1 almost nothing: local sizes straddle the threshold
    ins = [(big, big // 2), (1, 2)]
    total = sum(map(sum, ins))
    plans = [Plan(r, 2, tuple(ins[r]), tuple(ins[p][r] for p in range(2)), (dim,), total) for r in range(2)]
    fwd = {_use_pipeline(True, p, None) for p in plans}
    bwd = {_use_pipeline(True, p.reversed(), None) for p in plans}
    assert len(fwd) == 1 and fwd == bwd
    unchecked = Plan(0, 2, tuple(ins[0]), (big, 1), (dim,), None)
    assert _use_pipeline(True, unchecked, None) is False
    assert _use_pipeline(True, unchecked, 2) is True and _use_pipeline(True, unchecked, 0) is False
    assert _use_pipeline(False, plans[0], None) is False
