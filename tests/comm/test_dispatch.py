"""The dispatch seam and its transports registry on 2 gloo ranks, with mxmoe's MoE model at EP=2:

- the MXFP8 exchange changes the bytes on the wire, not the numbers: the same step over a
  registered transport that sends the same MX-rounded rows unquantized gives the same bits, and so
  does the exchange in the rows' dtype (MX experts round what they get as the exchange would), with
  MX GEMMs and with the exchange only;
- what the collective is handed: MXFP8 rows (elements + scales) for the dispatch and the combine's
  gradient, unquantized rows for the combine and the dispatch's gradient; with the MXFP8 exchange
  off (or high-precision experts) no MXFP8 row at all;
- a registered token-level transport (the slot DeepEP would fill: it moves tokens, not rows, and
  brings its own token dispatcher) serves the model by name, "auto" takes it where its rank is the
  lowest, and the exchanges of rows never take it;
- a bad transport name is refused, naming the choices."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, spawn_ranks
from transports_for_tests import (
    ExchangeLog,
    GatherTokensDispatcher,
    activate,
    mx_and_unquantized_rows,
    register,
)

import mxmoe
from mxmoe.comm import to_mxfp8_a2a_dequant
from mxmoe.comm.a2a_dispatcher import AllToAllDispatcher
from mxmoe.models import Transformer, apply_expert_parallel, model_args
from mxmoe.recipe import recipe

DIM = 64
RECIPE = recipe("mxfp8_rceil", dim0_kernel="torch", dim1_kernel="torch")
BF16_EXPERTS = RECIPE.replace(expert_gemm="bf16")


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        model_args("debug_moe", vocab_size=64, max_seq_len=16, n_layers=1, dim=DIM, num_experts=4, top_k=2)
    )


def _step(m: Transformer, rank: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 + rank))
    logits, _ = m(tokens)
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), **grads}


def _run(rank, group, *, mx: bool, recipe=RECIPE, **ep) -> tuple[dict[str, torch.Tensor], ExchangeLog]:
    m = _model()
    if mx:
        mxmoe.convert(m, recipe)
    apply_expert_parallel(m, group, **ep)
    with ExchangeLog() as log:
        out = _step(m, rank)
    return out, log


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.group.WORLD
    try:
        register("rounded_bf16")
        mx, mx_log = _run(rank, group, mx=True, transport="nccl")
        rounded, rounded_log = _run(rank, group, mx=True, transport="rounded_bf16")
        assert mx.keys() == rounded.keys() and len(mx) > 5
        for k in mx:  # the same numbers, bit for bit
            assert_same_bits(rounded[k], mx[k], f"rank {rank}: {k}")

        # MXFP8 on the wire: the dispatch and the combine's gradient as elements + scales, the
        # combine and the dispatch's gradient as fp32 rows (the CPU model's dtype)
        elems, scales, rows = mx_and_unquantized_rows(mx_log, DIM, 4)
        assert len(elems) == len(scales) == 2 and elems == scales, mx_log.calls
        assert len(rows) == 2, mx_log.calls
        assert sum(elems) > 0
        # the rounded transport moved the same rows unquantized: no MXFP8 byte
        elems, scales, rows = mx_and_unquantized_rows(rounded_log, DIM, 4)
        assert elems == scales == [] and len(rows) == 4, rounded_log.calls
        # the MXFP8 exchange off, or high-precision experts: rows go unquantized both ways; MX
        # experts round what they are given as the exchange would: the same values in every GEMM,
        # summed in an order the CPU BLAS may choose by operand layout (an MXTensor's dequantized
        # rows or rows the experts rounded): equal within fp32 summation order (bit-equal on some
        # CPUs; on an H200 host's CPU 61 of 8192 elements of a weight gradient differed, by <= 4e-10)
        for kw in ({"mx": True, "mxfp8": False}, {"mx": False}):
            out, log = _run(rank, group, transport="nccl", **kw)
            elems, scales, rows = mx_and_unquantized_rows(log, DIM, 4)
            assert elems == scales == [] and len(rows) == 4, (kw, log.calls)
            if kw["mx"]:
                for k in mx:
                    torch.testing.assert_close(
                        out[k], mx[k], rtol=1e-5, atol=1e-8, msg=f"rank {rank}: {k}, the exchange in fp32"
                    )
        # the exchange only (bf16 GEMMs on MX-rounded rows): MXFP8 and fp32 rows, the same bits
        only = [_run(rank, group, mx=True, recipe=BF16_EXPERTS, transport="nccl", mxfp8=m)[0]
                for m in (True, False)]
        for k in only[0]:
            assert_same_bits(only[1][k], only[0][k], f"rank {rank}: {k}, the exchange only")

        # a token-level transport serves the model by name; "auto" takes it at rank -1
        activate("gather_tokens")
        ref, _ = _run(rank, group, mx=False, transport="nccl")
        got, log = _run(rank, group, mx=False, transport="gather_tokens")
        assert mx_and_unquantized_rows(log, DIM, 4) == ([], [], []), log.calls  # no row exchange
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {k}")
        m = apply_expert_parallel(_model(), group)
        assert isinstance(m.layers[0].moe.dispatch.dispatcher, GatherTokensDispatcher)
        m = apply_expert_parallel(_model(), group, transport="nccl")
        assert isinstance(m.layers[0].moe.dispatch.dispatcher, AllToAllDispatcher)
        # an exchange of rows never takes it: "auto" goes on to the process group, naming it fails
        x = torch.randn(4, DIM)
        torch.testing.assert_close(to_mxfp8_a2a_dequant(x, [2, 2], [2, 2], check=False).shape, x.shape)
        with pytest.raises(RuntimeError, match="transport='gather_tokens' moves tokens, not rows"):
            to_mxfp8_a2a_dequant(x, [2, 2], [2, 2], transport="gather_tokens", check=False)
        with pytest.raises(ValueError, match=r"transport='deepep'; expected one of \['auto', 'nccl', 'symm'"):
            apply_expert_parallel(_model(), group, transport="deepep")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_exchange_bytes_numbers_and_a_registered_transport():
    spawn_ranks(_worker, 2)


def test_a_run_log_says_what_the_exchange_sends():
    """`describe_exchange`: the line the trainer and both torchtitan adapters log under expert
    parallelism names the ranks, the transport and what crosses the wire for the experts' recipe;
    a dispatcher without `describe` (a token-level transport's) is named by its type."""
    from mxmoe.token_dispatch import UNQUANTIZED, ExpertRows, describe_exchange

    mx = ExpertRows(recipe("mxfp8_rceil"))
    line = describe_exchange(AllToAllDispatcher(None, transport="nccl"), mx)
    assert line.startswith("expert parallelism over 1 rank, transport 'nccl': "), line
    assert "the dispatch and the combine's gradient send MXFP8 rows (e4m3 elements + e8m0 scales per 32, " \
        "RCEIL), the combine and the dispatch's gradient rows in the compute dtype" in line, line
    floor = describe_exchange(AllToAllDispatcher(None), ExpertRows(recipe("mxfp8")))
    assert "FLOOR" in floor and "transport 'auto'" in floor, floor
    off = describe_exchange(AllToAllDispatcher(None, mxfp8=False), mx)
    assert "both ways (the MXFP8 exchange is off: mxfp8_a2a=False)" in off, off
    assert "(the experts are not MX)" in describe_exchange(AllToAllDispatcher(None), UNQUANTIZED)
    token_level = object.__new__(GatherTokensDispatcher)  # no process group needed to name it
    assert describe_exchange(token_level, mx) == "expert parallelism through GatherTokensDispatcher"
