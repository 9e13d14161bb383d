"""mxmoe: mixture-of-experts training in MXFP8, exact and fast on Hopper, runnable on CPU."""

from mxmoe.formats import ELEM_FORMATS, ScalingMode
from mxmoe.options import MXOptions
from mxmoe.quant import MXTensor, available_kernels, to_mx, to_mx_dim0_dim1
from mxmoe.recipe import DEFAULT_RECIPE, RECIPES, MXRecipe, recipe

__version__ = "0.1.0"


def __getattr__(name: str):
    # `mxmoe.convert` imports the nn stack on first use only.
    if name == "convert":
        import mxmoe.nn

        return mxmoe.nn.convert
    raise AttributeError(f"module 'mxmoe' has no attribute {name!r}")


__all__ = [
    "DEFAULT_RECIPE",
    "ELEM_FORMATS",
    "MXRecipe",
    "RECIPES",
    "MXOptions",
    "MXTensor",
    "ScalingMode",
    "available_kernels",
    "convert",
    "recipe",
    "to_mx",
    "to_mx_dim0_dim1",
]
