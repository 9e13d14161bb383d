"""The option fields a torchtitan 0.3 module's Config carries, read from `mxmoe.MXOptions` (never
re-listed), and the recipe such a Config describes: shared by the converters and the token
dispatcher (`v0_3.converters`, `v0_3.dispatcher`), below both."""

from __future__ import annotations

import logging
import warnings
from dataclasses import MISSING, field, fields, make_dataclass

from torchtitan.config import Configurable

from mxmoe.integrations.torchtitan.common import RECIPE_FIELDS, mx_recipe
from mxmoe.nn.converter import ConversionReport, recipe_name
from mxmoe.options import DEFAULT_FILTER_FQNS, MXOptions
from mxmoe.recipe import MXRecipe

log = logging.getLogger("mxmoe")


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


def reconvert(fqn: str, config, options: MXOptions, report: ConversionReport) -> None:
    """A module Config that a converter made MX before (a converter applied again): given
    `options`' MODULE_FIELDS, recorded in `report` as already MX (same recipe) or reconfigured."""
    (report.already if recipe_of(config) == report.recipe else report.reconfigured).append(fqn)
    for name in MODULE_FIELDS:
        setattr(config, name, getattr(options, name))


def finish_conversion(
    model_config, options: MXOptions, report: ConversionReport, where: str, fqns: list[str] = ()
) -> None:
    """What `mxmoe.convert` does once done, for a converted config tree: logs the report's line,
    warns of a caller's `filter_fqns` entry (or `fqns` include entry) that matches no module and of
    modules given another recipe, then `ConversionReport.finish` (nothing MX: ValueError unless
    `allow_unconverted`; an MoE without MX experts: a warning)."""
    log.info("%s", report.summary())
    names = [fqn for fqn, *_ in model_config.traverse(Configurable.Config, recurse=True)]
    own = [f for f in options.filter_fqns if f not in DEFAULT_FILTER_FQNS]
    for key, entries, effect in (
        ("filter_fqns", own, "keeps nothing high precision"),
        ("fqns", fqns, "converts nothing"),
    ):
        for f in entries:
            if not any(f in n for n in names):
                warnings.warn(
                    f"{where}: {key} entry {f!r} matches no module of the model (FQNs look like "
                    f"{max(names, key=len)!r}): it {effect}",
                    stacklevel=3,
                )
    if report.reconfigured:
        warnings.warn(
            f"{where}: {len(report.reconfigured)} modules were already MX with another recipe (e.g. "
            f"{report.reconfigured[0]}); they now use {recipe_name(report.recipe)}",
            stacklevel=3,
        )
    if not options.mxfp8_a2a and not options.allow_unconverted and report.is_mx:
        # mxmoe's dispatcher sending bf16 rows is all this conversion did, and nothing else is MX
        lists = (*report.converted.values(), report.already, report.reconfigured)
        done = [f for names in lists for f in names]
        exchange = [f for f in done if f.endswith(".token_dispatcher")]
        mx_modules = [
            fqn
            for fqn, c, *_ in model_config.traverse(Configurable.Config, recurse=True)
            if isinstance(c, RecipeFields) and not fqn.endswith("token_dispatcher")
        ]
        if len(exchange) == len(done) and not mx_modules:
            raise ValueError(
                f"MX was asked ({where}) but no module computes in MX: mxfp8_a2a=False leaves the "
                f"{len(exchange)} token dispatchers exchanging bf16 rows (convert_linears="
                f"{options.convert_linears}, convert_grouped_experts={options.convert_grouped_experts}). "
                "Pass allow_unconverted=True to train high precision anyway"
            )
    report.finish(options, stacklevel=4)
