"""mxmoe.convert: one recipe for every swapped module, the report of what was converted and skipped,
filter_fqns checks, re-conversion with another recipe."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from mxmoe.nn import ConversionReport, GroupedExperts, MXGroupedExperts, MXLinear, convert
from mxmoe.options import MXOptions
from mxmoe.recipe import DEFAULT_RECIPE, MXRecipe, recipe


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.router = nn.Linear(64, 4, bias=False)
        self.experts = GroupedExperts(64, 32, 4)
        self.odd = nn.Linear(64, 40)
        self.output = nn.Linear(40, 8)


def test_default_config_is_the_default_recipe():
    assert MXOptions().to_recipe() == DEFAULT_RECIPE
    opts = MXOptions(recipe_name="mxfp8", mxfp8_dim1_cast_kernel_choice="torch", gemm_dtype="float32")
    r = opts.to_recipe()
    assert r == recipe("mxfp8", dim1_kernel="torch", gemm_dtype=torch.float32)


def test_every_module_gets_the_one_recipe_and_the_report_says_what_happened(caplog):
    model = Tiny()
    cfg = MXOptions(
        recipe_name="mxfp8", mxfp8_dim0_cast_kernel_choice="torch", mxfp8_dim1_cast_kernel_choice="torch"
    )
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        convert(model, cfg)
    expect = cfg.to_recipe()
    assert isinstance(model.inp, MXLinear) and isinstance(model.experts, MXGroupedExperts)
    assert model.inp.recipe == model.experts.recipe == expect
    rep = model.mx_conversion
    assert isinstance(rep, ConversionReport) and rep.is_mx
    assert rep.converted == {"Linear": ["inp"], "GroupedExperts": ["experts"]}
    assert rep.skipped == [
        ("router", "filter_fqns 'router'"),
        ("odd", "dims 64x40 not divisible by 32"),
        ("output", "filter_fqns 'output'"),
    ]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mxmoe"]
    assert line == rep.summary()
    assert line.startswith(
        "mxmoe.convert: MXFP8 recipe mxfp8 (dim0_kernel=torch, dim1_kernel=torch): 1 Linear"
    )
    assert "skipped 3: router (filter_fqns 'router'), odd (dims 64x40 not divisible by 32)" in line


def test_all_skipped_does_not_claim_mxfp8():
    with pytest.warns(UserWarning, match="none is MX: experts \\(filter_fqns 'experts'\\)"):
        model = convert(Tiny(), MXOptions(filter_fqns=["inp", "experts"], allow_unconverted=True))
    rep = model.mx_conversion
    assert not rep.is_mx and rep.num_converted == 0
    assert "nothing converted, the model stays high precision" in rep.summary()
    assert "MXFP8" not in rep.summary()
    assert "inp (filter_fqns 'inp')" in rep.summary()


def test_filter_fqns_as_a_string_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=r"filter_fqns must be a list of strings, got 'output' \(use filter_fqns=\['output'\]\)",
    ):
        MXOptions(filter_fqns="output")
    cfg = MXOptions()
    cfg.filter_fqns = "router"  # changed after construction: convert checks again
    with pytest.raises(TypeError, match="filter_fqns=\\['router'\\]"):
        convert(Tiny(), cfg)
    with pytest.raises(TypeError, match="recipe must be an MXRecipe or mxmoe.MXOptions"):
        convert(Tiny(), "mxfp8")
    with pytest.raises(TypeError, match="convert: model must be a torch.nn.Module, got str"):
        convert("model.pt", MXOptions())


def test_an_empty_filter_entry_is_no_entry():
    """torchtitan 0.2 parses `--mx.filter_fqns=` as [""] (mxmoe train as []): an empty entry, a
    substring of every FQN, kept the whole model high precision; it is dropped, in every front end."""
    assert MXOptions(filter_fqns=["", " ", "router"]).filter_fqns == ["router"]
    cfg = MXOptions()
    cfg.filter_fqns = [""]  # changed after construction: convert checks again
    model = convert(Tiny(), cfg)
    rep = model.mx_conversion
    assert rep.is_mx and not any(why.startswith("filter_fqns") for _, why in rep.skipped), rep.skipped


def test_filter_entries_are_stripped_of_spaces():
    """`--mx.filter_fqns "output, router"` gives ["output", " router"]: " router" (an FQN has no
    spaces) matched nothing and the router became MX, with only a warning; entries are stripped."""
    assert MXOptions(filter_fqns=["output", " router ", "  "]).filter_fqns == ["output", "router"]
    cfg = MXOptions()
    cfg.filter_fqns = ["output", " router"]  # changed after construction: convert checks again
    model = convert(Tiny(), cfg)
    assert type(model.router) is nn.Linear
    assert ("router", "filter_fqns 'router'") in model.mx_conversion.skipped


def test_reconverting_with_another_recipe_warns_and_applies_it():
    model = convert(
        Tiny(), MXOptions(mxfp8_dim0_cast_kernel_choice="torch", mxfp8_dim1_cast_kernel_choice="torch")
    )
    other = recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch")
    with pytest.warns(UserWarning, match="2 modules were already MX with another recipe"):
        convert(model, other)
    assert model.inp.recipe == model.experts.recipe == other
    assert model.mx_conversion.reconfigured == ["inp", "experts"] and model.mx_conversion.is_mx
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same recipe again: nothing to say
        convert(model, other)


def test_convert_takes_a_recipe():
    r = MXRecipe(scaling_mode="floor", dim0_kernel="torch", dim1_kernel="torch")
    model = convert(Tiny(), r)
    assert model.experts.recipe == r
    assert "MXFP8 recipe mxfp8 (dim0_kernel=torch, dim1_kernel=torch)" in model.mx_conversion.summary()


def test_every_named_recipe_converts_by_name():
    """Each of torchao's recipe names reaches the modules through MXOptions and is named in the
    report: mxfp8_rceil_wgrad_with_hp (wgrad_with_hp) and mxfp8_emulated_rceil (the emulated GEMM)."""
    from mxmoe.nn.converter import recipe_name
    from mxmoe.recipe import RECIPES

    for name, want in RECIPES.items():
        model = convert(Tiny(), MXOptions(recipe_name=name))
        assert model.inp.recipe == model.experts.recipe == want
        assert recipe_name(want) == name
    assert recipe_name(recipe("mxfp8_rceil_wgrad_with_hp", dim1_kernel="torch")) == (
        "mxfp8_rceil_wgrad_with_hp (dim1_kernel=torch)"
    )


def test_nothing_converted_is_an_error_naming_why_unless_allowed():
    """Issue 59 case 2: MX asked and not given (a filter matching every module, experts of dims not
    divisible by 32) is an error naming why, unless allow_unconverted."""
    every = r"no module was converted.*skipped 5: 2 by filter_fqns 'p', 3 by filter_fqns 'o'.*allow_"
    with pytest.raises(ValueError, match=every):
        convert(Tiny(), MXOptions(filter_fqns=["o", "p"]))  # "o" or "p" is in every FQN
    odd = nn.Sequential(GroupedExperts(64, 33, 4))
    with pytest.raises(ValueError, match=r"0 \(dims 64x33 not divisible by 32\).*allow_unconverted=True"):
        with pytest.warns(UserWarning, match="none is MX: 0 \\(dims 64x33"):
            convert(odd, MXOptions())
    with pytest.warns(UserWarning, match="none is MX"):
        convert(odd, MXOptions(allow_unconverted=True))
    assert not odd.mx_conversion.is_mx and isinstance(odd[0], GroupedExperts)


def test_a_model_that_is_itself_a_linear_or_experts_names_what_to_use():
    """convert swaps modules inside a model: a bare nn.Linear or GroupedExperts was reported as
    'no module was converted ... skipped 0: none'; now the error names the constructor to use."""
    with pytest.raises(TypeError, match=r"model is itself a Linear.*MXLinear.from_linear\(model, recipe\)"):
        convert(nn.Linear(64, 64))
    with pytest.raises(TypeError, match=r"itself a GroupedExperts.*MXGroupedExperts.from_experts\(model"):
        convert(GroupedExperts(64, 32, 4), MXOptions(allow_unconverted=True))
    with pytest.raises(TypeError, match="model is itself a MXLinear; .*it is MX already"):
        convert(MXLinear(64, 64), recipe("mxfp8"))


def test_a_lazy_linear_not_yet_initialized_is_left_alone():
    """An uninitialized nn.LazyLinear became an MXLinear that never initialized its weight (torch's
    'uninitialized parameter' error at the first forward): convert skips it naming why, and
    MXLinear.from_linear refuses it."""
    m = nn.Sequential(nn.LazyLinear(64), nn.Linear(64, 64))
    convert(m)
    assert type(m[0]) is nn.LazyLinear and isinstance(m[1], MXLinear)
    assert m.mx_conversion.skipped == [("0", "uninitialized (lazy): run a forward first")]
    assert m(torch.randn(2, 64)).shape == (2, 64)
    with pytest.raises(ValueError, match="LazyLinear's weight is uninitialized .* run a forward first"):
        MXLinear.from_linear(nn.LazyLinear(64))


def test_a_parametrized_module_is_left_alone():
    """A Linear under torch.nn.utils.parametrize (weight_norm, ...) failed inside the swap with torch's
    "cannot assign 'torch.FloatTensor' as parameter 'weight'": convert skips it naming why, and
    from_linear / from_experts refuse one."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import weight_norm

    m = nn.Sequential(weight_norm(nn.Linear(64, 64)), nn.Linear(64, 64))
    convert(m)
    assert not isinstance(m[0], MXLinear) and isinstance(m[1], MXLinear)
    assert m.mx_conversion.skipped == [("0", "parametrized (torch.nn.utils.parametrize, e.g. weight_norm)")]
    with pytest.raises(ValueError, match="weight is parametrized .* remove the parametrization first"):
        MXLinear.from_linear(weight_norm(nn.Linear(64, 64)))

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    experts = GroupedExperts(64, 32, 2)
    parametrize.register_parametrization(experts, "w1", Scale())
    with pytest.raises(ValueError, match="experts' weights are parametrized"):
        MXGroupedExperts.from_experts(experts)


def test_hooks_of_a_converted_module_keep_running():
    """A Linear's or GroupedExperts' hooks (forward, pre-forward, full backward) were dropped
    silently by the swap; the MX module runs them, and their handles still remove them."""
    m = nn.Sequential(nn.Linear(64, 64), nn.ModuleDict({"experts": GroupedExperts(64, 32, 2)}))
    seen = []
    handles = [
        m[0].register_forward_hook(lambda mod, i, o: seen.append(("fwd", type(mod).__name__))),
        m[0].register_forward_pre_hook(lambda mod, i: seen.append(("pre", type(mod).__name__))),
        m[0].register_full_backward_hook(lambda mod, gi, go: seen.append(("bwd", type(mod).__name__))),
        m[1]["experts"].register_forward_hook(lambda mod, i, o: seen.append(("fwd", type(mod).__name__))),
    ]
    convert(m)
    x = torch.randn(4, 64, requires_grad=True)
    m[1]["experts"](m[0](x), torch.tensor([1, 3])).sum().backward()
    want = [("pre", "MXLinear"), ("fwd", "MXLinear"), ("fwd", "MXGroupedExperts"), ("bwd", "MXLinear")]
    assert seen == want
    for h in handles:
        h.remove()
    seen.clear()
    m[1]["experts"](m[0](x), torch.tensor([1, 3])).sum().backward()
    assert seen == []


def test_converting_again_reports_the_modules_already_mx(caplog):
    """Issue 59 case 12: a converter applied twice reports the MX modules, not "nothing converted"."""
    model = convert(Tiny(), MXOptions())
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        convert(model, MXOptions())  # no error: the model is MX
    rep = model.mx_conversion
    assert rep.is_mx and rep.num_converted == 0 and rep.already == ["inp", "experts"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mxmoe"]
    assert "nothing converted" not in line and "2 modules already MX with this recipe" in line


def test_moe_with_no_mx_experts_warns_naming_why():
    """Issue 57.1: an MoE model converted without MX experts warns, naming why; not when the caller
    turned the experts off (convert_grouped_experts=false)."""
    why = r"1 experts modules \(e.g. experts\) and none is MX: experts \(filter_fqns 'exp'\)"
    with pytest.warns(UserWarning, match=why):
        convert(Tiny(), MXOptions(filter_fqns=["exp", "router", "output"]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = convert(Tiny(), MXOptions(convert_grouped_experts=False))
    assert model.mx_conversion.converted["Linear"] == ["inp"]


def test_a_filter_entry_matching_nothing_warns():
    """Issue 57.1: a filter_fqns entry of the caller's that matches no module warns (a typo would
    otherwise keep nothing high precision, silently); the default entries do not."""
    with pytest.warns(UserWarning, match=r"filter_fqns entry 'atention' matches no module"):
        convert(Tiny(), MXOptions(filter_fqns=["atention", "router", "output"]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(Tiny(), MXOptions())  # "attention", "lm_head": defaults, not in Tiny


class MixerAttention(nn.Module):
    """Attention by its class, under a name that says nothing (Nemotron-H's `mixer`)."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 64)


class RouterMLP(nn.Module):
    """A router that is an MLP of its own (ZAYA's `gate`)."""

    def __init__(self):
        super().__init__()
        self.down_proj = nn.Linear(64, 64)
        self.out_proj = nn.Linear(64, 4)


class HybridBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = MixerAttention()
        self.linear_attn = nn.Sequential(nn.Linear(64, 64))  # Qwen3-Next's linear attention
        self.vision = nn.ModuleDict({"attn": nn.Linear(64, 64)})  # a vision tower's attention
        self.gate = RouterMLP()
        self.experts = GroupedExperts(64, 32, 4)
        self.mlp = nn.Linear(64, 64)


def test_attention_and_routers_stay_high_precision_by_what_they_are():
    """The default filter keeps attention and routers whatever they are called: a module of a class
    named *Attention, `linear_attn` / `attn`, and every Linear inside a router that is an MLP
    (`gate` beside `experts`); only the MLP and the experts are MX. Without "attention" in the
    filter, attention converts."""
    model = convert(HybridBlock(), MXOptions())
    rep = model.mx_conversion
    assert rep.converted == {"Linear": ["mlp"], "GroupedExperts": ["experts"]}
    assert dict(rep.skipped) == {
        "mixer.q_proj": "filter_fqns 'attention'",
        "linear_attn.0": "filter_fqns 'attention'",
        "vision.attn": "filter_fqns 'attention'",
        "gate.down_proj": "filter_fqns 'router'",
        "gate.out_proj": "filter_fqns 'router'",
    }
    model = convert(HybridBlock(), MXOptions(filter_fqns=["router"]))
    assert isinstance(model.mixer.q_proj, MXLinear) and isinstance(model.linear_attn[0], MXLinear)
    assert not isinstance(model.gate.down_proj, MXLinear)


def test_float16_modules_are_refused_before_anything_changes():
    """A float16 model (MX casts take bf16 / fp32) is an error naming the module, its dtype and the
    fix, raised before any module is swapped."""
    model = Tiny().half()
    with pytest.raises(ValueError, match=r"inp \(Linear\) has torch.float16 parameters \(2 of the modules"):
        convert(model, MXOptions())
    assert not any(isinstance(m, (MXLinear, MXGroupedExperts)) for m in model.modules())
    assert isinstance(convert(Tiny().bfloat16(), MXOptions()).inp, MXLinear)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module.*got OrderedDict"):
        convert(Tiny().state_dict(), MXOptions())


def test_a_module_registered_under_two_names_becomes_one_mx_module():
    """`m.a = m.b = linear` (one parent) and one Linear inside two blocks: every name gets the same
    MXLinear (the second name of one parent was left an nn.Linear, without a word), and the model
    computes as before on both paths."""
    lin, inner = nn.Linear(64, 64), nn.Linear(64, 64)
    m = nn.Module()
    m.a, m.b = lin, lin
    m.blocks = nn.Sequential(nn.Sequential(inner), nn.Sequential(inner))
    m.filtered = nn.Module()
    m.filtered.output = m.filtered.output2 = nn.Linear(64, 64)  # (kept high precision under both names)
    convert(m, MXOptions(filter_fqns=["output"]))
    assert type(m.a) is MXLinear and m.b is m.a and m.a.weight is lin.weight
    assert type(m.blocks[0][0]) is MXLinear and m.blocks[1][0] is m.blocks[0][0]
    assert type(m.filtered.output) is nn.Linear and m.filtered.output2 is m.filtered.output
    report = m.mx_conversion
    assert sorted(report.converted["Linear"]) == ["a", "b", "blocks.0.0", "blocks.1.0"]
    assert sorted(f for f, _ in report.skipped) == ["filtered.output", "filtered.output2"]
    x = torch.randn(4, 64)
    assert torch.equal(m.a(x), m.b(x))


def test_reconverting_with_a_block_size_the_dims_cannot_take_is_refused_before_anything_changes():
    """An MX module re-given a recipe whose block size its dims are not multiples of failed at its
    first forward; now convert refuses, naming it, and no module changes."""
    r16 = recipe(block_size=16)
    m = nn.Sequential(MXLinear(64, 64, recipe=r16), MXLinear(48, 48, recipe=r16), nn.Linear(64, 64))
    why = r"^mxmoe.convert: 1 \(MXLinear, dims 48x48\) is MX already and cannot take this recipe: its dims"
    with pytest.raises(ValueError, match=why + r" are not divisible by block_size=32 \(1 of the MX modules"):
        convert(m, DEFAULT_RECIPE)
    assert m[0].recipe == m[1].recipe == r16 and type(m[2]) is nn.Linear


def test_log_summary_must_be_a_bool():
    """log_summary="no" was taken as true (a truthy string): the summary logged and finish run."""
    model = nn.Sequential(nn.Linear(64, 64))
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=rf"^convert: log_summary={bad!r}: expected a bool$"):
            convert(model, log_summary=bad)
    assert type(model[0]) is nn.Linear


def test_subclasses_with_a_forward_or_parameters_of_their_own_are_left_alone():
    """A Linear / GroupedExperts subclass with its own forward (or a parameter the base class lacks)
    became a plain MXLinear / MXGroupedExperts without a word: the forward changed (outputs twice
    off) and the parameter left the state dict. MultiheadAttention's out_proj (its parent reads the
    weight) was reported MX while computing high precision. Each is skipped now, named; a subclass
    that only adds methods converts; a skipped wrapper's own Linear layers convert."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Lora(nn.Linear):
        def __init__(self):
            super().__init__(64, 64)
            self.lora_a = nn.Parameter(torch.zeros(8, 64))

    class Wrapped(nn.Linear):
        def __init__(self):
            super().__init__(64, 64)
            self.inner = nn.Linear(64, 64)

        def forward(self, x):
            return super().forward(self.inner(x))

    class Named(nn.Linear):
        def describe(self):
            return "named"

    class Zeroed(GroupedExperts):
        def forward(self, x, counts):
            return super().forward(x, counts) * 0

    m = nn.Module()
    m.scaled, m.lora, m.wrapped, m.named = Scaled(64, 64), Lora(), Wrapped(), Named(64, 64)
    m.mha, m.experts = nn.MultiheadAttention(64, 2), Zeroed(64, 32, 4)
    ref = copy.deepcopy(m)
    keys = set(m.state_dict())
    with pytest.warns(UserWarning, match=r"none is MX: experts \(Zeroed: a GroupedExperts subclass with a"):
        convert(m, MXOptions(filter_fqns=[]))
    assert [type(c) for c in (m.scaled, m.lora, m.wrapped, m.mha.out_proj, m.experts)] == [
        Scaled, Lora, Wrapped, nn.modules.linear.NonDynamicallyQuantizableLinear, Zeroed
    ]
    assert type(m.named) is MXLinear and type(m.wrapped.inner) is MXLinear
    assert set(m.state_dict()) == keys
    assert dict(m.mx_conversion.skipped) == {
        "scaled": "Scaled: a Linear subclass with a forward of its own",
        "lora": "Lora: a Linear subclass with 'lora_a' of its own",
        "wrapped": "Wrapped: a Linear subclass with a forward of its own",
        "mha.out_proj": "NonDynamicallyQuantizableLinear: its parent reads its weight and never calls it",
        "experts": "Zeroed: a GroupedExperts subclass with a forward of its own",
    }
    x = torch.randn(4, 64)
    assert torch.equal(m.scaled(x), ref.scaled(x)) and torch.equal(m.lora(x), ref.lora(x))
