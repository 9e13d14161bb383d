"""mxmoe inside torchtitan 0.2.x on CPU: the seed's flags (TOML and command line) reach the "mxmoe"
converter; it swaps the Linear layers and the experts of torchtitan's MoE models (DeepSeek-V3 and
Llama4 debug flavours) and their forward and backward stay within 1 % of the fp32 model; the MX
experts' forward equals the oracle's quantize-dequantize products; tensor parallelism is refused;
torchtitan 0.2's trainer runs 3 steps on CPU with the converter (patched for CPU in its own process).

torchtitan 0.2.2 and 0.3 do not share a venv: `make test` runs this file with torchtitan 0.2.2
(installed with --no-deps into a folder of its own) first on PYTHONPATH; elsewhere it is skipped.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import free_port

pytest.importorskip("torchtitan", reason="torchtitan is not installed")
if not importlib.metadata.version("torchtitan").startswith("0.2."):
    pytest.skip(
        f"torchtitan {importlib.metadata.version('torchtitan')} is installed, these tests need 0.2.x",
        allow_module_level=True,
    )

import torch.nn.functional as F  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config import JobConfig as TTJobConfig  # noqa: E402
from torchtitan.models.moe.moe import FeedForward, GroupedExperts  # noqa: E402
from torchtitan.protocols.model_converter import (  # noqa: E402
    _registry_model_converter_cls,
    build_model_converters,
)

import mxmoe.integrations.torchtitan as tt  # noqa: E402
from mxmoe.integrations.torchtitan import MX, MXGroupedExperts, MXMoEConverter  # noqa: E402
from mxmoe.integrations.torchtitan.v0_2.experts import MXFeedForward  # noqa: E402
from mxmoe.nn import MXLinear  # noqa: E402
from tests.quant import helpers as H  # noqa: E402
from tests.quant import oracle as O  # noqa: E402

PKG = "mxmoe.integrations.torchtitan"
SEED_FLAGS = [
    "--model.converters", "mxmoe",
    "--mx.recipe_name", "mxfp8",
    "--mx.mxfp8_dim1_cast_kernel_choice", "triton",
    "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
    "--mx.filter_fqns", "output,router",
    "--mx.gemm_backend", "emulated",
]  # fmt: skip


@pytest.fixture
def cpu_histc(monkeypatch):
    """torchtitan 0.2's router counts tokens with torch.histc on int64 indices, which only CUDA
    implements: on CPU, count them as floats (exact below 2^24) and give back the input's dtype."""
    histc = torch.histc

    def cpu(x, *args, **kwargs):
        if x.is_floating_point():
            return histc(x, *args, **kwargs)
        return histc(x.float(), *args, **kwargs).to(x.dtype)

    monkeypatch.setattr(torch, "histc", cpu)


def test_the_package_exports_the_0_2_adapter():
    assert tt.ADAPTER == (0, 2)
    # "mxmoe" and the seed's "mx" name the converter; torchao's own MX converters keep theirs
    assert _registry_model_converter_cls["mxmoe"] is MXMoEConverter
    assert _registry_model_converter_cls["mx"] is MXMoEConverter
    assert _registry_model_converter_cls["quantize.linear.mx"] is not MXMoEConverter


# ------------------------------------------------------------------------------------------------
# The seed's flags, TOML and command line
# ------------------------------------------------------------------------------------------------


def test_seed_flags_on_the_command_line():
    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, *SEED_FLAGS])
    assert cfg.model.converters == ["mxmoe"]
    assert cfg.mx == MX(
        recipe_name="mxfp8",
        mxfp8_dim1_cast_kernel_choice="triton",
        mxfp8_dim0_cast_kernel_choice="torch",
        filter_fqns=["output", "router"],
        gemm_backend="emulated",
    )
    r = MXMoEConverter(cfg, SimpleNamespace(tp=1)).recipe
    got = (r.scaling_mode, r.dim1_kernel, r.dim0_kernel, r.gemm_backend)
    assert got == ("floor", "triton", "torch", "emulated")


def test_seed_flags_in_toml_with_command_line_overrides(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        f'[job]\ncustom_config_module = "{PKG}"\n\n[model]\nname = "deepseek_v3"\nflavor = "debugmodel"\n'
        'converters = ["mx"]\n\n[mx]\nrecipe_name = "mxfp8"\nmxfp8_dim1_cast_kernel_choice = "torch"\n'
        'filter_fqns = ["output", "router"]\n'
    )
    cfg = ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert cfg.model.converters == ["mx"]
    assert (cfg.mx.recipe_name, cfg.mx.mxfp8_dim1_cast_kernel_choice) == ("mxfp8", "torch")
    assert cfg.mx.filter_fqns == ["output", "router"]
    assert (cfg.mx.mxfp8_dim0_cast_kernel_choice, cfg.mx.gemm_backend) == ("auto", "auto")  # defaults
    # the command line wins over the file (torchtitan's precedence)
    cfg = ConfigManager().parse_args(
        ["--job.config_file", str(toml), "--mx.recipe_name", "mxfp8_rceil", "--mx.filter_fqns", "output"]
    )
    assert (cfg.mx.recipe_name, cfg.mx.filter_fqns) == ("mxfp8_rceil", ["output"])
    assert isinstance(build_model_converters(cfg, SimpleNamespace(tp=1)).converters[0], MXMoEConverter)
    # `--mx.filter_fqns=` (torchtitan parses [""], a substring of every FQN) is no filter, as in
    # mxmoe train; an empty entry among others is dropped
    for given, want in (("", []), ("output,,router", ["output", "router"])):
        cfg = ConfigManager().parse_args(["--job.config_file", str(toml), f"--mx.filter_fqns={given}"])
        assert cfg.mx.filter_fqns == want


CONVERTER = ["--model.converters", "mxmoe"]


@pytest.mark.parametrize(
    "spelling",
    [
        ["--mx.no-convert-linears", "--mx.no_mxfp8_a2a"],  # torchtitan 0.2's flags
        ["--mx.convert_linears=false", "--mx.mxfp8-a2a", "false"],  # mxmoe train's values
        ["--mx.convert-linears=False", "--mx.mxfp8_a2a=0"],
    ],
)
def test_both_boolean_spellings_on_the_command_line(spelling):
    """`--mx.no-convert-linears` and `--mx.convert_linears=false` mean one thing here, as in `mxmoe
    train`, in the parse that imports the adapter and in every later one (issue 57)."""
    for _ in range(2):
        cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, *CONVERTER, *spelling])
        mx = cfg.mx
        assert (mx.convert_linears, mx.mxfp8_a2a, mx.convert_grouped_experts) == (False, False, True)
    args = ["--job.custom_config_module", PKG, *CONVERTER, "--mx.convert_linears=true"]
    cfg = ConfigManager().parse_args(args)
    assert cfg.mx.convert_linears is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's refusal")
def test_a_kernel_this_machine_cannot_run_is_refused_when_the_converter_is_built(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, *SEED_FLAGS])
    with pytest.raises(ValueError, match=r"model.converters mxmoe: mx.mxfp8_dim1_cast_kernel_choice='triton' "
                       r"cannot run on this machine's cpu: .*TRITON_INTERPRET=1"):
        build_model_converters(cfg, SimpleNamespace(tp=1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it
    assert MXMoEConverter(cfg, SimpleNamespace(tp=1)).recipe.dim1_kernel == "triton"


@pytest.mark.parametrize(
    "option, value",
    [
        ("recipe_name", "nvfp4"),
        ("mxfp8_dim1_cast_kernel_choice", "cutedsl"),
        ("mxfp8_dim0_cast_kernel_choice", "cutedsl"),
        ("gemm_backend", "tensor_cores"),
        ("gemm_dtype", "float16"),
    ],
)
def test_bad_options_name_the_option(option, value, capsys):
    """The [mx] choices are Literal types: tyro refuses a bad one when it parses (exit code 2),
    naming the option and listing the choices; a value set after parsing fails in the converter."""
    with pytest.raises(SystemExit) as e:
        ConfigManager().parse_args(["--job.custom_config_module", PKG, f"--mx.{option}", value])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro's box, unwrapped
    assert f"invalid choice {value!r} for argument '--mx.{option.replace('_', '-')}'" in err
    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG])
    setattr(cfg.mx, option, value)
    with pytest.raises(ValueError, match=f"{option}={value!r}"):
        MXMoEConverter(cfg, SimpleNamespace(tp=1))


def test_an_mx_section_that_is_not_mx_options_is_named():
    """A job config built by hand with `mx` a dict failed with "'dict' object has no attribute
    'check'"; a TypeError names job_config.mx and what it must be. Filter entries are stripped."""
    with pytest.raises(TypeError, match=r"job_config.mx must be an mxmoe.MXOptions .*got dict"):
        MXMoEConverter(SimpleNamespace(mx={"recipe_name": "mxfp8"}), SimpleNamespace(tp=1))
    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, "--model.converters", "mxmoe",
                                      "--mx.filter_fqns", "output, router"])
    assert cfg.mx.filter_fqns == ["output", "router"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's refusal")
def test_native_gemms_on_a_cpu_are_refused_when_the_converter_is_built():
    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, "--mx.gemm_backend", "native"])
    with pytest.raises(ValueError, match=r"model.converters mxmoe: mx.gemm_backend='native' needs a CUDA"):
        MXMoEConverter(cfg, SimpleNamespace(tp=1))


def test_bf16_expert_gemms_without_mx_experts_are_refused():
    """mx.expert_gemm='bf16' (the exchange only) with no MX experts: neither the bf16 GEMMs on rounded
    rows nor the MXFP8 exchange would apply (both are the MX experts'), as mxmoe train refuses."""
    cfg = ConfigManager().parse_args([
        "--job.custom_config_module", PKG, "--model.converters", "mxmoe", "--mx.expert_gemm", "bf16",
        "--mx.no-convert-grouped-experts",
    ])  # fmt: skip
    with pytest.raises(ValueError, match=r"mx.expert_gemm='bf16' .* mx.convert_grouped_experts=false leaves"):
        MXMoEConverter(cfg, SimpleNamespace(tp=1))


def test_tensor_parallel_is_refused():
    from torchtitan.distributed import ParallelDims

    cfg = ConfigManager().parse_args(["--job.custom_config_module", PKG, "--model.converters", "mxmoe"])
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=2.*use tensor_parallel_degree=1"):
        build_model_converters(cfg, dims)


def test_exchange_options_reach_the_experts_and_expert_parallelism(tmp_path):
    """--mx.expert_gemm, --mx.no-mxfp8-a2a and --mx.a2a_transport (tyro: choices and a bool flag; or
    the same in TOML)
    reach the converted experts; with EP > 1 the converter makes torchtitan's parallelize build
    mxmoe's style, which is torchtitan's own for experts mxmoe did not convert."""
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from mxmoe.integrations.torchtitan import MXExpertParallel
    from mxmoe.integrations.torchtitan.v0_2 import expert_parallel

    flags = ["--job.custom_config_module", PKG, "--model.converters", "mx", "--mx.expert_gemm", "bf16",
             "--mx.no-mxfp8-a2a", "--mx.a2a_transport", "nccl"]  # fmt: skip
    cfg = ConfigManager().parse_args(flags)
    assert (cfg.mx.expert_gemm, cfg.mx.mxfp8_a2a, cfg.mx.a2a_transport) == ("bf16", False, "nccl")
    toml = tmp_path / "job.toml"
    toml.write_text(f'[job]\ncustom_config_module = "{PKG}"\n\n[mx]\nexpert_gemm = "bf16"\n'
                    'mxfp8_a2a = false\na2a_transport = "nccl"\nconvert_linears = false\n')
    from_toml = ConfigManager().parse_args(["--job.config_file", str(toml)]).mx
    assert (from_toml.expert_gemm, from_toml.mxfp8_a2a, from_toml.a2a_transport) == ("bf16", False, "nccl")
    assert from_toml.convert_linears is False
    with pytest.raises(SystemExit):  # a bool flag takes no value; choices are checked when parsed
        ConfigManager().parse_args(["--job.custom_config_module", PKG, "--mx.a2a_transport", "nvlink"])
    experts = GroupedExperts(dim=64, hidden_dim=96, num_experts=4, use_grouped_mm=False)
    model = torch.nn.ModuleDict({"moe": torch.nn.ModuleDict({"experts": experts})})
    MXMoEConverter(cfg, SimpleNamespace(tp=1, ep=1)).convert(model)
    assert type(experts) is MXGroupedExperts and experts.recipe.expert_gemm == "bf16"
    assert (experts.mxfp8_a2a, experts.a2a_transport) == (False, "nccl")
    plain = GroupedExperts(dim=64, hidden_dim=96, num_experts=4, use_grouped_mm=False)
    model = torch.nn.ModuleDict({"a": GroupedExperts(dim=64, hidden_dim=96, num_experts=4,
                                                     use_grouped_mm=False)})
    MXMoEConverter(cfg, SimpleNamespace(tp=1, ep=2)).convert(model)
    assert expert_parallel.installed()
    import torchtitan.models.llama4.infra.parallelize as parallelize

    assert parallelize.ExpertParallel is MXExpertParallel and issubclass(MXExpertParallel, ExpertParallel)
    # selective activation checkpointing keeps the exchange's outputs (as torchtitan does DeepEP's)
    assert torch.ops.mxmoe.a2a_mxfp8.default in importlib.import_module(
        "torchtitan.models.deepseek_v3.infra.parallelize")._op_sac_save_list
    assert MXExpertParallel()._mx(plain, None) is None  # torchtitan's own exchange for it


def test_exchange_only_experts_are_bf16_gemms_on_rounded_rows():
    """expert_gemm="bf16": torchtitan's SwiGLU experts in bf16 on rows rounded to MX (the oracle's
    quantize-dequantize), the output's gradient rounded the same way."""
    torch.manual_seed(0)
    E, dim, hidden = 3, 64, 96
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=E, use_grouped_mm=False)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    conv = MXMoEConverter(SimpleNamespace(mx=MX(expert_gemm="bf16")), SimpleNamespace(tp=1))
    conv.convert(torch.nn.ModuleDict({"experts": experts}))
    counts = torch.tensor([7.0, 0.0, 41.0])
    x = torch.randn(48, dim).bfloat16().float().requires_grad_()
    g = torch.randn(48, dim).bfloat16().float()
    y = experts(x, counts)
    y.backward(g)
    w = [t.detach().bfloat16() for t in (experts.w1, experts.w2, experts.w3)]
    xr = _qdq(x.detach(), "rceil").bfloat16().requires_grad_()
    outs, start = [], 0
    for e, n in enumerate(counts.int().tolist()):
        xe = xr[start : start + n]
        outs.append((F.silu(xe @ w[0][e].T) * (xe @ w[2][e].T)) @ w[1][e].T)
        start += n
    want = torch.cat(outs)
    torch.testing.assert_close(y, want.float(), rtol=2**-7, atol=1e-6)
    want.backward(_qdq(g, "rceil").bfloat16())  # the output's gradient rounded; the rows' goes straight
    torch.testing.assert_close(x.grad, xr.grad.float(), rtol=2**-6, atol=1e-5)


def test_without_the_mx_section_the_defaults_apply():
    # converters registered by --experimental.custom_import only: no [mx] section in the job config
    conv = MXMoEConverter(TTJobConfig(), SimpleNamespace(tp=1))
    assert conv.options == MX() and conv.recipe == tt.mx_recipe()


# ------------------------------------------------------------------------------------------------
# Numerics
# ------------------------------------------------------------------------------------------------


def _qdq(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The oracle's MXFP8 quantize-dequantize of fp32 x (R, C) along C (blocks of 32), in fp32."""
    scale, codes = O.oracle_quantize(H.to_f32_numpy(x), 32, mode, "float8_e4m3fn")
    values = O.oracle_dequantize(scale, codes, 32, "float8_e4m3fn", "float32")
    return H.to_torch(values.astype(np.float32), x.dtype)


@pytest.mark.parametrize("recipe_name, mode", [("mxfp8_rceil", "rceil"), ("mxfp8", "floor")])
def test_mx_experts_forward_equals_the_oracle(recipe_name, mode):
    torch.manual_seed(0)
    E, dim, hidden = 3, 64, 96
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=E, use_grouped_mm=False)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    job = SimpleNamespace(mx=MX(recipe_name=recipe_name, gemm_dtype="float32"))
    conv = MXMoEConverter(job, SimpleNamespace(tp=1))
    model = torch.nn.ModuleDict({"moe": torch.nn.ModuleDict({"experts": experts})})
    conv.convert(model)
    assert type(experts) is MXGroupedExperts
    counts = torch.tensor([7.0, 0.0, 41.0])  # float, as torchtitan's router counts; an empty expert
    x = torch.randn(int(counts.sum()), dim)
    got = experts(x, counts)
    # independent reference: per expert, bf16 operands (as torchtitan's experts) quantized along K
    # by the oracle, exact fp32 products rounded to bf16 (the GEMMs' output dtype)
    xb, w1, w2, w3 = (t.detach().bfloat16().float() for t in (x, experts.w1, experts.w2, experts.w3))
    outs, start = [], 0
    for e, n in enumerate(counts.int().tolist()):
        if n == 0:
            continue
        xe = _qdq(xb[start : start + n], mode)
        g = (xe @ _qdq(w1[e], mode).T).bfloat16()
        u = (xe @ _qdq(w3[e], mode).T).bfloat16()
        h = (F.silu(g) * u).float()
        outs.append((_qdq(h, mode) @ _qdq(w2[e], mode).T).bfloat16().float())
        start += n
    want = torch.cat(outs)
    # fp32 GEMMs summing in another order can round a bf16 output to its neighbour: 1 bf16 ulp
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True])
def test_mx_experts_are_the_composition_of_the_mx_ops_bit_for_bit(autocast):
    """The experts' forward (one fused op, `mx_grouped_swiglu_mlp`) gives the output and the
    gradients of x, w1, w2, w3 of mx_grouped_mm_shared(x, (w1, w3)) then mx_grouped_mm(F.silu(g) * u,
    w2) bit for bit, fp32 parameters under bf16 autocast (torchtitan on one GPU) or not."""
    from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared

    torch.manual_seed(0)
    experts = GroupedExperts(dim=64, hidden_dim=96, num_experts=3, use_grouped_mm=False)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.05)
    conv = MXMoEConverter(SimpleNamespace(mx=MX(gemm_dtype="bfloat16")), SimpleNamespace(tp=1))
    conv.convert(torch.nn.ModuleDict({"experts": experts}))
    counts = torch.tensor([7.0, 0.0, 41.0])
    x = torch.randn(50, 64, requires_grad=True)  # 2 rows after the groups
    dy = torch.randn(50, 64)

    def grads(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = forward()
        y.backward(dy)
        out = [y.detach(), *(t.grad for t in (x, experts.w1, experts.w2, experts.w3))]
        x.grad = experts.w1.grad = experts.w2.grad = experts.w3.grad = None
        return out

    def composition():
        w1, w2, w3 = (w.bfloat16().transpose(-2, -1) for w in (experts.w1, experts.w2, experts.w3))
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        g, u = mx_grouped_mm_shared(x.bfloat16(), (w1, w3), offs, experts.recipe)
        return mx_grouped_mm(F.silu(g) * u, w2, offs, experts.recipe).type_as(x)

    for got, want in zip(grads(lambda: experts(x, counts)), grads(composition), strict=True):
        assert torch.equal(got, want)


def _model(name: str, flavor: str, converters: list[str], mx: MX | None = None):
    spec = importlib.import_module(f"torchtitan.models.{name}").get_train_spec()
    args = copy.deepcopy(spec.model_args[flavor])
    jc = TTJobConfig()
    jc.training.seq_len = 64
    args.update_from_config(jc)
    args.moe_args.use_grouped_mm = False  # the fp32 reference: torchtitan's for-loop experts
    with torch.device("meta"):
        model = spec.model_cls(args)
    jc.model.converters = converters
    if mx is not None:
        jc.mx = mx
    build_model_converters(jc, SimpleNamespace(tp=1)).convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model, args


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, flavor, filter_fqns",
    [
        ("deepseek_v3", "debugmodel", None),  # the default: experts and feed-forward layers in MX
        ("llama4", "debugmodel", ["output", "router"]),  # every Linear but the head and router gates
    ],
)
def test_moe_model_forward_backward_near_fp32(name, flavor, filter_fqns, cpu_histc):
    ref, args = _model(name, flavor, [])
    mx, _ = _model(name, flavor, ["mxmoe"], MX() if filter_fqns is None else MX(filter_fqns=filter_fqns))
    mods = dict(mx.named_modules())
    experts = [n for n, m in mods.items() if isinstance(m, GroupedExperts)]
    assert experts and all(type(mods[n]) is MXGroupedExperts for n in experts)
    mx_linears = {n for n, m in mods.items() if isinstance(m, MXLinear)}
    plain = {n for n, m in mods.items() if type(m) is torch.nn.Linear}
    assert any(".feed_forward." in n for n in mx_linears) and any(".shared_expert" in n for n in mx_linears)
    assert any(".attention." in n for n in mx_linears) == (filter_fqns is not None)
    ffs = [m for m in mods.values() if isinstance(m, FeedForward)]
    assert ffs and all(type(m) is MXFeedForward for m in ffs)  # w1 and w3 on one cast of x
    assert all(n == "output" or n.endswith("router.gate") or ".attention." in n for n in plain), plain
    # same parameters, names and values: checkpoints and optimizers see the same model
    names = [(n, p.shape) for n, p in mx.named_parameters()]
    assert names == [(n, p.shape) for n, p in ref.named_parameters()]
    for (n, p), (_, q) in zip(mx.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n

    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    labels = torch.randint(0, args.vocab_size, (2, 64))
    out = []
    for m in (ref, mx):
        logits = m(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        out.append((logits.detach(), loss.item()))
    (ref_logits, ref_loss), (mx_logits, mx_loss) = out
    grads = dict(ref.named_parameters())
    rels = {n: _rel(p.grad, grads[n].grad) for n, p in mx.named_parameters() if grads[n].grad.norm() > 0}
    print(
        f"{name} {filter_fqns}: logits {_rel(mx_logits, ref_logits):.4f}, loss {mx_loss:.5f} vs "
        f"{ref_loss:.5f}, grads median {np.median(list(rels.values())):.4f} max {max(rels.values()):.4f}"
    )
    # CPU measurements (docs/torchtitan.md): logits 0.1-0.9 % off fp32, the loss within 0.01 %,
    # parameter gradients a few % (the experts' wgrads quantize gradients along the token axis)
    assert _rel(mx_logits, ref_logits) < 0.015
    assert abs(mx_loss - ref_loss) < 5e-4 * ref_loss
    assert np.median(list(rels.values())) < 0.1 and max(rels.values()) < 0.2, rels


@pytest.mark.parametrize("autocast", [False, True])
def test_mx_feed_forward_shares_the_cast_of_x_bit_for_bit(autocast):
    """A FeedForward whose w1 and w3 are converted becomes MXFeedForward (one cast of x for both:
    `mxmoe.nn.project`), whose output and gradients (x's beside another use of x, w1, w2, w3) are
    torchtitan's forward's bit for bit; with w1 left high precision (filter_fqns) it stays a
    FeedForward."""
    torch.manual_seed(0)
    ff = FeedForward(64, 96)
    conv = MXMoEConverter(SimpleNamespace(mx=MX(filter_fqns=[])), SimpleNamespace(tp=1))
    conv.convert(torch.nn.ModuleDict({"ff": ff}))
    assert type(ff) is MXFeedForward and isinstance(ff.w1, MXLinear) and isinstance(ff.w3, MXLinear)
    x = torch.randn(2, 40, 64, requires_grad=True)
    dy = torch.randn(2, 40, 64)

    def grads(forward):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = forward(x * 0.5) + x  # x's gradient: a sum with another use of it
        y.backward(dy)
        out = [y.detach(), *(t.grad for t in (x, ff.w1.weight, ff.w2.weight, ff.w3.weight))]
        x.grad = ff.w1.weight.grad = ff.w2.weight.grad = ff.w3.weight.grad = None
        return out

    for got, want in zip(grads(ff), grads(lambda h: FeedForward.forward(ff, h)), strict=True):
        assert torch.equal(got, want)
    kept = FeedForward(64, 96)
    MXMoEConverter(SimpleNamespace(mx=MX(filter_fqns=["w1"])), SimpleNamespace(tp=1)).convert(
        torch.nn.ModuleDict({"ff": kept})
    )
    assert type(kept) is FeedForward and isinstance(kept.w3, MXLinear)

def test_byte_tokenizer_is_the_bytes_for_torchtitan(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer

    assert write_byte_tokenizer(tmp_path) == 258
    tok = HuggingFaceTokenizer(str(tmp_path))
    text = "déjà vu\x00\n\t" + bytes(range(32, 256)).decode("latin-1")
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, *text.encode("utf-8"), tok.eos_id] and (tok.bos_id, tok.eos_id) == (256, 257)
    assert tok.decode(ids[1:-1]) == text


# ------------------------------------------------------------------------------------------------
# torchtitan 0.2's trainer, 3 steps on CPU
# ------------------------------------------------------------------------------------------------

STEP_LINE = re.compile(r"^mxmoe-test step (\d+) loss (\S+) grad_norm (\S+)$", re.M)  # the runner's


def _train(tmp_path, runs: dict[str, list[str]], *, world: int = 1, steps: int = 3):
    """torchtitan 0.2's trainer on CPU, `steps` steps per run, the runs one after another in one
    process per rank (each seeded alike: same initialization and batches); per run its losses and
    rank 0's log. Every process is killed if the ranks are not done in time."""
    ports = []  # a free port per run's rendezvous (the runner's), each its own
    while len(ports) < len(runs):
        if (port := str(free_port())) not in ports:
            ports.append(port)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MASTER_PORT": ports[0], "MXMOE_TEST_PORTS": ",".join(ports),
           "WORLD_SIZE": str(world), "PYTHONPATH": os.pathsep.join([*sys.path, str(root)])}
    cmd = [sys.executable, str(Path(__file__).with_name("torchtitan_v0_2_cpu_train.py"))]
    for i, (name, flags) in enumerate(runs.items()):
        cmd += ["--next-run"] if i else []
        cmd += [
            "--job.config_file", str(root / "mxmoe/configs/torchtitan/deepseek_v3_debug_0.2.toml"),
            "--job.dump_folder", str(tmp_path / name),
            "--model.hf_assets_path", str(tmp_path / "tokenizer"),
            "--training.dataset_path", str(tmp_path / "data"),
            "--training.steps", str(steps), "--training.local_batch_size", "1", "--training.seq_len", "64",
            "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--debug.seed", "0",
            *flags,
        ]  # fmt: skip
    outs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(outs[r], "w") as f:
            procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                          stdout=f, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=540) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log = re.sub(r"\x1b\[[0-9;]*m", "", outs[0].read_text())
    assert codes == [0] * world, f"exit codes {codes}\n{log[-4000:]}"
    logs = re.split(r"^=== run \d+ ===$", log, flags=re.M)[1:]
    assert len(logs) == len(runs), log[-4000:]
    return {name: ([float(m[2]) for m in STEP_LINE.finditer(text)], text)
            for name, text in zip(runs, logs, strict=True)}


def _grad_norms(log: str) -> list[float]:
    """Each step's gradient norm in a run's log (the runner's, full precision)."""
    return [float(m[3]) for m in STEP_LINE.finditer(log)]


@pytest.mark.slow
def test_trainer_runs_three_steps_with_the_converter(tmp_path):
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))  # a small corpus
    out = _train(tmp_path, {"fp32": [], "mx": ["--model.converters", "mxmoe", "--mx.recipe_name", "mxfp8"]})
    (ref, _), (mx, log) = out["fp32"], out["mx"]
    # one line per model: what was converted, what was skipped (grouped by why)
    (line,) = [x for x in log.splitlines() if "mxmoe.convert:" in x]
    assert "MXFP8 recipe mxfp8: 18 Linear -> MXLinear, 5 GroupedExperts -> MXGroupedExperts" in line
    assert line.endswith("skipped 30: 24 by filter_fqns 'attention', 5 by filter_fqns 'router', "
                         "output (filter_fqns 'output')"), line
    assert len(ref) == len(mx) == 3 and all(math.isfinite(v) for v in ref + mx)
    # same initialization and batch: the first loss is the forward's, MX within 0.1 % of fp32
    assert abs(mx[0] - ref[0]) < 1e-3 * ref[0], (ref, mx)
    assert mx[2] < mx[0] and ref[2] < ref[0], (ref, mx)  # both train


def _row_calls(path: Path, dim: int) -> tuple[list[int], list[int], list[int]]:
    """Rows the exchange handed the collective on rank 0 (the runner's log, uint8 rows): MXFP8
    element rows (dim bytes), their scale rows (dim / 32) and bf16 rows (2 * dim)."""
    import json

    calls = json.loads(Path(f"{path}.rank0").read_text())
    rows = {n: [s[0] for d, s in calls if d == "torch.uint8" and len(s) == 2 and s[1] == n]
            for n in (dim, dim // 32, 2 * dim)}
    return rows[dim], rows[dim // 32], rows[2 * dim]


@pytest.mark.slow
def test_trainer_at_expert_parallel_2_exchanges_mxfp8(tmp_path):
    """torchtitan 0.2's trainer at --parallelism.expert_parallel_degree 2 (2 gloo ranks, FSDP over
    both, batch 1 each, fp32 parameters, 2 steps) with --model.converters mxmoe:

    - the experts' rows cross as MXFP8 (e4m3 elements + e8m0 scales) in the dispatch and the
      combine's gradient, as bf16 in the combine and the dispatch's gradient (the bytes handed to
      the collective say so), and with --mx.mxfp8_a2a false as bf16 both ways;
    - the MXFP8 exchange changes bytes, not numbers: the losses and gradient norms equal, bit for
      bit, those of the same run on a transport that sends the same MX-rounded rows as bf16 (a test
      transport "auto" takes there), and those of the bf16 exchange;
    - compiled (--compile.enable, aot_eager) equals eager;
    - the exchange only (--mx.expert_gemm bf16) at EP=2 equals EP=1 (same ranks and data) up to the
      order of the weight-gradient sums."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch"]  # fmt: skip
    ep2 = ["--parallelism.expert_parallel_degree", "2"]
    logs = {name: tmp_path / f"{name}.calls" for name in ("mxfp8", "rounded", "bf16")}
    out = _train(tmp_path, {
        "mxfp8": mx + ep2 + ["--mxmoe.exchange_log", str(logs["mxfp8"])],
        "rounded": mx + ep2 + ["--mxmoe.test_transport", "rounded_bf16", "--mxmoe.exchange_log",
                               str(logs["rounded"])],
        "bf16": mx + ep2 + ["--mx.no-mxfp8-a2a", "--mxmoe.exchange_log", str(logs["bf16"])],
        "compiled": mx + ep2 + ["--compile.enable", "--compile.backend", "aot_eager"],
        "only_ep2": mx + ep2 + ["--mx.expert_gemm", "bf16"],
        "only_ep1": mx + ["--mx.expert_gemm", "bf16"],
    }, world=2, steps=2)  # fmt: skip
    losses = {name: v[0] for name, v in out.items()}
    assert all(len(v) == 2 and all(math.isfinite(x) for x in v) for v in losses.values()), losses
    # 5 MoE layers x 2 steps: per layer and step one MXFP8 dispatch and one MXFP8 combine gradient,
    # one bf16 combine and one bf16 dispatch gradient (dim 256: 256 element bytes + 8 scale bytes a row)
    elems, scales, bf16 = _row_calls(logs["mxfp8"], 256)
    assert len(elems) == len(scales) == len(bf16) == 20 and elems == scales and sum(elems) > 0, logs
    for name in ("rounded", "bf16"):
        elems, scales, bf16 = _row_calls(logs[name], 256)
        assert elems == scales == [] and len(bf16) == 40, name
    # one line per run says what crosses the wire
    said = {name: [x for x in v[1].splitlines() if "mxmoe: expert parallelism" in x]
            for name, v in out.items()}
    assert {name: len(lines) for name, lines in said.items()} == {**{n: 1 for n in out}, "only_ep1": 0}, said
    assert "over 2 ranks" in said["mxfp8"][0], said
    assert "send MXFP8 rows (e4m3 elements + e8m0 scales per 32, RCEIL)" in said["mxfp8"][0], said
    assert "the MXFP8 exchange is off" in said["bf16"][0], said
    norms = {name: _grad_norms(v[1]) for name, v in out.items()}
    # the same numbers, bit for bit, on the MX-rounded bf16 rows, and on unrounded bf16 rows too:
    # the MX experts round what they are given as the exchange would (the gradient norms as well:
    # Adam's first update is about the gradients' signs alone)
    for name in ("rounded", "bf16"):
        assert losses[name] == losses["mxfp8"] and norms[name] == norms["mxfp8"], (name, losses, norms)
    assert losses["compiled"] == pytest.approx(losses["mxfp8"], rel=1e-6), losses
    assert norms["compiled"] == pytest.approx(norms["mxfp8"], rel=1e-5), norms
    only1, only2 = losses["only_ep1"], losses["only_ep2"]
    assert only2[0] == pytest.approx(only1[0], rel=1e-6) and only2[1] == pytest.approx(only1[1], rel=1e-4)


def test_ep_script_commands_parse(tmp_path):
    """scripts/torchtitan_ep.sh's runs (scripts/torchtitan_ep.py) are what torchtitan 0.2.2's parser
    and mxmoe's bench accept: for 2 and 4 GPUs, every trainer run's flags parse (its `[mx]` options
    included), its custom import registers the model flavor and the torchao peer's converter, the
    converters it names are registered, and the all-to-all bench's flags parse."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import torchtitan_ep

    from mxmoe.bench.a2a import parse_args as a2a_args

    for ngpu in (2, 4):
        cmds = torchtitan_ep.commands(tmp_path, tmp_path / "data", tmp_path / "tok", ngpu, steps=30,
                                      flavor="mxmoe_ep", local_batch=2, seq_len=8192, compile=True)
        assert sorted(cmds) == sorted(torchtitan_ep.RUNS)
        for name in torchtitan_ep.VARIANTS:
            cmd = cmds[name]
            assert cmd[cmd.index("--nproc_per_node") + 1] == str(ngpu)
            cfg = ConfigManager().parse_args(cmd[cmd.index("torchtitan.train") + 1 :])
            importlib.import_module(cfg.experimental.custom_import)
            spec = importlib.import_module("torchtitan.models.deepseek_v3").get_train_spec()
            args = spec.model_args[cfg.model.flavor]
            assert (args.dim, args.moe_args.num_experts, args.moe_args.top_k) == (5120, 16, 8)
            assert cfg.parallelism.expert_parallel_degree == ngpu and cfg.compile.enable
            assert all(c in _registry_model_converter_cls for c in cfg.model.converters), name
            if name == "exchange":
                assert (cfg.mx.expert_gemm, cfg.mx.convert_linears, cfg.mx.mxfp8_a2a) == ("bf16", False, True)
        a2a = cmds["a2a"]
        ns = a2a_args(a2a[a2a.index("a2a") + 1 :])
        assert (ns.batches, ns.seq, ns.dims) == ([16], 8192, [5120])


@pytest.mark.slow
def test_trainer_fsdp_mxfp8_all_gather_equals_the_bf16_gather(tmp_path):
    """torchtitan 0.2's trainer, FSDP over 2 gloo ranks, --mx.fsdp_mxfp8_all_gather true: the MX
    weights gather as MXFP8 (the log says which), and the losses and gradient norms equal, bit for
    bit, those of the same run gathering the weights in the parameter dtype: fp32 parameters, and
    bf16 ones (what GPU runs gather) with gradient accumulation (2 microbatches a step)."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch"]  # fmt: skip
    bf16 = ["--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "4"]
    on = ["--mx.fsdp_mxfp8_all_gather"]
    out = _train(tmp_path, {"hp": mx, "mxg": mx + on, "hp_bf16": mx + bf16, "mxg_bf16": mx + bf16 + on},
                 world=2, steps=2)
    for name in ("mxg", "mxg_bf16"):
        (hp, hp_log), (mxg, log) = out["hp" + name[3:]], out[name]
        (line,) = [x for x in log.splitlines() if "fsdp_mxfp8_all_gather:" in x]
        assert "weights gather MXFP8" in line and " 0 weights" not in line, line
        assert "fsdp_mxfp8_all_gather" not in hp_log
        assert len(hp) == 2 and mxg == hp and _grad_norms(log) == _grad_norms(hp_log), (name, hp, mxg)
    assert out["hp"][0] != out["hp_bf16"][0]  # the bf16 runs are other runs


@pytest.mark.slow
def test_trainer_compiled_fsdp_mxfp8_all_gather_equals_eager(tmp_path):
    """torchtitan 0.2's trainer with --compile.enable, FSDP over 2 gloo ranks: with its default
    policy (every block resharded after the forward) the MX weights gather as MXFP8 under compile,
    with the losses of the compiled run without the option (bit for bit; compiled and eager differ in
    the last bit on torch 2.11, with or without it); with blocks that keep their weights for the
    backward (`fsdp_reshard_after_forward never`) or recompute their forward in it (activation
    checkpointing) they gather high precision, the log says why, and the losses are the same."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch"]  # fmt: skip
    compiled = mx + ["--mx.fsdp_mxfp8_all_gather", "--compile.enable", "--compile.backend", "aot_eager"]
    never = compiled + ["--parallelism.fsdp_reshard_after_forward", "never"]
    ac = compiled + ["--activation_checkpoint.mode", "full"]
    runs = {"off": mx + compiled[-3:], "default": compiled, "never": never, "ac": ac}
    out = _train(tmp_path, runs, world=2, steps=2)
    (eager, _), (default, log), (kept, kept_log), (rec, ac_log) = (out[k] for k in runs)
    assert "weights gather MXFP8" in log and "gather in the compute dtype" not in log, log[-3000:]
    assert "does not reshard after the forward" in kept_log, kept_log[-3000:]
    assert "activation checkpointing recomputes its forward" in ac_log, ac_log[-3000:]
    assert len(eager) == 2 and default == kept == rec == eager, (eager, default, kept, rec)


def test_fsdp_mx_gather_script_commands_parse(tmp_path):
    """scripts/fsdp_mx_gather.py's torchtitan runs parse with torchtitan 0.2.2's parser for 2, 4 and
    8 GPUs: FSDP over every GPU, no expert parallelism, the option only in the mx_gather run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import fsdp_mx_gather

    for ngpu in (2, 4, 8):
        cmds = fsdp_mx_gather.commands(tmp_path, ngpu, steps=30, device="cuda", config="moe_1b")
        for name in fsdp_mx_gather.TITAN:
            cmd = cmds[name]
            cfg = ConfigManager().parse_args(cmd[cmd.index("torchtitan.train") + 1 :])
            importlib.import_module(cfg.experimental.custom_import)
            assert cfg.parallelism.data_parallel_shard_degree == -1
            assert cfg.parallelism.expert_parallel_degree == 1 and cfg.compile.enable
            assert cfg.mx.fsdp_mxfp8_all_gather == (name == "titan_mx_gather"), name
            assert all(c in _registry_model_converter_cls for c in cfg.model.converters), name


@pytest.mark.slow
def test_trainer_ep_x_fsdp_mxfp8_all_gather_equals_the_bf16_gather(tmp_path):
    """EP 2 x FSDP over 4 gloo ranks: the expert weights (3D), EP-sharded, then FSDP-sharded over the
    other 2 ranks, gather as MXFP8 too, with the losses and gradient norms of the run without it,
    eager and compiled (aot_eager; compiled and eager differ in the last bits at EP 2 with or without
    the option)."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch",
          "--parallelism.expert_parallel_degree", "2"]  # fmt: skip
    c, on = ["--compile.enable", "--compile.backend", "aot_eager"], ["--mx.fsdp_mxfp8_all_gather"]
    out = _train(tmp_path, {"hp": mx, "mxg": mx + on, "hp_c": mx + c, "mxg_c": mx + on + c}, world=4, steps=2)
    for name in ("mxg", "mxg_c"):
        hp, hp_log = out["hp" + name[3:]]
        mxg, log = out[name]
        assert "gathers high precision" not in log and "not MXFP8" not in log, log[-3000:]
        assert log.count("experts w1, w2, w3 gather MXFP8 (FSDP over 2 ranks after EP)") == 5, log[-3000:]
        assert len(hp) == 2 and mxg == hp and _grad_norms(log) == _grad_norms(hp_log), (name, hp, mxg)
@pytest.mark.parametrize(
    "line, error, message",
    [
        ('recipe_name = "nvfp4"', ValueError, "mx.recipe_name='nvfp4': expected one of"),
        ('mxfp8_a2a = "yes"', TypeError, "mx.mxfp8_a2a='yes': expected a bool"),
        ('filter_fqns = "output"', TypeError, "mx.filter_fqns must be a list of strings"),
        ("block_size = 16", ValueError, "unknown key(s) ['block_size']; [mx] has ['recipe_name'"),
    ],
)
def test_a_bad_mx_value_in_a_toml_names_the_file_and_the_key(tmp_path, line, error, message):
    """A bad [mx] value in a TOML job config: the error names the file and mx.<key> (it once named
    only the field, or torchtitan's "Invalid field names in <class ...>")."""
    toml = tmp_path / "job.toml"
    toml.write_text(f'[job]\ncustom_config_module = "{PKG}"\n\n[mx]\n{line}\n')
    with pytest.raises(error) as e:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert str(e.value).startswith(f"{toml}: [mx]: ") and message in str(e.value), str(e.value)
    # a good [mx] is read as before
    toml.write_text(f'[job]\ncustom_config_module = "{PKG}"\n\n[mx]\nrecipe_name = "mxfp8"\n')
    assert ConfigManager().parse_args(["--job.config_file", str(toml)]).mx.recipe_name == "mxfp8"


def test_fsdp_mxfp8_all_gather_without_the_mxmoe_converter_is_warned_of(caplog):
    """`--mx.fsdp_mxfp8_all_gather` with no mxmoe converter gathers nothing as MXFP8: a warning says
    so when the job config is parsed (it was ignored without a word); not an error, as a TOML that
    bf16 runs share may hold it."""
    import logging

    base = ["--job.custom_config_module", PKG, "--mx.fsdp_mxfp8_all_gather"]
    with caplog.at_level(logging.WARNING):
        cfg = ConfigManager().parse_args(base)
    assert cfg.mx.fsdp_mxfp8_all_gather and cfg.model.converters == []
    assert "mx.fsdp_mxfp8_all_gather=true, but model.converters=[] names no mxmoe converter" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ConfigManager().parse_args([*base, "--model.converters", "mxmoe"])
    assert "fsdp_mxfp8_all_gather" not in caplog.text


def test_mx_options_without_the_mxmoe_converter_are_an_error_unless_allowed(tmp_path):
    """Issue 59 case 2: `--mx.*` options asking for MX with no mxmoe converter named are refused
    when the job config is parsed, naming them and the fix; `--mx.allow-unconverted` lets the run
    train high precision. The TOML's [mx] section is a template bf16 runs share: not an error."""
    base = ["--job.custom_config_module", PKG]
    with pytest.raises(ValueError, match=r"mx.recipe_name='mxfp8' given, but model.converters=\[\] names "
                       r"no MX converter.*--model.converters mxmoe.*allow_unconverted"):
        ConfigManager().parse_args([*base, "--mx.recipe_name", "mxfp8"])
    cfg = ConfigManager().parse_args([*base, "--mx.recipe_name", "mxfp8", "--mx.allow-unconverted"])
    assert cfg.mx.allow_unconverted and cfg.model.converters == []
    ConfigManager().parse_args([*base, "--mx.mxfp8_dim1_cast_kernel_choice", "torch"])  # asks no MX
    toml = tmp_path / "job.toml"
    toml.write_text(f'[job]\ncustom_config_module = "{PKG}"\n[model]\nconverters = []\n'
                    '[mx]\nfilter_fqns = ["output", "router"]\nrecipe_name = "mxfp8"\n')
    assert ConfigManager().parse_args(["--job.config_file", str(toml)]).mx.recipe_name == "mxfp8"
    with pytest.raises(ValueError, match=r"mx.expert_gemm='bf16' given"):
        ConfigManager().parse_args(["--job.config_file", str(toml), "--mx.expert_gemm", "bf16"])


def test_a_conversion_that_converts_nothing_is_an_error_and_again_is_not_nothing():
    """Issue 59 cases 2 and 12: the converter converting nothing (experts of hidden dim 33, a filter
    matching every module) is an error naming why unless allow_unconverted; applied twice to an MX
    model it reports the modules already MX (no "nothing converted")."""
    def model(hidden):
        experts = GroupedExperts(dim=64, hidden_dim=hidden, num_experts=4, use_grouped_mm=False)
        return torch.nn.ModuleDict({"moe": torch.nn.ModuleDict({"experts": experts})})

    for m, opts, why in ((model(33), MX(), "dims 64x33 not divisible by 32"),
                         (model(64), MX(filter_fqns=["moe"]), "filter_fqns 'moe'")):
        with pytest.raises(ValueError, match=f"no module was converted.*{why}.*allow_unconverted"):
            with pytest.warns(UserWarning, match=f"none is MX: moe.experts \\({why}"):
                MXMoEConverter(SimpleNamespace(mx=opts), SimpleNamespace(tp=1)).convert(m)
        opts.allow_unconverted = True
        with pytest.warns(UserWarning, match="none is MX"):
            MXMoEConverter(SimpleNamespace(mx=opts), SimpleNamespace(tp=1)).convert(m)
        assert not isinstance(m["moe"]["experts"], MXGroupedExperts)
    m = model(64)
    conv = MXMoEConverter(SimpleNamespace(mx=MX()), SimpleNamespace(tp=1))
    conv.convert(m)
    conv.convert(m)
    rep = m.mx_conversion
    assert rep.is_mx and rep.already == ["moe.experts"]
    assert "nothing converted" not in rep.summary() and "1 modules already MX" in rep.summary()


@pytest.mark.slow
def test_trainer_activation_checkpointing_equals_none_at_ep2(tmp_path):
    """torchtitan 0.2's trainer at EP 2 (2 gloo ranks) with --activation_checkpoint.mode selective and
    full: the losses and gradient norms of the run without it, bit for bit (the MX ops' backward
    once read their saved tensors twice, which non-reentrant checkpointing refuses)."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch", "--parallelism.expert_parallel_degree", "2"]
    runs = {mode: mx + ["--activation_checkpoint.mode", mode] for mode in ("none", "selective", "full")}
    out = _train(tmp_path, runs, world=2, steps=2)
    (ref, ref_log) = out["none"]
    assert len(ref) == 2
    for mode in ("selective", "full"):
        got, log = out[mode]
        assert got == ref and _grad_norms(log) == _grad_norms(ref_log), (mode, got, ref)


@pytest.mark.slow
def test_trainer_hsdp_mxfp8_all_gather_equals_the_bf16_gather(tmp_path):
    """HSDP over 4 gloo ranks (2 replicas x FSDP over 2): the MX weights gather as MXFP8 within each
    replica, with the losses and gradient norms of the run without the option, bit for bit."""
    from mxmoe.integrations.torchtitan.data import write_byte_tokenizer, write_text_dataset

    write_byte_tokenizer(tmp_path / "tokenizer")
    write_text_dataset(tmp_path / "data", str(Path(torch.__file__).parent / "optim"))
    mx = ["--model.converters", "mxmoe", "--mx.mxfp8_dim0_cast_kernel_choice", "torch",
          "--mx.mxfp8_dim1_cast_kernel_choice", "torch", "--parallelism.data_parallel_replicate_degree", "2",
          "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    out = _train(tmp_path, {"hp": mx, "mxg": mx + ["--mx.fsdp_mxfp8_all_gather"]}, world=4, steps=2)
    (hp, hp_log), (mxg, log) = out["hp"], out["mxg"]
    (line,) = [x for x in log.splitlines() if "fsdp_mxfp8_all_gather:" in x]
    assert "weights gather MXFP8" in line and " 0 weights" not in line and "not MXFP8" not in log, line
    assert len(hp) == 2 and mxg == hp and _grad_norms(log) == _grad_norms(hp_log), (hp, mxg)
