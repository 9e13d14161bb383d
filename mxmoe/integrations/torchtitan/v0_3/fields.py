"""The option fields a torchtitan 0.3 module's Config carries, read from `mxmoe.MXOptions` (never
re-listed), and the recipe such a Config describes: shared by the converters and the token
dispatcher (`v0_3.converters`, `v0_3.dispatcher`), below both."""

from __future__ import annotations

from dataclasses import MISSING, field, fields, make_dataclass

from mxmoe.integrations.torchtitan.common import RECIPE_FIELDS, mx_recipe
from mxmoe.options import MXOptions
from mxmoe.recipe import MXRecipe


def options_fields(name: str, names: tuple[str, ...]) -> type:
    """A keyword-only dataclass with `mxmoe.MXOptions`' fields `names` (same types and defaults):
    the options a torchtitan Config inherits, read from the one option set, never re-listed."""
    spec = []
    for f in fields(MXOptions):
        if f.name in names:
            has_default = f.default is not MISSING
            default = {"default": f.default} if has_default else {"default_factory": f.default_factory}
            spec.append((f.name, f.type, field(kw_only=True, **default)))
    return make_dataclass(name, spec, kw_only=True)


MODULE_FIELDS = (*RECIPE_FIELDS, "fsdp_mxfp8_all_gather")
"""The MXOptions fields a swapped module's Config carries: the recipe's, and whether FSDP2 gathers
its weights as MXFP8 (read when the module is parallelized, before torchtitan applies FSDP)."""
RecipeFields = options_fields("RecipeFields", MODULE_FIELDS)
"""MODULE_FIELDS of MXOptions, as a dataclass a swapped module's Config inherits."""


def recipe_of(config) -> MXRecipe:
    """The MXRecipe of a swapped module's (or converter's) Config; ValueError naming a bad field."""
    return mx_recipe(**{name: getattr(config, name) for name in RECIPE_FIELDS})
