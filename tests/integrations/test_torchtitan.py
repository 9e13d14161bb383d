"""mxmoe inside torchtitan 0.3 on CPU (its models and converters, torch >= 2.12): converters and
overrides swap the debug MoE model's modules;
the swapped modules equal mxmoe's own ops bit for bit, forward and backward; the MXFP8 token
dispatcher (2 gloo ranks) equals torchtitan's bf16 dispatcher run on quantize-dequantized rows
(the oracle's), and its gradients follow mxmoe's exchange rules."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'mxmoe[torchtitan]')")
if not importlib.metadata.version("torchtitan").startswith("0.3."):
    pytest.skip(
        f"torchtitan {importlib.metadata.version('torchtitan')} is installed, these tests need 0.3.x "
        "(tests/integrations/test_torchtitan_v0_2.py tests the 0.2 adapter)",
        allow_module_level=True,
    )
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12):
    pytest.skip(
        "torchtitan 0.3's models need torch >= 2.12 (torch.distributed.fsdp.DataParallelMeshDims, "
        f"torch.compiler._is_non_strict_tracing); this is torch {torch.__version__}",
        allow_module_level=True,
    )

from conftest import assert_same_bits, spawn_ranks  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts  # noqa: E402
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: E402

import mxmoe.nn  # noqa: E402
from mxmoe.integrations.torchtitan import (  # noqa: E402
    MXFP8AllToAllTokenDispatcher,
    MXFP8TokenDispatcherConverter,
    MXGroupedExpertsConverter,
    MXLinear,
    MXLinearConverter,
    mx_recipe,
)
from mxmoe.ops import mx_grouped_mm  # noqa: E402
from tests.quant import helpers as H  # noqa: E402
from tests.quant import oracle as O  # noqa: E402


def debug_moe_spec(converters=None):
    from torchtitan.models.deepseek_v3 import model_registry

    return model_registry("debugmodel", converters=converters)


def all_converters(**options):
    return [
        MXLinearConverter.Config(**options),
        MXGroupedExpertsConverter.Config(**options),
        MXFP8TokenDispatcherConverter.Config(),
    ]


# ------------------------------------------------------------------------------------------------
# Converters and overrides
# ------------------------------------------------------------------------------------------------


def test_converters_swap_the_debug_moe_model():
    ref_spec = debug_moe_spec()
    spec = debug_moe_spec(all_converters(recipe_name="mxfp8"))
    with torch.device("meta"):
        ref, model = ref_spec.model.build(), spec.model.build()
    mods = dict(model.named_modules())
    # parameters (names and shapes) are untouched: checkpoints and optimizers see the same model
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in ref.named_parameters()
    ]
    mx_linears = {n for n, m in mods.items() if isinstance(m, MXLinear)}
    plain_linears = {n for n, m in mods.items() if type(m) is Linear}
    assert "layers.0.feed_forward.w1" in mx_linears and "layers.1.moe.shared_experts.w2" in mx_linears
    # MXOptions' default filter, as in every front end: the output head, router gates and attention
    attention = {n for n in mods if ".attention." in n and isinstance(mods[n], Linear)}
    assert attention and not attention & mx_linears
    assert plain_linears == {"lm_head"} | {f"layers.{i}.moe.router.gate" for i in range(1, 6)} | attention
    for i in range(1, 6):
        exp = mods[f"layers.{i}.moe.routed_experts.inner_experts"]
        assert isinstance(exp, GroupedExperts) and type(exp).__name__ == "MXGroupedExperts"
        assert exp.recipe == mx_recipe("mxfp8")
        disp = mods[f"layers.{i}.moe.routed_experts"].token_dispatcher
        assert type(disp) is MXFP8AllToAllTokenDispatcher
        assert disp.mx_rows is False  # FLOOR experts requantize: rows arrive dequantized
    assert mods["layers.1.moe.shared_experts.w1"].recipe.scaling_mode == "floor"
    model.verify_module_protocol()  # the trainer's check after build


@pytest.mark.parametrize("order", ["experts_first", "dispatcher_first"])
def test_mx_rows_linked_when_the_experts_take_them(order):
    convs = all_converters()  # mxfp8_rceil: the exchange's own quantization
    if order == "dispatcher_first":
        convs = [convs[2], convs[0], convs[1]]
    spec = debug_moe_spec(convs)
    from torchtitan.models.common.moe import RoutedExperts

    routed = [c for _, c, _, _ in spec.model.traverse(RoutedExperts.Config)]
    assert len(routed) == 5 and all(c.token_dispatcher.mx_rows for c in routed)


def test_linear_converter_fqns_and_filter():
    spec = debug_moe_spec([MXLinearConverter.Config(fqns=["attention"], filter_fqns=["wkv_b"])])
    kinds = {fqn: type(c) for fqn, c, _, _ in spec.model.traverse(Linear.Config)}
    assert kinds["layers.2.attention.wq"] is MXLinear.Config
    assert kinds["layers.2.attention.wkv_b"] is Linear.Config  # filtered
    assert kinds["layers.2.moe.shared_experts.w1"] is Linear.Config  # not in fqns


def test_overrides_from_the_command_line():
    from torchtitan.config.manager import ConfigManager
    from torchtitan.config.override import apply_overrides

    config = ConfigManager().parse_args(
        [
            "--module",
            "deepseek_v3",
            "--config",
            "deepseek_v3_debugmodel",
            "--override.imports",
            'mxmoe.integrations.torchtitan.mxmoe_linear={"recipe_name": "mxfp8"}',
            "mxmoe.integrations.torchtitan.mxmoe_grouped_mm,mxmoe.integrations.torchtitan.mxmoe_a2a",
        ]
    )
    lines = apply_overrides(config.override, config)
    model = config.model_spec.model
    linears = {fqn: c for fqn, c, _, _ in model.traverse(Linear.Config)}
    assert type(linears["layers.3.moe.shared_experts.w2"]) is MXLinear.Config
    assert linears["layers.3.moe.shared_experts.w2"].recipe_name == "mxfp8"
    assert type(linears["layers.3.attention.wo"]) is Linear.Config  # MXOptions' default filter
    assert type(linears["lm_head"]) is Linear.Config
    assert type(linears["layers.3.moe.router.gate"]) is Linear.Config
    experts = [c for _, c, _, _ in model.traverse(GroupedExperts.Config)]
    assert len(experts) == 5 and all(type(c).__qualname__.startswith("MXGroupedExperts") for c in experts)
    assert all(c.recipe_name == "mxfp8_rceil" for c in experts)
    dispatchers = [c for _, c, _, _ in model.traverse(AllToAllTokenDispatcher.Config)]
    assert len(dispatchers) == 5 and all(type(c) is MXFP8AllToAllTokenDispatcher.Config for c in dispatchers)
    for fqn, c in linears.items():
        if any(k in fqn for k in ("feed_forward.", "shared_experts.")):
            assert type(c) is MXLinear.Config, fqn
    assert all(line.startswith("[Override] mxmoe.integrations.torchtitan.mxmoe_") for line in lines)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"recipe_name": "nvfp4"}, "recipe_name='nvfp4'"),
        ({"mxfp8_dim1_cast_kernel_choice": "cutedsl"}, "mxfp8_dim1_cast_kernel_choice='cutedsl'"),
        ({"gemm_dtype": "float16"}, "gemm_dtype='float16'"),
    ],
)
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        MXLinearConverter.Config(**options).build()
    with pytest.raises(ValueError, match=match):
        MXGroupedExpertsConverter.Config(**options).build()


def test_an_include_list_given_as_a_string_is_refused():
    """MXLinearConverter's fqns="w1" (a string) is refused naming the fix; it was read as the
    include list ["w", "1"], which converted every Linear with a "w" or a "1" in its FQN."""
    with pytest.raises(TypeError, match=r"MXLinearConverter: fqns must be a list of strings, got 'w1' "
                       r"\(use fqns=\['w1'\]\)"):
        MXLinearConverter.Config(fqns="w1").build()


def test_a_conversion_that_converts_nothing_stops_as_mxmoe_convert_does():
    """As mxmoe.convert, the trainer and the 0.2 converter: MX asked of a model where nothing becomes
    MX (experts or the exchange on a dense model, an include list or a filter that leaves nothing)
    is a ValueError naming allow_unconverted, which lets it through; an MoE whose experts are all
    filtered, and a caller's filter_fqns / fqns entry that matches no module, are warned of."""
    from torchtitan.models.llama3 import model_registry as dense

    from mxmoe.integrations.torchtitan import MXMoEConverter

    nothing = "MX was asked .* but no module was converted.*allow_unconverted=True"
    for conv in (MXGroupedExpertsConverter.Config(), MXFP8TokenDispatcherConverter.Config()):
        with pytest.raises(ValueError, match=nothing):
            dense("debugmodel", converters=[conv])
    with pytest.warns(UserWarning, match="MXLinearConverter: fqns entry 'zzz' matches no module"):
        with pytest.raises(ValueError, match=nothing):
            debug_moe_spec([MXLinearConverter.Config(fqns=["zzz"])])
    with pytest.raises(ValueError, match=nothing):
        debug_moe_spec([MXLinearConverter.Config(filter_fqns=["layers", "lm_head"])])
    spec = debug_moe_spec([MXGroupedExpertsConverter.Config(allow_unconverted=True, filter_fqns=["moe"])])
    kinds = {type(c) for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)}
    assert kinds == {GroupedExperts.Config}  # allowed: nothing converted
    with pytest.warns(UserWarning, match=r"the model has 5 experts modules .* none is MX: 5 by filter_fqns"):
        debug_moe_spec([MXMoEConverter.Config(filter_fqns=["experts", "lm_head"])])
    with pytest.warns(UserWarning, match="MXMoEConverter: filter_fqns entry 'zzz' matches no module"):
        debug_moe_spec([MXMoEConverter.Config(filter_fqns=["zzz", "lm_head"])])
    # mxmoe's dispatcher exchanging bf16 rows (mxfp8_a2a=False) with nothing else MX: nothing is MX
    bf16_rows = "MX was asked .* no module computes in MX: mxfp8_a2a=False leaves the 5 token dispatchers"
    off = {"convert_linears": False, "convert_grouped_experts": False, "mxfp8_a2a": False}
    with pytest.raises(ValueError, match=bf16_rows):
        debug_moe_spec([MXMoEConverter.Config(**off)])
    with pytest.raises(ValueError, match=bf16_rows):
        debug_moe_spec([MXFP8TokenDispatcherConverter.Config(mxfp8_a2a=False)])
    debug_moe_spec([MXMoEConverter.Config(**off, allow_unconverted=True)])
    debug_moe_spec([MXLinearConverter.Config(), MXFP8TokenDispatcherConverter.Config(mxfp8_a2a=False)])


def test_a_converter_applied_again_gives_its_recipe_to_what_is_mx_already():
    """A second converter over MX modules (the same converter twice, or a part converter then
    MXMoEConverter) records them as MX (no "nothing converted" error) and gives them its recipe,
    with a warning naming them, as mxmoe.convert does."""
    from mxmoe.integrations.torchtitan import MXMoEConverter

    spec = debug_moe_spec([MXMoEConverter.Config(), MXMoEConverter.Config()])  # same recipe: no warning
    assert all(c.recipe_name == "mxfp8_rceil" for _, c, _, _ in spec.model.traverse(MXLinear.Config))
    with pytest.warns(UserWarning, match=r"MXMoEConverter: 18 modules were already MX with another recipe "
                      r"\(e.g. layers.0.feed_forward.w1\); they now use mxfp8_rceil"):
        spec = debug_moe_spec([MXLinearConverter.Config(recipe_name="mxfp8"), MXMoEConverter.Config()])
    linears = [c for _, c, _, _ in spec.model.traverse(MXLinear.Config)]
    experts = [c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)]
    assert len(linears) == 18 and all(c.recipe_name == "mxfp8_rceil" for c in linears + experts)
    assert all(type(c) is not GroupedExperts.Config for c in experts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's refusal")
def test_a_kernel_this_machine_cannot_run_is_refused_when_the_converter_is_built(monkeypatch):
    """`triton` on a CPU without the Triton interpreter stops when the converter is built, naming
    the option, not at the first forward (issue 57)."""
    from mxmoe.integrations.torchtitan import MXMoEConverter

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for conv in (MXMoEConverter, MXLinearConverter, MXGroupedExpertsConverter):
        with pytest.raises(ValueError, match=rf"{conv.__name__}: mx.mxfp8_dim0_cast_kernel_choice='triton' "
                           r"cannot run on this machine's cpu: .*TRITON_INTERPRET=1"):
            conv.Config(mxfp8_dim0_cast_kernel_choice="triton").build()
        with pytest.raises(ValueError, match=r"mx.mxfp8_dim1_cast_kernel_choice='cuda' cannot run"):
            conv.Config(mxfp8_dim1_cast_kernel_choice="cuda").build()
        with pytest.raises(ValueError, match=rf"{conv.__name__}: mx.gemm_backend='native' needs a CUDA "
                           r"device of compute capability 10.x .*; use gemm_backend 'auto' or 'emulated'"):
            conv.Config(gemm_backend="native").build()  # was the first forward's RuntimeError
    # the exchange's converter and the one-part overrides too (they built, and the first exchange or
    # forward failed naming the recipe's kernel)
    from mxmoe.integrations.torchtitan import mxmoe_a2a, mxmoe_grouped_mm, mxmoe_linear

    with pytest.raises(ValueError, match=r"MXFP8TokenDispatcherConverter: mx.mxfp8_dim0_cast_kernel_choice="
                       r"'triton' cannot run on this machine's cpu"):
        MXFP8TokenDispatcherConverter.Config(mxfp8_dim0_cast_kernel_choice="triton").build()
    spec = debug_moe_spec()
    experts = next(c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config))
    dispatcher = next(c for _, c, _, _ in spec.model.traverse(AllToAllTokenDispatcher.Config))
    for override, cfg in ((mxmoe_linear, Linear.Config(in_features=64, out_features=64)),
                          (mxmoe_grouped_mm, experts), (mxmoe_a2a, dispatcher)):
        with pytest.raises(ValueError, match=rf"^{override.__name__}: mx.mxfp8_dim0_cast_kernel_choice="
                           r"'cuda' cannot run on this machine's cpu"):
            override(cfg, mxfp8_dim0_cast_kernel_choice="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it
    conv = MXLinearConverter.Config(mxfp8_dim0_cast_kernel_choice="triton").build()
    assert conv.recipe.dim0_kernel == "triton"


def test_switches_a_converter_would_ignore_are_refused():
    """A one-part converter whose own switch is off (MXLinearConverter(convert_linears=False),
    MXGroupedExpertsConverter(convert_grouped_experts=False)) converted anyway, and
    MXMoEConverter(expert_gemm="bf16", convert_grouped_experts=False) left the experts bf16 with
    expert_gemm ignored, without a word; each is refused when built, naming the options (as the 0.2
    converter and mxmoe train refuse the second)."""
    from mxmoe.integrations.torchtitan import MXMoEConverter

    for conv, switch in ((MXLinearConverter, "convert_linears"),
                         (MXGroupedExpertsConverter, "convert_grouped_experts")):
        with pytest.raises(ValueError, match=rf"^{conv.__name__}: {switch}=False, but this converter does "
                           r"nothing else: drop it from the converters"):
            debug_moe_spec([conv.Config(**{switch: False})])
    for conv in (MXMoEConverter, MXLinearConverter):
        with pytest.raises(ValueError, match=rf"^{conv.__name__}: expert_gemm='bf16' sets how the converted "
                           r"experts compute, but convert_grouped_experts=False leaves them unconverted"):
            conv.Config(expert_gemm="bf16", convert_grouped_experts=False).build()
    # the other switch of a one-part converter is not its own: still converts its part
    spec = debug_moe_spec([MXLinearConverter.Config(convert_grouped_experts=False)])
    assert any(isinstance(c, MXLinear.Config) for _, c, _, _ in spec.model.traverse(Linear.Config))


def test_tensor_parallel_is_refused():
    lin = MXLinear.Config(in_features=64, out_features=32).build()
    with pytest.raises(ValueError, match="tensor_parallel_degree=2"):
        lin.parallelize(SimpleNamespace(tp=2))
    spec = debug_moe_spec([MXGroupedExpertsConverter.Config()])
    cfg = next(c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config))
    with torch.device("meta"):
        experts = cfg.build()
    with pytest.raises(ValueError, match="tensor_parallel_degree=4"):
        experts.parallelize(SimpleNamespace(tp=4))


def test_one_option_set_and_one_line(caplog):
    """Every converter's Config is mxmoe.MXOptions (its fields, its defaults: one filter in every
    front end); swapped modules carry its recipe fields and keep the recipe as `.recipe`; the
    converter logs one line per model."""
    import dataclasses
    import logging

    from mxmoe.integrations.torchtitan import MXConverter, MXMoEConverter
    from mxmoe.options import DEFAULT_FILTER_FQNS, MXOptions

    names = {f.name: f.default for f in dataclasses.fields(MXOptions)}
    for conv in (MXMoEConverter, MXLinearConverter, MXGroupedExpertsConverter, MXFP8TokenDispatcherConverter):
        cfg = conv.Config()
        assert isinstance(cfg, MXOptions) and cfg.filter_fqns == list(DEFAULT_FILTER_FQNS), conv
        assert {n: getattr(cfg, n) for n in names if n != "filter_fqns"} == {
            n: d for n, d in names.items() if n != "filter_fqns"
        }
    assert MXConverter is MXMoEConverter
    lin = MXLinear.Config(in_features=64, out_features=32, recipe_name="mxfp8").build()
    assert lin.recipe == mx_recipe("mxfp8") and not hasattr(lin, "mx_recipe")
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        spec = debug_moe_spec([MXMoEConverter.Config(expert_gemm="bf16", mxfp8_a2a=False)])
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mxmoe"]
    assert "expert_gemm=bf16" in line
    assert line.endswith(
        ": 18 Linear -> MXLinear, 5 GroupedExperts -> MXGroupedExperts, 5 AllToAllTokenDispatcher -> "
        "mxmoe's exchange; skipped 30: lm_head (filter_fqns 'lm_head'), 24 by filter_fqns 'attention', "
        "5 by filter_fqns 'router'"
    ), line
    from torchtitan.models.common.moe import RoutedExperts

    for _, routed, _, _ in spec.model.traverse(RoutedExperts.Config):
        d = routed.token_dispatcher
        assert type(d) is MXFP8AllToAllTokenDispatcher.Config and d.mxfp8_a2a is False
        assert d.expert_gemm == "bf16" and d.mx_rows  # the experts take the exchange's MX rows


def test_the_mxmoe_override_converts_a_stock_config():
    """--override.imports mxmoe.integrations.torchtitan.mxmoe (or .mx), with MXOptions kwargs."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.config.override import apply_overrides

    for name in ("mxmoe", "mx"):
        config = ConfigManager().parse_args([
            "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--override.imports",
            f'mxmoe.integrations.torchtitan.{name}={{"recipe_name": "mxfp8", "a2a_transport": "nccl"}}',
        ])  # fmt: skip
        (line,) = apply_overrides(config.override, config)
        assert line.startswith(f"[Override] mxmoe.integrations.torchtitan.{name}: model_spec.model ")
        model = config.model_spec.model
        kinds = {fqn: type(c) for fqn, c, _, _ in model.traverse(Linear.Config)}
        assert kinds["layers.2.moe.shared_experts.w1"] is MXLinear.Config
        assert kinds["layers.2.attention.wq"] is Linear.Config and kinds["lm_head"] is Linear.Config
        experts = [c for _, c, _, _ in model.traverse(GroupedExperts.Config)]
        assert len(experts) == 5 and all(c.recipe_name == "mxfp8" for c in experts)
        dispatchers = [c for _, c, _, _ in model.traverse(AllToAllTokenDispatcher.Config)]
        assert all(type(c) is MXFP8AllToAllTokenDispatcher.Config and c.a2a_transport == "nccl"
                   for c in dispatchers) and len(dispatchers) == 5
    # an option MXOptions does not have is named with the accepted ones (was the dataclass's TypeError)
    config = ConfigManager().parse_args([
        "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--override.imports",
        'mxmoe.integrations.torchtitan.mxmoe={"recipe": "mxfp8"}',
    ])  # fmt: skip
    with pytest.raises(ValueError, match=r"mxmoe: unknown option\(s\) \['recipe'\]; accepted: \['recipe_"):
        apply_overrides(config.override, config)


def test_config_function_on_an_old_torch_says_what_to_install():
    """torchtitan 0.3's own loader (`--module mxmoe.integrations.torchtitan --config ...`) on a torch
    without torch.distributed.set_timeout (< 2.14): mxmoe's ImportError, not "Config function ...
    not found" (the loader swallows the registry's ImportError and looks the function up on the
    package, which raises it again)."""
    from torchtitan.config.manager import ConfigManager

    args = ["--module", "mxmoe.integrations.torchtitan", "--config", "deepseek_v3_debugmodel_mxmoe"]
    if hasattr(torch.distributed, "set_timeout"):  # torch >= 2.14: it loads
        assert ConfigManager().parse_args(args).model_spec is not None
        return
    for config in ("deepseek_v3_debugmodel_mxmoe", "qwen3_moe_debug_mx"):
        with pytest.raises(ImportError, match=r"trainer needs torch >= 2.14 .*set_timeout.*pip install"):
            ConfigManager().parse_args(args[:3] + [config])


# ------------------------------------------------------------------------------------------------
# Numerics: the swapped modules run mxmoe's ops, bit for bit
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_linear_equals_mxmoe_mxlinear(dtype):
    torch.manual_seed(0)
    lin = MXLinear.Config(in_features=96, out_features=64, bias=True).build()
    lin.reset_parameters()
    ref = mxmoe.nn.MXLinear.from_linear(
        torch.nn.Linear(96, 64, bias=True), mx_recipe("mxfp8_rceil")
    )
    with torch.no_grad():
        ref.weight.copy_(lin.weight)
        ref.bias.copy_(lin.bias)
    x = torch.randn(3, 37, 96, dtype=dtype)
    g = torch.randn(3, 37, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = lin(xa), ref(xb)
    assert_same_bits(ya, yb, "forward")
    ya.backward(g)
    yb.backward(g)
    assert_same_bits(xa.grad, xb.grad, "dgrad")
    assert_same_bits(lin.weight.grad, ref.weight.grad, "wgrad")
    assert_same_bits(lin.bias.grad, ref.bias.grad, "bias grad")


def _experts_pair(base_cfg, options):
    """(converted experts, unconverted torchtitan experts whose _grouped_mm is mxmoe's op), same weights."""
    torch.manual_seed(1)
    ref = base_cfg.build()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.05)
    new_cfg = MXGroupedExpertsConverter.Config(**options).build().convert(base_cfg)
    mx = new_cfg.build()
    mx.load_state_dict(ref.state_dict())
    cfg = mx_recipe(**options)
    ref._grouped_mm = lambda *, A, B_t, offs: mx_grouped_mm(A, B_t, offs, cfg)
    return mx, ref


def _check_experts(mx, ref, dim, counts):
    counts = torch.tensor(counts, dtype=torch.int64)
    rows = int(counts.sum()) + 5  # rows past the last group (padding) belong to no expert
    x = torch.randn(rows, dim)
    g = torch.randn(rows, dim)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mx(xa, counts), ref(xb, counts)
    assert_same_bits(ya, yb, "forward")
    ya.backward(g)
    yb.backward(g)
    assert_same_bits(xa.grad, xb.grad, "input grad")
    for (n, pa), (_, pb) in zip(mx.named_parameters(), ref.named_parameters(), strict=True):
        assert_same_bits(pa.grad, pb.grad, f"grad {n}")


def test_grouped_experts_equal_mx_grouped_mm():
    cfg = GroupedExperts.Config(dim=64, hidden_dim=96, num_experts=4)
    mx, ref = _experts_pair(cfg, {"recipe_name": "mxfp8_rceil", "gemm_dtype": "float32"})
    assert type(mx).__name__ == "MXGroupedExperts"
    _check_experts(mx, ref, 64, [7, 0, 33, 20])  # an empty expert, groups not multiples of 32


def test_gpt_oss_experts_equal_mx_grouped_mm():
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    cfg = GptOssGroupedExperts.Config(dim=64, hidden_dim=32, num_experts=3)
    mx, ref = _experts_pair(cfg, {"recipe_name": "mxfp8"})
    assert isinstance(mx, GptOssGroupedExperts) and type(mx).__name__ == "MXGptOssGroupedExperts"
    _check_experts(mx, ref, 64, [12, 40, 1])


def test_debug_moe_layer_trains_close_to_bf16():
    """The debug model's MoE block, converted, forward + backward on CPU: finite, close to the
    unconverted block (MXFP8 error, not a wiring error)."""
    ref_cfg = debug_moe_spec().model.layers[1].moe
    mx_cfg = debug_moe_spec(all_converters()).model.layers[1].moe
    torch.manual_seed(2)
    ref = ref_cfg.build()
    ref.init_states()
    mx = mx_cfg.build()
    mx.load_state_dict(ref.state_dict())
    x = torch.randn(2, 48, 256)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = mx(xa), ref(xb)
    rel = ((ya - yb).norm() / yb.norm()).item()
    assert torch.isfinite(ya).all() and rel < 0.1, rel
    ya.square().mean().backward()
    yb.square().mean().backward()
    for (n, pa), (_, pb) in zip(mx.named_parameters(), ref.named_parameters(), strict=True):
        if pb.grad is None:
            continue
        rel = ((pa.grad - pb.grad).norm() / pb.grad.norm()).item()
        assert rel < 0.2, (n, rel)


# ------------------------------------------------------------------------------------------------
# MXFP8 token dispatcher, 2 gloo ranks
# ------------------------------------------------------------------------------------------------


def qdq(x: torch.Tensor) -> torch.Tensor:
    """The oracle's MXFP8 quantize-dequantize of rows (e4m3, RCEIL, blocks of 32 along dim 1)."""
    scale, codes = O.oracle_quantize(H.to_f32_numpy(x), 32, "rceil", "float8_e4m3fn")
    values = O.oracle_dequantize(scale, codes, 32, "float8_e4m3fn", str(x.dtype))
    return H.to_torch(values.astype(np.float32), x.dtype)


class _QDQGrad(torch.autograd.Function):
    """Identity whose backward quantize-dequantizes the gradient (what an MXFP8 exchange of the
    gradient does, row by row)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return qdq(g.contiguous())


def _dispatcher_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        for dtype in (torch.bfloat16, torch.float32):
            _check_dispatch(rank, mesh, dtype)
        _check_sharded_linear_refused(mesh)  # needs a process group too: shares the launch
        _check_mx_rows_path(rank, mesh)
        _check_exchange_only_and_compiled(rank, mesh)
    finally:
        dist.destroy_process_group()


def _check_mx_rows_path(rank: int, mesh) -> None:
    """RoutedExperts (EP=2) with the MX rows handed to the experts equals the same module with
    rows dequantized on arrival, bit for bit: output and every gradient."""
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.moe import RoutedExperts

    from mxmoe.integrations.torchtitan import mx_grouped_experts_cls

    E, K, T, D, F = 8, 2, 19 + 5 * rank, 64, 96
    experts_cfg = mx_grouped_experts_cls(GroupedExperts).Config(dim=D, hidden_dim=F, num_experts=E // 2)
    mods = []
    for mx_rows in (True, False):
        cfg = RoutedExperts.Config(
            inner_experts=experts_cfg,
            token_dispatcher=MXFP8AllToAllTokenDispatcher.Config(
                num_experts=E, top_k=K, a2a_transport="nccl", mx_rows=mx_rows
            ),
        )
        torch.manual_seed(5 + rank)  # same weights for both
        m = cfg.build()
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        m.token_dispatcher.wire_meshes(ep_mesh=mesh)
        mods.append(m)
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(1, T, D, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).view(1, T, K)
    scores = torch.rand(1, T, K, generator=g)
    counts = torch.bincount(ids.view(-1), minlength=E)
    go = torch.randn(1, T, D, generator=g).to(torch.bfloat16)
    results = []
    set_spmd_backend("spmd_types")
    with set_current_spmd_mesh(mesh):
        for m in mods:
            xi = x.clone().requires_grad_()
            y = m(xi, scores, ids, counts)
            y.backward(go)
            results.append((y.detach(), xi.grad, [p.grad for p in m.parameters()]))
    (ya, ga, pa), (yb, gb, pb) = results
    assert_same_bits(ya, yb, f"rank {rank}: MX-rows output")
    assert_same_bits(ga, gb, f"rank {rank}: MX-rows input grad")
    for i, (a, b) in enumerate(zip(pa, pb, strict=True)):
        assert_same_bits(a, b, f"rank {rank}: MX-rows weight grad {i}")


def _routed_experts(rank: int, mesh, seed: int, **options):
    """A RoutedExperts (EP over `mesh`, 8 experts, top-2) with MX experts and mxmoe's dispatcher,
    both from MXOptions `options`; the same weights for the same seed."""
    from torchtitan.models.common.moe import RoutedExperts

    from mxmoe.integrations.torchtitan import mx_grouped_experts_cls
    from mxmoe.integrations.torchtitan.v0_3.dispatcher import link_mx_rows, mxfp8_dispatcher_config

    E, K, D, F = 8, 2, 64, 96
    recipe_options = {k: v for k, v in options.items() if k not in ("mxfp8_a2a", "a2a_transport")}
    cfg = RoutedExperts.Config(
        inner_experts=mx_grouped_experts_cls(GroupedExperts).Config(
            dim=D, hidden_dim=F, num_experts=E // 2, **recipe_options
        ),
        token_dispatcher=mxfp8_dispatcher_config(
            AllToAllTokenDispatcher.Config(num_experts=E, top_k=K), **options
        ),
    )
    link_mx_rows(cfg)
    torch.manual_seed(seed + rank)
    m = cfg.build()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return m


def _step(m, rank: int, T: int = 23):
    g = torch.Generator().manual_seed(30 + rank)
    E, K, D = 8, 2, 64
    x = torch.randn(1, T, D, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).view(1, T, K)
    scores = torch.rand(1, T, K, generator=g)
    counts = torch.bincount(ids.view(-1), minlength=E)
    y = m(x, scores, ids, counts)
    y.backward(torch.randn(1, T, D, generator=g).to(torch.bfloat16))
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _check_exchange_only_and_compiled(rank: int, mesh) -> None:
    """mxmoe's dispatcher in a RoutedExperts at EP=2: the exchange only (expert_gemm="bf16") gives
    the same bits with the MXFP8 exchange and with the bf16 one (the experts round what they get
    as the exchange would); compiled as torchtitan compiles a block (fullgraph=True, the exchange's
    collectives are custom ops) it gives eager's bits."""
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    kernels = {"mxfp8_dim0_cast_kernel_choice": "torch", "mxfp8_dim1_cast_kernel_choice": "torch"}
    a = _step(_routed_experts(rank, mesh, 7, expert_gemm="bf16", **kernels), rank)
    b = _step(_routed_experts(rank, mesh, 7, expert_gemm="bf16", mxfp8_a2a=False, **kernels), rank)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert_same_bits(u, v, f"rank {rank}: exchange only, MXFP8 vs bf16 exchange, tensor {i}")
    eager = _step(_routed_experts(rank, mesh, 8, **kernels), rank)
    m = _routed_experts(rank, mesh, 8, **kernels)
    m.compile(backend="aot_eager", fullgraph=True)
    compiled = _step(m, rank)
    for i, (u, v) in enumerate(zip(eager, compiled, strict=True)):
        assert_same_bits(v, u, f"rank {rank}: compiled vs eager, tensor {i}")


def _check_sharded_linear_refused(mesh) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    lin = MXLinear.Config(in_features=64, out_features=64).build()
    x = torch.randn(4, 64)
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate()]))
    assert lin(x).shape == (4, 64)  # whole weights: computes
    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.full_tensor().detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"MXLinear.weight is a DTensor with placements \(Shard"):
        lin(x)


def _logged_exchange(fn, reset: bool = True) -> list[str]:
    """The "mxmoe: expert parallelism ..." lines logged while fn() runs; reset: as a conversion
    (`convert_dispatchers`) does, so that the next wired dispatcher logs."""
    import logging

    from mxmoe.integrations.torchtitan.v0_3 import dispatcher as dispatcher_module

    if reset:
        dispatcher_module._LOGGED = False
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("mxmoe")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [x for x in lines if x.startswith("mxmoe: expert parallelism")]


def _check_dispatch(rank: int, mesh, dtype: torch.dtype) -> None:
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    """One dtype: the MXFP8 dispatcher against the bf16 one on quantize-dequantized rows."""
    E, K, T, D = 8, 3, 21 + 6 * rank, 64
    ref = AllToAllTokenDispatcher.Config(num_experts=E, top_k=K).build()
    mx = MXFP8AllToAllTokenDispatcher.Config(
        num_experts=E, top_k=K, a2a_transport="nccl", mxfp8_dim0_cast_kernel_choice="torch"
    ).build()
    # ref's combine exchange, with the gradient quantize-dequantized as MXFP8 moves it
    ref_combine = ref._combine_token_exchange
    ref._combine_token_exchange = lambda *a: _QDQGrad.apply(ref_combine(*a))
    records = _logged_exchange(lambda: [d.wire_meshes(ep_mesh=mesh) for d in (ref, mx)])
    # one line says what crosses the wire (once per converted model, whatever its MoE layers)
    assert len(records) == 1 and records[0].startswith(
        "mxmoe: expert parallelism over 2 ranks, transport 'nccl': the dispatch and the combine's "
        "gradient send MXFP8 rows (e4m3 elements + e8m0 scales per 32, RCEIL)"
    ), records
    assert _logged_exchange(lambda: mx.wire_meshes(ep_mesh=mesh), reset=False) == []
    g = torch.Generator().manual_seed(10 + rank)
    x = (torch.randn(T, D, generator=g) * torch.exp2(torch.randint(-8, 8, (T, 1), generator=g))).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if rank == 1:
        ids[ids >= E // 2] -= E // 2  # rank 1 sends nothing to rank 1's experts 4..7: zero splits
    scores = torch.rand(T, K, generator=g)
    counts = torch.bincount(ids.view(-1), minlength=E)

    # torchtitan's default spmd_types backend runs the MoE under the EP mesh; its bf16 exchange
    # there (list all_to_all) fails on gloo with uneven splits, so the bf16 reference runs on the
    # partial_dtensor backend (functional all_to_all_single), the MXFP8 dispatcher on both.
    w = torch.randn(D, D, generator=g).to(dtype) / 8
    go = torch.randn(T, D, generator=g).to(dtype)

    def run(d, x_in, backend):
        set_spmd_backend(backend)
        ctx = set_current_spmd_mesh(mesh) if backend == "spmd_types" else contextlib.nullcontext()
        with ctx:
            x_in = x_in.clone().requires_grad_()
            rows, counts_e, meta = d.dispatch(x_in, scores, ids, counts)
            out = d.combine(rows @ w, meta, x_in)  # expert outputs: any function of the rows
            out.backward(go)
        return rows.detach(), counts_e, meta, out.detach(), x_in.grad

    ref_out = run(ref, qdq(x), "partial_dtensor")
    for backend in ("spmd_types", "partial_dtensor"):
        ra, ca, ma, oa, ga = run(mx, x, backend)
        rb, cb, mb, ob, gb = ref_out
        assert torch.equal(ca, cb)
        assert ma.input_splits == mb.input_splits and ma.output_splits == mb.output_splits
        assert_same_bits(ra, rb, f"rank {rank} {backend}: dispatched rows")
        assert_same_bits(oa, ob, f"rank {rank} {backend}: combined output")
        # combine's gradient exchanged in MXFP8, dispatch's gradient in high precision
        assert_same_bits(ga, gb, f"rank {rank} {backend}: input grad")


def test_mxfp8_dispatcher_equals_bf16_dispatch_of_qdq_rows():
    spawn_ranks(_dispatcher_worker, 2, timeout_s=120)  # one launch: spawning costs seconds


def test_text_dataset_reads_as_torchtitan_c4_test(tmp_path):
    """The offline dataset writer produces what torchtitan's c4_test loader reads."""
    from datasets import load_dataset

    from mxmoe.integrations.torchtitan.data import write_text_dataset

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text('print("héllo")\n')
    (src / "b.py").write_text("x = 1\n")
    (src / "empty.py").write_text("\n")
    (src / "c.txt").write_text("not taken\n")
    assert write_text_dataset(tmp_path / "out", str(src)) == 2
    ds = load_dataset(str(tmp_path / "out"), split="train", cache_dir=str(tmp_path / "cache"))
    assert [r["text"] for r in ds] == ['print("héllo")\n', "x = 1\n"]


def test_fsdp_mxfp8_all_gather_reaches_the_modules():
    """`fsdp_mxfp8_all_gather` of the converter's Config reaches every swapped module's Config, and a
    module parallelized with it wraps its weights for FSDP2's MXFP8 gather (over dp_shard x cp) where
    the shards hold whole blocks; the module computes the same as without it outside FSDP."""
    from mxmoe.integrations.torchtitan import MXMoEConverter
    from mxmoe.nn.fsdp import MXShardedWeight

    spec = debug_moe_spec([MXMoEConverter.Config(fsdp_mxfp8_all_gather=True)])
    mods = [c for _, c, _, _ in spec.model.traverse(MXLinear.Config)]
    mods += [c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config)]
    assert mods and all(c.fsdp_mxfp8_all_gather for c in mods)
    torch.manual_seed(0)
    ref = MXLinear.Config(in_features=64, out_features=64).build()
    lin = MXLinear.Config(in_features=64, out_features=64, fsdp_mxfp8_all_gather=True).build()
    with torch.no_grad():
        lin.weight.copy_(ref.weight)
    lin.parallelize(SimpleNamespace(tp=1, dp_shard=2, cp=1))
    assert isinstance(lin.weight.data, MXShardedWeight)
    x = torch.randn(8, 64)
    assert_same_bits(lin(x), ref(x))
    assert type(lin.state_dict()["weight"]) is torch.Tensor
    odd = MXLinear.Config(in_features=64, out_features=64, fsdp_mxfp8_all_gather=True).build()
    odd.parallelize(SimpleNamespace(tp=1, dp_shard=4, cp=1))  # 64 rows over 4: 16 a rank, not whole blocks
    assert not isinstance(odd.weight.data, MXShardedWeight)
    cfg = next(c for _, c, _, _ in spec.model.traverse(GroupedExperts.Config))
    experts = cfg.build()
    experts.parallelize(SimpleNamespace(tp=1, dp_shard=2, cp=1))
    ws = [experts.w1_EFD, experts.w2_EDF, experts.w3_EFD]
    assert all(isinstance(w.data, MXShardedWeight) and w.data._cast_dtype == torch.bfloat16 for w in ws)
