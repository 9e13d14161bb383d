"""The format is one registered value (issue 56): `MXFormat` in `mxmoe.formats.FORMATS`, held by
`MXRecipe.fmt`, carried by `MXTensor.fmt`, passed to the exchange's custom ops by name. A format the
package does not ship, registered here and nowhere else (e4m3fnuz elements, blocks of 16), goes
through the cast, the exchange over gloo (the public all-to-all and the expert-parallel
dispatcher's custom ops) and a GEMM on the torch backend, with no change to any other file."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits, spawn_ranks

from mxmoe.formats import (
    DEFAULT_FORMAT,
    FORMATS,
    SCALE_DTYPE,
    ElemFormat,
    MXFormat,
    ScalingMode,
    format_of,
    get_format,
    register_format,
)
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe, recipe

# AMD's e4m3: no infinities, one NaN (0x80, negative zero's pattern), largest 240 = 1.875 * 2^7,
# smallest normal 2^-7. The constants below are all the torch cast reads of an element format.
FNUZ = ElemFormat(torch.float8_e4m3fnuz, 240.0, 7, 3, -7, 0x80)
NEW = MXFormat("mxfp8_e4m3fnuz_rceil_b16", torch.float8_e4m3fnuz, 16, ScalingMode.RCEIL)


def test_shipped_formats_are_registered_values():
    assert DEFAULT_RECIPE.fmt is DEFAULT_FORMAT is get_format("mxfp8_e4m3_rceil")
    assert (DEFAULT_FORMAT.elem_dtype, DEFAULT_FORMAT.block_size, DEFAULT_FORMAT.scaling_mode) == (
        torch.float8_e4m3fn, 32, ScalingMode.RCEIL
    )
    assert DEFAULT_FORMAT.scale_dtype is SCALE_DTYPE is torch.float8_e8m0fnu
    assert (DEFAULT_FORMAT.elem_bits, DEFAULT_FORMAT.elems_per_byte, DEFAULT_FORMAT.per_tensor_scale) == (
        8, 1, False
    )
    assert recipe("mxfp8").fmt is FORMATS["mxfp8_e4m3_floor"]
    assert MXRecipe(elem_dtype=torch.float8_e5m2, scaling_mode="even").fmt.name == "mxfp8_e5m2_even"
    # a block size not shipped is registered on first use, under a name that says it
    r = MXRecipe(block_size=64)
    assert r.fmt is format_of(torch.float8_e4m3fn, 64, "rceil") and r.fmt.name == "mxfp8_e4m3_rceil_b64"
    assert MXRecipe.from_format("mxfp8_e5m2_even", dim0_kernel="torch") == MXRecipe(
        elem_dtype=torch.float8_e5m2, scaling_mode="even", dim0_kernel="torch"
    )
    # the recipe compares and hashes as before: the format follows its fields
    assert hash(recipe("mxfp8")) == hash(MXRecipe(scaling_mode="floor"))


def test_register_format_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="format 'nvfp4' is not registered; expected one of"):
        get_format("nvfp4")
    with pytest.raises(ValueError, match="per_tensor_scale=True has no cast kernel yet"):
        MXFormat("scaled", torch.float8_e4m3fn, 32, "rceil", per_tensor_scale=True)
    with pytest.raises(ValueError, match="scale_dtype=torch.float8_e4m3fn has no cast kernel yet"):
        MXFormat("e4m3_scales", torch.float8_e4m3fn, 16, "rceil", scale_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="clashes with the registered"):
        register_format(MXFormat("mxfp8_e4m3_rceil", torch.float8_e4m3fn, 64, "rceil"))
    with pytest.raises(TypeError, match="is not an MX element dtype"):
        register_format(MXFormat("fnuz_unregistered", torch.float8_e4m3fnuz, 16, "rceil"))


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        from mxmoe.comm import a2a_dispatch_mxfp8, reference_mxfp8_a2a, to_mxfp8_a2a_dequant
        from mxmoe.comm.a2a_dispatcher import AllToAllDispatcher
        from mxmoe.ops import mx_mm
        from mxmoe.quant import to_mx
        from mxmoe.token_dispatch import ExpertRows

        fmt = register_format(NEW, FNUZ)  # the one line a new format needs (its kernels aside)
        with pytest.raises(ValueError, match="dim0_kernel='auto': format mxfp8_e4m3fnuz_rceil_b16 .* torch"):
            MXRecipe.from_format(fmt.name)  # the Triton and CUDA casts know e4m3fn / e5m2 only
        r = MXRecipe.from_format(fmt.name, dim0_kernel="torch", dim1_kernel="torch", gemm_backend="emulated")
        assert r.fmt is fmt
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

        # cast: e4m3fnuz elements, one E8M0 scale per 16, every element within 240
        t = to_mx(x, recipe=r)
        assert t.fmt is fmt and t.qdata.dtype == torch.float8_e4m3fnuz and t.scale.shape == (8, 4)
        assert t.qdata.float().abs().max() <= 240
        y = t.dequantize()
        blocks = x.view(8, 4, 16).abs().amax(-1, keepdim=True)
        assert ((y - x).view(8, 4, 16).abs() <= blocks * 2.0**-3).all()
        assert_same_bits(to_mx(y, recipe=r).dequantize(), y, "a rounded value quantizes to itself")

        # exchange over gloo: 4 rows to each rank, bit for bit the definition (quantize, move, dequantize)
        got = to_mxfp8_a2a_dequant(x, [4, 4], [4, 4], recipe=r)
        assert_same_bits(got, reference_mxfp8_a2a(x, [4, 4], [4, 4], recipe=r), "exchange")
        peers = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(peers, y)
        assert_same_bits(got, torch.cat([p[4 * rank : 4 * rank + 4] for p in peers]), "the peers' rows")
        mx_rows = a2a_dispatch_mxfp8(x, [4, 4], [4, 4], recipe=r)
        assert mx_rows.fmt is fmt
        # the expert-parallel dispatcher: the custom ops take the format by its registered name
        d = AllToAllDispatcher(dist.group.WORLD, transport="nccl")
        idx = torch.arange(16).remainder(4).view(8, 2)
        rows, counts, h = d.dispatch(x, idx, torch.ones(8, 2), num_experts=4, rows_as=ExpertRows(r))
        assert rows.fmt is fmt and counts.tolist() == [8, 8]  # 4 rows per expert from each rank

        # GEMM on the torch backend (emulated: exact dequantized operands, fp32 on the CPU)
        w = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
        out = mx_mm(x, w.t(), r)
        ref = to_mx(x, recipe=r).dequantize(torch.float32) @ to_mx(w, recipe=r).dequantize(torch.float32).t()
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_unshipped_format_through_cast_exchange_and_gemm():
    """Registered in the ranks' processes only: this process's registry stays as shipped."""
    spawn_ranks(_worker, 2)
    assert NEW.name not in FORMATS and torch.float8_e4m3fnuz not in {f.elem_dtype for f in FORMATS.values()}
