"""FSDP2 all-gathers of MX weights as MXFP8 (`mxmoe.nn.fsdp`), on CPU with gloo at 2 and 4 ranks:
the gathered cast equals the whole weight's, training equals the high-precision gather bit for bit,
and the all-gathers carry (1 + 1/32) / 2 of a bf16 gather's bytes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, spawn_ranks
from torch import nn

from mxmoe.nn import MXGroupedExperts, MXLinear
from mxmoe.nn.fsdp import MXShardedWeight, enable_mxfp8_all_gather, shard_blocks_ok
from mxmoe.quant.gathered import MXGatheredWeight
from mxmoe.quant.mx_tensor import to_mx
from mxmoe.recipe import DEFAULT_RECIPE
from mxmoe.train.parallel import apply_fsdp

D, H, E, T = 128, 64, 4, 64  # D: 32·4 rows per shard block at 4 ranks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = MXLinear(D, D, bias=False)
        self.lin2 = MXLinear(D, D, bias=False)
        self.experts = MXGroupedExperts(D, H, E)

    def forward(self, x):
        h = self.lin2(torch.relu(self.lin1(x)))
        counts = torch.full((E,), x.shape[0] // E, dtype=torch.int64)
        return h + self.experts(h, counts)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = MXLinear(D, D, bias=False)  # in the root: not resharded after the forward

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)
        return self.head(x)


def make_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return net


def shard(net: Net, mx_gather: bool, world: int, param_dtype) -> None:
    """The trainer's FSDP2 (`parallel.apply_fsdp`): param_dtype bf16 (its CUDA bf16 runs) or fp32
    (CPU runs: no mixed-precision policy)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    dtype = None if param_dtype == torch.float32 else param_dtype
    apply_fsdp(net, mesh, ignore_experts=False, param_dtype=dtype, mxfp8_all_gather=mx_gather)


class Counter:
    """Bytes handed to all-gathers (FSDP2's and the regathers) while installed."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes, self.saved = 0, {}
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if hasattr(dist, name):
                orig = getattr(dist, name)
                self.saved[name] = orig

                def counted(out, inp, *a, _orig=orig, **k):
                    self.bytes += inp.numel() * inp.element_size()
                    return _orig(out, inp, *a, **k)

                setattr(dist, name, counted)

    def remove(self):
        import torch.distributed as dist

        for name, f in self.saved.items():
            setattr(dist, name, f)


def train(world: int, mx_gather: bool, param_dtype, steps: int = 3):
    """Losses, the full parameters after `steps` AdamW steps, and the all-gather bytes of step 1."""
    net = make_net()
    shard(net, mx_gather, world, param_dtype)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses, nbytes = [], 0
    for step in range(steps):
        x = torch.randn(T, D)
        counter = Counter() if step == 0 else None
        loss = net(x).float().pow(2).mean()
        loss.backward()
        if counter:
            counter.remove()
            nbytes = counter.bytes
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = {k: v.full_tensor() for k, v in net.state_dict().items()}
    return losses, full, nbytes


def gather_rank(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    res = {}
    try:
        # 1. the forward's gather (dim0) and the other layout (dim1) equal the whole weight's casts
        for dtype in (torch.bfloat16, torch.float32):
            ref = make_net()
            net = make_net()
            shard(net, True, world, dtype)
            net.layers[0].unshard()
            m, mr = net.layers[0], ref.layers[0]
            for mod, modr, attr in ((m.lin1, mr.lin1, "weight"), (m.experts, mr.experts, "w2")):
                g = getattr(mod, attr)
                assert isinstance(g, MXGatheredWeight) and g.layout == "dim0", type(g)
                w = getattr(modr, attr).detach().to(dtype)
                for axis in (-1, -2):
                    a, b = g.mx(axis, DEFAULT_RECIPE), to_mx(w, axis, recipe=DEFAULT_RECIPE)
                    assert_same_bits(a.qdata_blocked, b.qdata_blocked, f"{attr} {axis} elements")
                    assert_same_bits(a.scale_blocked, b.scale_blocked, f"{attr} {axis} scales")
            net.layers[0].reshard()
            # item 0: with param_dtype bf16 the high-precision gather hands the GEMMs bf16 weights,
            # and the gradients are reduced into fp32 shards
            hp = make_net()
            shard(hp, False, world, dtype)
            hp.layers[0].unshard()
            assert type(hp.layers[0].lin1.weight.data) is torch.Tensor
            assert hp.layers[0].lin1.weight.dtype == dtype
            hp.layers[0].reshard()
            hp(torch.randn(T, D)).float().sum().backward()
            assert hp.layers[0].lin1.weight.grad.to_local().dtype == torch.float32
        # wrapping after fully_shard is refused, naming the weight (it once reported "gathers
        # MXFP8" and failed in the forward on a freed storage)
        late = make_net()
        shard(late, False, world, torch.float32)
        with pytest.raises(RuntimeError, match=r"layers.0.lin1.weight is sharded by FSDP2 already"):
            enable_mxfp8_all_gather(late, world)
        # 2. training: bit for bit the high-precision gather's; 3. bytes
        for dtype in (torch.bfloat16, torch.float32):
            lm, pm, bm = train(world, True, dtype)
            lh, ph, bh = train(world, False, dtype)
            assert lm == lh, (lm, lh)
            assert pm.keys() == ph.keys()
            for k in pm:
                assert type(pm[k]) is torch.Tensor, (k, type(pm[k]))
                assert_same_bits(pm[k], ph[k], k)
            res[str(dtype)] = {"losses": lm, "mx_bytes": bm, "hp_bytes": bh}
    finally:
        torch.distributed.destroy_process_group()
    if rank == 0:
        Path(out, "res.json").write_text(json.dumps(res))


def mx_bytes_per_step(world: int, esize: int) -> tuple[int, int]:
    """(MXFP8 bytes, compute-dtype bytes) one rank hands to the all-gathers in one step of `Net`, in a
    compute dtype of `esize` bytes: each block's weights twice (forward, backward; MXFP8: elements,
    scales and a one-byte layout tag per weight), the root's head once, in the compute dtype either
    way (FSDP2 does not reshard the root after the forward: its backward has no gather of the
    dgrad's layout)."""
    net = make_net()
    blocks = sum(p.numel() for p in net.layers.parameters()) // world
    tags = 2 * len(list(net.layers.parameters()))
    head = net.head.weight.numel() // world
    return int(2 * blocks * (1 + 1 / 32)) + tags + esize * head, esize * (2 * blocks + head)


@pytest.mark.parametrize("world", [2, 4])
def test_mxfp8_gather_equals_whole_cast_and_trains_bit_for_bit(tmp_path, world):
    spawn_ranks(gather_rank, world, str(tmp_path), timeout_s=300)
    res = json.loads((tmp_path / "res.json").read_text())
    for dtype in (torch.bfloat16, torch.float32):
        mx, hp = mx_bytes_per_step(world, dtype.itemsize)
        r = res[str(dtype)]
        assert r["mx_bytes"] == mx and r["hp_bytes"] == hp, (dtype, r, mx, hp)
    b = res[str(torch.bfloat16)]
    assert b["losses"][0] != b["losses"][-1]


def test_shard_block_rule_and_report(caplog):
    assert shard_blocks_ok((128, 64), 4, 32) is None
    assert "not divisible by 32·world (128)" in shard_blocks_ok((96, 64), 4, 32)
    assert shard_blocks_ok((4, 64, 128), 4, 32) is None
    assert "experts" in shard_blocks_ok((6, 64, 128), 4, 32)
    net = make_net()
    with caplog.at_level(logging.INFO, logger="mxmoe.nn.fsdp"):
        rep = enable_mxfp8_all_gather(net, 8)  # 128 rows: not 32·8 -> plain; 4 experts over 8: plain
    assert rep.mx == [] and set(rep.plain) == {
        "layers.0.lin1.weight", "layers.0.lin2.weight", "layers.0.experts.w1", "layers.0.experts.w2",
        "layers.0.experts.w3", "layers.1.lin1.weight", "layers.1.lin2.weight", "layers.1.experts.w1",
        "layers.1.experts.w2", "layers.1.experts.w3", "head.weight",
    }
    assert "11 gather high precision" in caplog.text
    rep = enable_mxfp8_all_gather(net, 2)
    assert len(rep.mx) == 11 and isinstance(net.head.weight, MXShardedWeight)
    # outside FSDP the wrapped weight is the plain weight; the state dict holds plain tensors
    ref = make_net()
    x = torch.randn(8, D)
    assert_same_bits(net.head(x), ref.head(x), "unsharded forward")
    sd = net.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert sd.keys() == ref.state_dict().keys()
    with pytest.raises(ValueError, match="shard_world_size=0"):
        enable_mxfp8_all_gather(net, 0)


def test_a_model_without_mx_weights_is_warned_of():
    plain = nn.Sequential(nn.Linear(64, 64))  # not converted: nothing to gather as MXFP8
    with pytest.warns(UserWarning, match="Sequential has no MX weight to wrap \\(convert it with mxmoe"):
        rep = enable_mxfp8_all_gather(plain, 2)
    assert rep.mx == [] and rep.plain == {}


def test_gathered_weight_refuses_other_ops():
    w = torch.randn(64, 32)
    mx = to_mx(w, -1, recipe=DEFAULT_RECIPE)
    fmt = DEFAULT_RECIPE.fmt.name
    g = MXGatheredWeight(w.shape, torch.float32, mx.qdata_blocked, mx.scale_blocked, "dim0", fmt)
    assert g.t().shape == (32, 64)
    with pytest.raises(NotImplementedError, match="gathered as MXFP8"):
        g + 1
    with pytest.raises(RuntimeError, match="needs dim1"):
        g.mx(-2, DEFAULT_RECIPE)


def test_compiled_reads_check_the_layout_tag():
    """The custom ops compiled graphs read a gathered weight through: a plain tensor is refused; the
    reads return the buffers (the scales copied) when the tag holds the layout asked for, and stop
    (CPU: RuntimeError) when it does not."""
    from mxmoe.quant.gathered import LAYOUT_IDS, layout_tag

    w = torch.randn(64, 32)
    mx = to_mx(w, -1, recipe=DEFAULT_RECIPE)
    with pytest.raises(TypeError, match="reads an MXGatheredWeight, got a Tensor"):
        torch.ops.mxmoe.gathered_weight(w, -1, DEFAULT_RECIPE.fmt.name, None)
    tag = torch.cat([layout_tag("dim0", w.device)] * 2)  # two ranks' tags
    s = torch.ops.mxmoe.gathered_scales(mx.scale_blocked, tag, LAYOUT_IDS["dim0"])
    assert_same_bits(s, mx.scale_blocked, "scales")
    assert s.data_ptr() != mx.scale_blocked.data_ptr()  # a copy: custom ops' outputs alias no input
    with pytest.raises(RuntimeError, match="read an MXFP8-gathered weight as dim1 but the buffers hold"):
        torch.ops.mxmoe.gathered_scales(mx.scale_blocked, tag, LAYOUT_IDS["dim1"])
    mixed = torch.tensor([0, 1], dtype=torch.uint8)  # one rank's data in the other layout
    with pytest.raises(RuntimeError, match="as dim0 but the buffers hold"):
        torch.ops.mxmoe.gathered_as(mx.qdata_blocked, mx.scale_blocked, mixed, w, 0, [64, 32], [64, 1], False)


def test_gathered_weight_cast_from_another_dtype():
    """A weight whose forward converts it (torchtitan 0.2's experts: w.bfloat16()) is cast from that
    dtype: `.to` it gives the same MX data in that dtype; read in the other dtype it refuses."""
    w = torch.randn(64, 32)
    mx = to_mx(w.bfloat16(), -1, recipe=DEFAULT_RECIPE)
    fmt = DEFAULT_RECIPE.fmt.name
    g = MXGatheredWeight(w.shape, torch.float32, mx.qdata_blocked, mx.scale_blocked, "dim0", fmt,
                         cast_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cast to MX from torch.bfloat16"):
        g.mx(-1, DEFAULT_RECIPE)
    b = g.bfloat16()
    assert b.dtype == torch.bfloat16 and isinstance(b, MXGatheredWeight)
    assert_same_bits(b.mx(-1, DEFAULT_RECIPE).qdata_blocked, mx.qdata_blocked)
    assert b.transpose(-2, -1).shape == (32, 64)
    with pytest.raises(NotImplementedError, match="_to_copy"):
        g.half()


def test_experts_of_bf16_gemms_are_named_as_gathering_high_precision(caplog):
    """MX experts with expert_gemm='bf16' (the exchange only: high-precision GEMMs) are not wrapped,
    and the report names them with why (they were left out of it without a word, and a model whose
    only MX modules they were was told to convert first)."""
    import dataclasses

    bf16 = dataclasses.replace(DEFAULT_RECIPE, expert_gemm="bf16")
    net = nn.Sequential(MXGroupedExperts(D, H, E, recipe=bf16))
    with caplog.at_level(logging.INFO, logger="mxmoe.nn.fsdp"):
        rep = enable_mxfp8_all_gather(net, 2)
    assert rep.mx == [] and list(rep.plain) == ["0.w1", "0.w2", "0.w3"]
    assert rep.plain["0.w1"] == "expert_gemm='bf16': its GEMMs take the weight in high precision"
    assert "3 gather high precision: 0.w1 (expert_gemm='bf16'" in caplog.text
    assert type(net[0].w1.data) is torch.Tensor


def wrong_world_rank(rank: int, world: int, port: int, out: str) -> None:
    """Wraps for 4 ranks, shards over `world`: the first gather says so (rank 0 writes the log)."""
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("mxmoe.nn.fsdp").addHandler(handler)
    try:
        net = make_net()
        enable_mxfp8_all_gather(net, 4)
        mesh = init_device_mesh("cpu", (world,))
        for blk in net.layers:
            fully_shard(blk, mesh=mesh)
        fully_shard(net, mesh=mesh)
        net(torch.randn(T, D)).float().sum().backward()
        if rank == 0:
            Path(out, "log.txt").write_text(buf.getvalue())
    finally:
        torch.distributed.destroy_process_group()


def test_a_wrap_for_another_shard_degree_is_named_at_the_first_gather(tmp_path):
    spawn_ranks(wrong_world_rank, 2, str(tmp_path), timeout_s=300)
    text = (tmp_path / "log.txt").read_text()
    assert "wrapped for 4 FSDP ranks (shard_world_size) but FSDP2 shards them over 2" in text
    assert text.count("wrapped for 4 FSDP ranks") == 1  # once, not per weight


def test_a_bool_shard_degree_is_refused():
    with pytest.raises(ValueError, match=r"shard_world_size=True: expected an int >= 1"):
        enable_mxfp8_all_gather(make_net(), True)


def test_bad_arguments_are_named():
    # each was taken as it was: a string model failed inside named_modules, skip_experts="no" skipped
    # the experts (a true string), expert_types=SomeClass failed unpacking it, and a float16 (or
    # string) expert_cast_dtype was kept until the first gather's cast
    net = make_net()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        enable_mxfp8_all_gather("net", 2)
    with pytest.raises(TypeError, match="skip_experts='no': expected a bool"):
        enable_mxfp8_all_gather(net, 2, skip_experts="no")
    why = "expert_types=<class .*MXGroupedExperts'>: expected a tuple of classes"
    with pytest.raises(TypeError, match=why):
        enable_mxfp8_all_gather(net, 2, expert_types=MXGroupedExperts)
    for bad in (torch.float16, "bf16"):
        with pytest.raises(TypeError, match="expert_cast_dtype=.*expected None, torch.bfloat16 or torch"):
            enable_mxfp8_all_gather(net, 2, expert_cast_dtype=bad)
    assert not any(isinstance(p, MXShardedWeight) for p in net.parameters())  # refused before any wrap
    rep = enable_mxfp8_all_gather(net, 2, skip_experts=True, expert_types=(MXGroupedExperts,),
                                  expert_cast_dtype=torch.bfloat16)
    assert rep.mx and not any(".experts." in f for f in rep.mx)
