"""The one recipe object: defaults, named recipes, checks, and the casts reading it."""

import pytest
import torch

import mxmoe
from mxmoe.recipe import DEFAULT_RECIPE, DEFAULT_RECIPE_NAME, RECIPES, MXRecipe, recipe, recipe_from_options


def test_one_default_everywhere():
    assert MXRecipe() == DEFAULT_RECIPE == recipe() == RECIPES[DEFAULT_RECIPE_NAME]
    assert DEFAULT_RECIPE_NAME == "mxfp8_rceil" and DEFAULT_RECIPE.scaling_mode == "rceil"
    assert recipe("mxfp8").scaling_mode == "floor"
    assert DEFAULT_RECIPE.elem_dtype == torch.float8_e4m3fn and DEFAULT_RECIPE.block_size == 32
    assert mxmoe.MXRecipe is MXRecipe and mxmoe.DEFAULT_RECIPE is DEFAULT_RECIPE


def test_frozen_hashable_and_replace_checks_again():
    r = recipe("mxfp8", dim1_kernel="torch")
    assert r.dim1_kernel == "torch" and r.scaling_mode == "floor"
    assert hash(r) == hash(MXRecipe(scaling_mode="floor", dim1_kernel="torch"))
    with pytest.raises(AttributeError):
        r.block_size = 16  # type: ignore[misc]
    with pytest.raises(ValueError, match="dim0_kernel='cutlass' is not a cast kernel"):
        r.replace(dim0_kernel="cutlass")


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"scaling_mode": "round"}, ValueError, "scaling_mode='round'"),
        ({"block_size": 24}, ValueError, "block_size=24"),
        # equal to 32 but not an int: was found in the format registry and kept as it was
        ({"block_size": 32.0}, ValueError, r"^block_size=32.0 is not supported; expected a power of two"),
        ({"block_size": True}, ValueError, r"^block_size=True is not supported"),
        ({"elem_dtype": torch.bfloat16}, TypeError, "elem_dtype=torch.bfloat16"),
        ({"dim1_kernel": "x"}, ValueError, "dim1_kernel='x'"),
        ({"gemm_backend": "magic"}, ValueError, "gemm_backend='magic'"),
        ({"gemm_dtype": torch.float16}, TypeError, "gemm_dtype=torch.float16"),
        ({"expert_gemm": "fp8"}, ValueError, r"expert_gemm='fp8' is not an expert GEMM mode"),
        ({"expert_gemm": "hp"}, ValueError, r"expert_gemm='hp' is now expert_gemm='bf16'"),
    ],
)
def test_bad_fields_are_named(kwargs, err, match):
    with pytest.raises(err, match=match):
        MXRecipe(**kwargs)


def test_removed_gemm_backend_says_why_and_where():
    """gemm_backend="fp8" (removed) is refused everywhere a recipe is made, with the reason and the
    docs section that records it; that section exists."""
    from pathlib import Path

    from mxmoe import MXOptions
    from mxmoe.recipe import GEMM_BACKENDS, REMOVED_GEMM_BACKENDS, recipe_from_options

    assert "fp8" in REMOVED_GEMM_BACKENDS and "fp8" not in GEMM_BACKENDS
    why = r"gemm_backend='fp8': the Hopper fp8 GEMM backend was removed: .*the training-ops page"
    for make in (
        lambda: MXRecipe(gemm_backend="fp8"),
        lambda: recipe("mxfp8", gemm_backend="fp8"),
        lambda: recipe_from_options(gemm_backend="fp8"),
        lambda: MXOptions(gemm_backend="fp8"),
    ):
        with pytest.raises(ValueError, match=why):
            make()
    doc = (Path(__file__).parents[1] / "docs" / "training-ops.md").read_text()
    assert "\n## Why there is no fp8 GEMM on Hopper\n" in doc
    assert "'Why there is no fp8 GEMM on Hopper'" in REMOVED_GEMM_BACKENDS["fp8"]


def test_unknown_recipe_name():
    with pytest.raises(ValueError, match="recipe name 'mxfp4' is not an MX recipe"):
        recipe("mxfp4")
    # a name that is no string (a list: "unhashable type: 'list'") is named as any other
    with pytest.raises(ValueError, match=r"recipe name \['mxfp8'\] is not an MX recipe; expected one of"):
        recipe(["mxfp8"])
    with pytest.raises(ValueError, match=r"recipe_name=\['mxfp8'\] is not an MX recipe"):
        recipe_from_options(["mxfp8"])


def test_recipe_from_options_is_every_front_end():
    """One function turns option strings into a recipe; the trainer, MXOptions and the torchtitan
    adapter all call it, so the same options give the same recipe and the same errors."""
    from mxmoe.integrations.torchtitan import mx_recipe
    from mxmoe.options import MXOptions

    assert recipe_from_options() == DEFAULT_RECIPE == MXOptions().to_recipe() == mx_recipe()
    r = recipe_from_options("mxfp8", "cuda", "triton", "emulated", "float32", "bf16")
    assert r == MXRecipe(
        scaling_mode="floor",
        dim1_kernel="cuda",
        dim0_kernel="triton",
        gemm_backend="emulated",
        gemm_dtype=torch.float32,
        expert_gemm="bf16",
    )
    opts = dict(
        recipe_name="mxfp8", mxfp8_dim1_cast_kernel_choice="cuda", mxfp8_dim0_cast_kernel_choice="torch"
    )
    assert MXOptions(**opts, gemm_dtype="bfloat16").to_recipe() == mx_recipe(**opts, gemm_dtype="bfloat16")
    assert recipe_from_options(gemm_dtype="bfloat16").gemm_dtype == torch.bfloat16
    assert recipe_from_options(gemm_dtype="auto").gemm_dtype is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"recipe_name": "nvfp4"}, "mx.recipe_name='nvfp4' is not an MX recipe; expected one of"),
        ({"mxfp8_dim1_cast_kernel_choice": "cudnn"}, "mxfp8_dim1_cast_kernel_choice='cudnn' is not a"),
        ({"mxfp8_dim0_cast_kernel_choice": "x"}, "mx.mxfp8_dim0_cast_kernel_choice='x' is not a cast kernel"),
        ({"gemm_backend": "cublas"}, "mx.gemm_backend='cublas': not a GEMM backend; expected one of"),
        ({"expert_gemm": "fp8"}, r"mx.expert_gemm='fp8' is not an expert GEMM mode; expected one of \['mx'"),
        ({"gemm_dtype": "float16"}, r"mx.gemm_dtype='float16' is not supported; expected one of \['auto'"),
    ],
)
def test_recipe_from_options_names_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recipe_from_options(**kwargs, option_prefix="mx.")


def test_compute_dtype():
    assert MXRecipe().compute_dtype(torch.device("cpu")) == torch.float32
    assert MXRecipe().compute_dtype(torch.device("cuda")) == torch.bfloat16
    assert MXRecipe(gemm_dtype=torch.float32).compute_dtype(torch.device("cuda")) == torch.float32


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_casts_read_the_recipe(name, assert_same_bits):
    r = recipe(name, dim0_kernel="torch", dim1_kernel="torch")
    x = torch.randn(64, 96) * 3
    for axis in (-1, 0):
        a = mxmoe.to_mx(x, axis=axis, recipe=r)
        b = mxmoe.to_mx(x, axis=axis, scaling_mode=r.scaling_mode)  # loose arguments ("auto": torch on CPU)
        assert a.scaling_mode == r.scaling_mode
        assert_same_bits(a.qdata_blocked, b.qdata_blocked)
        assert_same_bits(a.scale_blocked, b.scale_blocked)
    (d0, d1) = mxmoe.to_mx_dim0_dim1(x, recipe=r)
    (e0, e1) = mxmoe.to_mx_dim0_dim1(x, scaling_mode=r.scaling_mode)
    for a, b in ((d0, e0), (d1, e1)):
        assert_same_bits(a.qdata_blocked, b.qdata_blocked)
        assert_same_bits(a.scale_blocked, b.scale_blocked)


def test_recipe_and_loose_arguments_conflict():
    x = torch.randn(32, 32)
    with pytest.raises(
        ValueError, match=r"^scaling_mode='floor' but recipe.scaling_mode='rceil'; block_size=16 but recipe"
    ):
        mxmoe.to_mx(x, block_size=16, scaling_mode="floor", recipe=DEFAULT_RECIPE)
    # the cast kernel comes only through a recipe (its dim0_kernel / dim1_kernel)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kernel'"):
        mxmoe.to_mx(x, kernel="torch")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kernel'"):
        mxmoe.to_mx(x, recipe=DEFAULT_RECIPE).dequantize(kernel="torch")
    with pytest.raises(TypeError, match=r"MXRecipe, got str \(mxmoe.recipe\('mxfp8'\) makes one\)"):
        mxmoe.to_mx_dim0_dim1(x, recipe="mxfp8")


def test_format_arguments_beside_a_recipe(assert_same_bits):
    # an explicit format argument equal to the default was taken as "not given": the recipe's won
    x = torch.randn(64, 64)
    r16 = recipe(block_size=16)
    with pytest.raises(ValueError, match=r"^block_size=32 but recipe.block_size=16: the recipe holds"):
        mxmoe.to_mx(x, recipe=r16, block_size=32)
    with pytest.raises(ValueError, match=r"^scaling_mode='rceil' but recipe.scaling_mode='floor'"):
        mxmoe.to_mx_dim0_dim1(x, recipe=recipe("mxfp8"), scaling_mode="rceil")
    with pytest.raises(ValueError, match=r"^elem_dtype=torch.float8_e4m3fn but recipe.elem_dtype"):
        mxmoe.to_mx(x, recipe=recipe(elem_dtype=torch.float8_e5m2), elem_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^block_size=32.0 is not supported"):  # checked, not compared
        mxmoe.to_mx(x, recipe=DEFAULT_RECIPE, block_size=32.0)
    # arguments that agree with the recipe are accepted: the same cast
    a = mxmoe.to_mx(x, recipe=r16)
    b = mxmoe.to_mx(x, recipe=r16, block_size=16, scaling_mode=mxmoe.ScalingMode.RCEIL)
    c = mxmoe.to_mx(x, block_size=16)  # without a recipe, None is the default format's
    assert a.block_size == b.block_size == c.block_size == 16
    for m in (b, c):
        assert_same_bits(a.qdata_blocked, m.qdata_blocked)
        assert_same_bits(a.scale_blocked, m.scale_blocked)
    d0, d1 = mxmoe.to_mx_dim0_dim1(x, recipe=r16, block_size=16, elem_dtype=torch.float8_e4m3fn)
    assert (d0.block_size, d1.block_size) == (16, 16)
    assert mxmoe.to_mx(x).fmt == DEFAULT_RECIPE.fmt
