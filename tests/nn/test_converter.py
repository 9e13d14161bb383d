"""mxmoe.convert: one recipe for every swapped module, the report of what was converted and skipped,
filter_fqns checks, re-conversion with another recipe."""

from __future__ import annotations

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
    model = convert(Tiny(), MXOptions(filter_fqns=["inp", "experts"]))
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
