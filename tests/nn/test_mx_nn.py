"""MXLinear, MXGroupedExperts, mxmoe.convert: drop-in behaviour, errors, compile, FSDP2, GPU."""

import copy
import dataclasses
import logging
import os
import re
from datetime import timedelta

import pytest
import torch
from conftest import recipe_for, spawn_ranks
from torch import nn

import mxmoe
from mxmoe.nn import GroupedExperts, MXGroupedExperts, MXLinear, convert, project
from mxmoe.ops import mx_grouped_mm
from mxmoe.options import MXOptions
from mxmoe.quant.mx_tensor import make_grad_anchor, to_mx
from mxmoe.recipe import MXRecipe

CPU_CFG = MXOptions(mxfp8_dim1_cast_kernel_choice="torch", mxfp8_dim0_cast_kernel_choice="torch")
COUNTS = [9, 0, 40, 15]  # fixed routing: 64 tokens, one empty expert, sizes not multiples of 32


class TinyMoE(nn.Module):
    def __init__(self, dim=64, hidden=32, experts=4):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, experts)
        self.mid = nn.Linear(dim, 96, bias=False)
        self.odd = nn.Linear(96, 40)  # 40 not divisible by 32: skipped
        self.output = nn.Linear(40, 8)

    def forward(self, x, counts):
        h = self.inp(x)
        h = h + self.experts(h, counts) + 0 * self.router(h).sum()
        return self.output(self.odd(torch.relu(self.mid(h))))


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyMoE()


def train_losses(model, steps=3, compile_=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(sum(COUNTS), 64, generator=g) for _ in range(steps)]
    counts = torch.tensor(COUNTS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(x):
        return (model(x, counts) ** 2).mean()

    fn = torch.compile(loss_fn, fullgraph=True, backend="aot_eager") if compile_ else loss_fn
    out = []
    for x in xs:
        loss = fn(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_convert_swaps_and_logs(caplog):
    model = make_model()
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        assert mxmoe.convert(model, CPU_CFG) is model
    assert isinstance(model.inp, MXLinear) and isinstance(model.mid, MXLinear)
    assert isinstance(model.experts, MXGroupedExperts)
    assert (
        type(model.router) is nn.Linear and type(model.output) is nn.Linear and type(model.odd) is nn.Linear
    )
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mxmoe"]
    assert (
        "2 Linear" in line and "1 GroupedExperts" in line and "odd (dims 96x40" in line and "router" in line
    )
    # Same keys and values both ways
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    ref.load_state_dict(sd)
    model.load_state_dict(make_model(seed=7).state_dict())
    assert torch.equal(model.experts.w2, make_model(seed=7).experts.w2)


def test_convert_errors():
    with pytest.raises(ValueError, match=r"not supported yet \(parallel_dims has tp=2\)"):
        convert(make_model(), CPU_CFG, parallel_dims={"dp_shard": 4, "ep": 2, "tp": 2})

    class PD:
        tp_enabled = True

    # said as parallel_dims says it (it was "tp=2", a degree it never gave)
    with pytest.raises(ValueError, match=r"tensor parallelism .* \(parallel_dims has tp_enabled=True\)"):
        convert(make_model(), CPU_CFG, parallel_dims=PD())
    convert(make_model(), CPU_CFG, parallel_dims={"dp_shard": 2, "tp": 1})
    with pytest.raises(ValueError, match="recipe_name='mxfp4'"):
        convert(make_model(), MXOptions(recipe_name="mxfp4"))
    with pytest.raises(ValueError, match="kernel='cuda'"):
        convert(make_model(), MXOptions(mxfp8_dim1_cast_kernel_choice="cuda"))
    with pytest.raises(ValueError, match="mxfp8_dim1_cast_kernel_choice='tritonn'"):
        convert(make_model(), MXOptions(mxfp8_dim1_cast_kernel_choice="tritonn"))
    with pytest.raises(ValueError, match="mxfp8_dim0_cast_kernel_choice='cpu'"):
        convert(make_model(), MXOptions(mxfp8_dim0_cast_kernel_choice="cpu"))


def test_mxlinear_from_linear_shares_params_and_matches_mx_mm():
    lin = nn.Linear(64, 32)
    mx = MXLinear.from_linear(lin, MXRecipe(dim0_kernel="torch", dim1_kernel="torch"))
    assert mx.weight is lin.weight and mx.bias is lin.bias
    x = torch.randn(3, 5, 64)
    y = mx(x)
    ref = (
        to_mx(x.reshape(-1, 64)).dequantize(torch.float32)
        @ to_mx(lin.weight.detach()).dequantize(torch.float32).t()
        + lin.bias.detach()
    )
    torch.testing.assert_close(y.reshape(-1, 32), ref, rtol=1e-5, atol=1e-5)


def test_mx_experts_mx_input_equals_plain():
    torch.manual_seed(3)
    cfg = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")
    ex = MXGroupedExperts(64, 32, 4, recipe=cfg)
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 64, dtype=torch.bfloat16)
    x_mx = to_mx(x, recipe=recipe_for("torch"))
    anchor = make_grad_anchor(x_mx.shape, torch.bfloat16, x.device).requires_grad_()
    x_mx = dataclasses.replace(x_mx, grad_anchor=anchor)
    ex.to(torch.bfloat16)
    y = ex(x_mx, counts)
    y.float().square().sum().backward()
    g_mx = [p.grad.clone() for p in ex.parameters()]
    ex.zero_grad()
    xp = x_mx.dequantize(recipe=recipe_for("torch")).detach().requires_grad_()
    y2 = ex(xp, counts)
    y2.float().square().sum().backward()
    assert torch.equal(y, y2) and torch.equal(x_mx.grad_anchor.grad, xp.grad)
    for g, p in zip(g_mx, ex.parameters(), strict=True):
        assert torch.equal(g, p.grad)


@pytest.mark.parametrize("mx", [False, True])
def test_experts_follow_cpu_autocast_as_cuda(mx):
    """Under CPU bf16 autocast the experts run as under CUDA autocast: x entering in bf16 (cast once
    for w1 and w3), bf16 output, fp32 weight gradients, the fp32 input's gradient in fp32; the
    result equals the same experts run on the bf16-cast input and weights outside autocast."""
    torch.manual_seed(4)
    ex = GroupedExperts(64, 32, 4)
    if mx:
        ex = MXGroupedExperts.from_experts(ex, MXRecipe(dim0_kernel="torch", dim1_kernel="torch",
                                                          gemm_dtype=torch.bfloat16))
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(x, counts)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in ex.parameters())
    ref = copy.deepcopy(ex)
    if not mx:  # the bf16 experts' GEMMs take bf16 weights (the MX ones quantize the fp32 weights)
        ref.to(torch.bfloat16)
    assert torch.equal(y, ref(x.detach().to(torch.bfloat16), counts))


def test_mx_model_trains_close_to_bf16_and_compiles():
    base = train_losses(make_model())
    mx_model = convert(make_model(), CPU_CFG)
    eager = train_losses(mx_model)
    compiled = train_losses(convert(make_model(), CPU_CFG), compile_=True)
    for b, e in zip(base, eager, strict=True):
        assert abs(b - e) <= 0.05 * abs(b)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def _fsdp_worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        model = convert(make_model(), CPU_CFG)
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.inp, model.experts, model.mid):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = train_losses(model)  # every rank sees the same data: losses equal the unsharded run
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save((losses, full), path)
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp2_two_ranks_same_losses(tmp_path):
    torch.set_num_threads(1)
    ref_model = convert(make_model(), CPU_CFG)
    ref = train_losses(ref_model)
    path = str(tmp_path / "rank0.pt")
    spawn_ranks(_fsdp_worker, 2, path)
    losses, sd = torch.load(path)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=0)
    plain = make_model()
    plain.load_state_dict(sd)  # sharded-and-converted keys load into the unconverted model
    for k, v in ref_model.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6)


def _gpu_cpu_losses(model_fn, cfg_cpu, cfg_gpu):
    cpu = train_losses(convert(model_fn(), cfg_cpu))
    gpu_model = convert(model_fn().cuda(), cfg_gpu)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(sum(COUNTS), 64, generator=g) for _ in range(3)]
    opt = torch.optim.SGD(gpu_model.parameters(), lr=0.05)
    out = []
    for x in xs:
        loss = (gpu_model(x.cuda(), torch.tensor(COUNTS, device="cuda")) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return cpu, out


@pytest.mark.gpu
@pytest.mark.parametrize("gemm_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8_rceil"])
def test_gpu_same_loss_as_cpu(recipe, gemm_dtype):
    """MXLinear + MX experts on the H200 (triton dim1 cast) vs CPU (torch casts), same seed."""
    cfg = MXOptions(recipe_name=recipe, mxfp8_dim1_cast_kernel_choice="triton", gemm_dtype=gemm_dtype)
    cpu_cfg = MXOptions(
        recipe_name=recipe, mxfp8_dim1_cast_kernel_choice="torch", mxfp8_dim0_cast_kernel_choice="torch"
    )
    cpu, gpu = _gpu_cpu_losses(make_model, cpu_cfg, cfg)
    tol = 1e-5 if gemm_dtype == "float32" else 2e-2
    torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), rtol=tol, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton", "cuda"])
def test_gpu_grouped_matches_cpu(kernel):
    torch.manual_seed(0)
    counts = [0, 5, 31, 33, 64, 0, 100, 7]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(sum(counts), 256, dtype=torch.bfloat16)
    w = torch.randn(8, 128, 256, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(sum(counts), 128, dtype=torch.bfloat16)
    res = []
    for dev, cfg in (
        ("cpu", MXRecipe(dim0_kernel="torch", dim1_kernel="torch")),
        ("cuda", MXRecipe(dim0_kernel=kernel, dim1_kernel=kernel)),
    ):
        # Fresh leaves on each device (a.to('cpu') is `a` itself: requires_grad_ on it would make
        # the CUDA copy a non-leaf without .grad).
        a_, w_ = (t.detach().to(dev).clone().requires_grad_() for t in (a, w))
        y = mx_grouped_mm(a_, w_.transpose(-2, -1), offs.to(dev), cfg)
        y.backward(dy.to(dev))
        res.append([t.float().cpu() for t in (y, a_.grad, w_.grad)])
    for c, g in zip(*res, strict=True):
        torch.testing.assert_close(g, c, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_compile_inductor_model():
    cfg = MXOptions(mxfp8_dim1_cast_kernel_choice="triton")
    model = convert(make_model().cuda(), cfg)
    counts = torch.tensor(COUNTS, device="cuda")
    x = torch.randn(sum(COUNTS), 64, device="cuda")
    eager = (model(x, counts) ** 2).mean()
    compiled = torch.compile(lambda x: (model(x, counts) ** 2).mean(), fullgraph=True)(x)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=0)


def test_modules_take_the_recipe():
    """MXLinear / MXGroupedExperts take an MXRecipe (`recipe`, kept as `.recipe`); anything else
    is a TypeError naming what is accepted."""
    r = mxmoe.recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch")
    lin = nn.Linear(64, 32)
    a = MXLinear.from_linear(lin, r)
    b = MXLinear.from_linear(lin, MXRecipe(scaling_mode="floor", dim0_kernel="torch", dim1_kernel="torch"))
    assert a.recipe == b.recipe == r
    x = torch.randn(5, 64)
    assert torch.equal(a(x), b(x))
    assert MXGroupedExperts(64, 32, 2).recipe == mxmoe.DEFAULT_RECIPE
    with pytest.raises(TypeError, match="recipe must be an mxmoe.MXRecipe"):
        MXGroupedExperts(64, 32, 2, recipe={"scaling_mode": "floor"})


def test_modules_refuse_dims_their_block_size_does_not_divide():
    """MXLinear / MXGroupedExperts of dims that are not multiples of the recipe's block size are
    refused when made (from_linear / from_experts too), naming the dims, not at the first forward."""
    msg = r"not divisible by the recipe's block_size=32 \(its MX GEMMs block along every dim\)"
    with pytest.raises(ValueError, match=r"^MXLinear: in_features=33 " + msg):
        MXLinear(33, 64)
    with pytest.raises(ValueError, match=r"^MXLinear: in_features=40, out_features=48 " + msg):
        MXLinear.from_linear(nn.Linear(40, 48))
    with pytest.raises(ValueError, match=r"^MXGroupedExperts: dim=40 " + msg):
        MXGroupedExperts(40, 64, 2)
    with pytest.raises(ValueError, match=r"^MXGroupedExperts: hidden_dim=48 " + msg):
        MXGroupedExperts.from_experts(GroupedExperts(64, 48, 2))
    r16 = mxmoe.recipe(block_size=16)
    assert MXLinear(48, 16, recipe=r16).weight.shape == (16, 48)
    assert MXGroupedExperts(48, 16, 2, recipe=r16).w2.shape == (2, 48, 16)


def _project_run(x, mods, shared: bool):
    """Outputs and gradients (x's and every parameter's) of the modules on one input x (B, S, 64),
    through `project` (shared) or one module call each."""
    x = x.clone().requires_grad_()
    for m in mods:
        for p in m.parameters():
            p.grad = None
    ys = project(x, *mods) if shared else tuple(m(x) for m in mods)
    gen = torch.Generator().manual_seed(3)
    sum((y.float() * torch.randn(y.shape, generator=gen)).sum() for y in ys).backward()
    return [y.detach() for y in ys] + [x.grad] + [p.grad for m in mods for p in m.parameters()]


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("autocast", [False, True])
def test_project_bit_identical_to_module_calls(autocast, monkeypatch):
    """project on MXLinears of one recipe (biases included) takes one shared op, whose outputs and
    gradients equal the modules called one by one bit for bit; nn.Linears (the bf16 model), mixed
    modules, different recipes or a hooked module are called one by one (no shared op)."""
    import mxmoe.nn.linear as linear_mod

    r = mxmoe.recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch", gemm_dtype=torch.bfloat16)
    torch.manual_seed(0)
    lins = [nn.Linear(64, n, bias=b) for n, b in ((96, False), (32, True), (32, False))]
    mxs = [MXLinear.from_linear(m, r) for m in lins]
    x = torch.randn(2, 15, 64)
    calls = []
    shared_op = linear_mod.mx_mm_shared
    monkeypatch.setattr(linear_mod, "mx_mm_shared", lambda *a: calls.append(1) or shared_op(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for mods, takes_shared in (
            (mxs, True),
            (lins, False),
            ([mxs[0], lins[1]], False),
            ([mxs[0], MXLinear.from_linear(lins[1], r.replace(scaling_mode="rceil"))], False),
        ):
            calls.clear()
            got, want = _project_run(x, mods, True), _project_run(x, mods, False)
            assert bool(calls) == takes_shared
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bits(g), _bits(w))
    handle = mxs[1].register_forward_hook(lambda m, i, o: o * 2)
    calls.clear()
    y = project(x, *mxs)
    handle.remove()
    assert not calls and torch.equal(y[1], mxs[1](x) * 2)


@pytest.mark.parametrize("cls", [GroupedExperts, MXGroupedExperts])
def test_experts_refuse_counts_that_are_not_one_per_expert(cls):
    """num_tokens_per_expert must be a 1D tensor of num_experts counts (float or int): a list failed
    inside torch.cumsum, and a shorter tensor was taken by GroupedExperts as fewer groups."""
    ex = cls(64, 32, 4)
    x = torch.randn(4, 64)
    why = r"^num_tokens_per_expert must be a tensor of num_experts=4 token counts, got list"
    with pytest.raises(TypeError, match=why):
        ex(x, [1, 1, 1, 1])
    for bad in (torch.tensor([4, 0]), torch.ones(2, 2)):
        shape = re.escape(str(tuple(bad.shape)))
        why = rf"^num_tokens_per_expert has shape {shape}; expected \(4,\): one token count per expert"
        with pytest.raises(ValueError, match=why):
            ex(x, bad)
    assert torch.equal(ex(x, torch.tensor([2, 2, 0, 0])), ex(x, torch.tensor([2.0, 2.0, 0.0, 0.0])))
    # a negative count, or counts past x's rows: GroupedExperts took them silently, MXGroupedExperts
    # named the group ends it made of them (offs), which the caller never gave
    for bad in ([3, -1, 1, 1], [2, 2, 1, 0]):
        why = rf"^num_tokens_per_expert={re.escape(str(bad))}: expected counts >= 0 that sum to at most x's 4"
        with pytest.raises(ValueError, match=why):
            ex(x, torch.tensor(bad))
    assert ex(x, torch.tensor([1, 0, 1, 0]))[2:].abs().max() == 0  # fewer: the rows after are no group's


def test_project_refuses_what_is_not_a_module():
    """project(x, weight) failed with "'Tensor' object is not callable"; it names the argument."""
    lin = MXLinear(64, 32)
    with pytest.raises(TypeError, match=r"^project: linears\[1\] is a Tensor; expected modules"):
        project(torch.randn(4, 64), lin, lin.weight.detach())
