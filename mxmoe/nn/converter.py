"""`mxmoe.convert(model, MXOptions(...))`: swap a model's Linear and GroupedExperts modules for
their MX versions in place (torchtitan's MX converter, for Hopper).

Hugging Face transformers models are known too: their attention (`self_attn`, `linear_attn`, a
class named *Attention) counts as `attention` and their MoE router (`gate` beside `experts`, with
everything in it) as `router` for `filter_fqns`, and their experts modules (3D `gate_up_proj` /
`down_proj` behind transformers' experts interface) keep their parameters and run
`experts_implementation="mxmoe"` (`mxmoe.integrations.hf`).

`mxmoe.MXOptions` (the one option set of every front end) says what to convert and names one
`mxmoe.recipe.MXRecipe` (`MXOptions().to_recipe() == DEFAULT_RECIPE`); every swapped module gets
that recipe, and the MXFP8 exchange of expert parallelism reads it from the experts. `convert` also
accepts an `MXRecipe` directly (with the default filter).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn
from torch.nn.utils import parametrize

from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import MXLinear
from mxmoe.nn.mx_experts import MXGroupedExperts
from mxmoe.options import DEFAULT_FILTER_FQNS, MXOptions
from mxmoe.quant.backends import why_unavailable
from mxmoe.recipe import RECIPES, MXRecipe

log = logging.getLogger("mxmoe")

def recipe_name(r: MXRecipe) -> str:
    """A short description of `r`: its name in RECIPES when it is one, else the named recipe of its
    format with the fields that differ listed (e.g. "mxfp8_rceil (dim1_kernel=cuda)")."""
    fields = ("dim0_kernel", "dim1_kernel", "gemm_backend", "gemm_dtype", "expert_gemm", "wgrad_with_hp")
    best = None
    for name, base in RECIPES.items():
        fmt = (base.elem_dtype, base.block_size, base.scaling_mode)
        if fmt == (r.elem_dtype, r.block_size, r.scaling_mode):
            extra = [f"{k}={getattr(r, k)}" for k in fields if getattr(r, k) != getattr(base, k)]
            if best is None or len(extra) < len(best[1]):
                best = (name, extra)
    if best is None:
        return repr(r)
    name, extra = best
    return name + (f" ({', '.join(extra)})" if extra else "")


@dataclass
class ConversionReport:
    """What one conversion did (also kept as `model.mx_conversion`); every front end logs it as one
    line, `summary()`: `mxmoe.convert`, the trainer, and the torchtitan adapters."""

    recipe: MXRecipe
    converted: dict[str, list[str]] = field(default_factory=lambda: {"Linear": [], "GroupedExperts": []})
    """FQNs swapped for MX modules, by kind (what was swapped: a key of `MX_NAMES`, or any other)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(FQN, why) of the candidate modules left high precision."""
    reconfigured: list[str] = field(default_factory=list)
    """FQNs already MX with another recipe, now given this one."""
    already: list[str] = field(default_factory=list)
    """FQNs already MX with this recipe (a conversion applied again): left as they are."""
    experts: list[str] = field(default_factory=list)
    """FQNs of every routed-experts module found (converted or not): the model is an MoE."""

    MX_NAMES: ClassVar[dict[str, str]] = {
        "Linear": "MXLinear",
        "GroupedExperts": "MXGroupedExperts",
        "transformers experts": 'experts_implementation="mxmoe"',
        "Llama 4 experts": "MXLlama4TextExperts",
    }
    """What each kind becomes, for `summary` (another kind k reads "k -> MX k")."""
    EXPERT_KINDS: ClassVar[tuple[str, ...]] = ("GroupedExperts", "transformers experts", "Llama 4 experts")
    """The kinds that are routed experts."""

    @property
    def num_converted(self) -> int:
        return sum(len(v) for v in self.converted.values())

    @property
    def is_mx(self) -> bool:
        """True when some module now computes in MX (converted now or before)."""
        return self.num_converted + len(self.reconfigured) + len(self.already) > 0

    def why_skipped(self, fqns: list[str]) -> str:
        """The reasons `fqns` were skipped, grouped ("2 by filter_fqns 'experts'"), or "" if none was."""
        by_reason: dict[str, list[str]] = {}
        for fqn, why in self.skipped:
            if fqn in fqns:
                by_reason.setdefault(why, []).append(fqn)
        return ", ".join(
            f"{fqns_[0]} ({why})" if len(fqns_) == 1 else f"{len(fqns_)} by {why}"
            for why, fqns_ in by_reason.items()
        )

    def finish(self, options: MXOptions | None = None, *, stacklevel: int = 3) -> None:
        """What every front end does once its whole conversion is done: a warning when an MoE model
        got no MX experts for a reason other than convert_grouped_experts=false (naming why), and,
        when nothing at all is MX, a ValueError naming why (MX was asked and would not be given)
        unless `options.allow_unconverted`."""
        opts = options if options is not None else MXOptions()
        conv = self.converted
        mx_experts = {fqn for kind in self.EXPERT_KINDS for fqn in conv.get(kind, [])}
        mx_experts |= set(self.already) | set(self.reconfigured)
        if self.experts and not mx_experts.intersection(self.experts) and opts.convert_grouped_experts:
            why = self.why_skipped(self.experts) or "none of them is a kind mxmoe converts"
            warnings.warn(
                f"mxmoe.convert: the model has {len(self.experts)} experts modules (e.g. "
                f"{self.experts[0]}) and none is MX: {why}",
                stacklevel=stacklevel,
            )
        if not self.is_mx and not opts.allow_unconverted:
            raise ValueError(
                "MX was asked (mxmoe.convert) but no module was converted, the model would stay high "
                f"precision; skipped {len(self.skipped)}: "
                f"{self.why_skipped([f for f, _ in self.skipped]) or 'none'}"
                f" (convert_linears={opts.convert_linears}, convert_grouped_experts="
                f"{opts.convert_grouped_experts}, filter_fqns={list(opts.filter_fqns)}). Pass "
                "allow_unconverted=True (--mx.allow_unconverted=true) to train high precision anyway"
            )

    def summary(self) -> str:
        """One line: what was converted (counts per kind) and what was skipped, grouped by why: a
        reason shared by several modules is counted ("24 by filter_fqns 'attention'"), a module
        skipped for a reason of its own is named ("odd (dims 64x40 not divisible by 32)")."""
        if self.is_mx:
            kinds = ", ".join(
                f"{len(fqns)} {kind} -> {self.MX_NAMES.get(kind, 'MX ' + kind)}"
                for kind, fqns in self.converted.items()
                if fqns or kind in ("Linear", "GroupedExperts")
            )
            head = f"MXFP8 recipe {recipe_name(self.recipe)}: {kinds}"
            if self.reconfigured:
                head += f", {len(self.reconfigured)} MX modules re-given this recipe"
            if self.already:
                head += f", {len(self.already)} modules already MX with this recipe"
        else:
            head = "nothing converted, the model stays high precision"
        by_reason: dict[str, list[str]] = {}
        for fqn, why in self.skipped:
            by_reason.setdefault(why, []).append(fqn)
        skipped = ", ".join(
            f"{fqns[0]} ({why})" if len(fqns) == 1 else f"{len(fqns)} by {why}"
            for why, fqns in by_reason.items()
        )
        return f"mxmoe.convert: {head}; skipped {len(self.skipped)}: {skipped or 'none'}"


HF_ALIASES: dict[str, tuple[str, ...]] = {
    "attention": ("self_attn", "cross_attn", "attn", "linear_attn", "self_attention", "encoder_attn")
}
"""filter_fqns entries that also match Hugging Face's names for the same modules (an FQN part, and
everything under it: `linear_attn` is Qwen3-Next's linear attention, `attn` a vision tower's)."""
ROUTER_NAMES = ("gate", "router")
"""Names of an MoE router beside its `experts` (Hugging Face's `mlp.gate`): skipped by `router`,
with every module inside it (a router that is an MLP of its own)."""


def _implied_here(parent: nn.Module | None, name: str, mod: nn.Module) -> frozenset[str]:
    """The default filter entries `mod` stands for by what it is, whatever its FQN says: "attention"
    for a class named *Attention (Nemotron-H's attention is its `mixer`) or a name in HF_ALIASES,
    "router" for a module named in ROUTER_NAMES beside an `experts` module."""
    here = set()
    if type(mod).__name__.endswith("Attention") or name in HF_ALIASES["attention"]:
        here.add("attention")
    if name in ROUTER_NAMES and parent is not None and hasattr(parent, "experts"):
        here.add("router")
    return frozenset(here)


def implied_entries(model: nn.Module) -> dict[str, frozenset[str]]:
    """{FQN: the default filter entries the module stands for by what it or a module above it is}
    (`_implied_here`): every module inside an attention module or an MoE router is kept by
    "attention" / "router" as the module itself is."""
    out: dict[str, frozenset[str]] = {"": _implied_here(None, "", model)}

    def walk(parent: nn.Module, prefix: str, above: frozenset[str]) -> None:
        for name, child in _children(parent):
            fqn = f"{prefix}.{name}" if prefix else name
            out[fqn] = above | _implied_here(parent, name, child)
            walk(child, fqn, out[fqn])

    walk(model, "", out[""])
    return out


def _children(parent: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, child) for every child of `parent`, under each of its names: one module registered
    twice (`m.a = m.b = linear`) is there twice, where `named_children` gives its first name only."""
    return [(name, child) for name, child in parent._modules.items() if child is not None]


def _filter_hit(fqn: str, filter_fqns: list[str], implied: frozenset[str] = frozenset()) -> str | None:
    """The filter_fqns entry that keeps `fqn` high precision, if any: a substring of it, or an entry
    the module stands for by what it is (`implied`, from `implied_entries`)."""
    for f in filter_fqns:
        if f in fqn or f in implied:
            return f
    return None


def hf_experts_dims(mod: nn.Module) -> tuple[int, int] | None:
    """(hidden, intermediate) of a Hugging Face transformers experts module (3D `gate_up_proj` or
    `up_proj` and `down_proj` parameters behind transformers' experts interface), else None."""
    down = getattr(mod, "down_proj", None)
    if not (isinstance(down, nn.Parameter) and down.ndim == 3 and hasattr(mod, "has_gate")):
        return None
    if not hasattr(getattr(mod, "config", None), "_experts_implementation"):
        return None
    hidden, inter = (down.shape[2], down.shape[1]) if getattr(mod, "is_transposed", False) else down.shape[1:]
    return int(hidden), int(inter)


def llama4_experts_dims(mod: nn.Module) -> tuple[int, int] | None:
    """(hidden, intermediate) of transformers' `Llama4TextExperts` (outside its experts interface;
    `mxmoe.integrations.hf.llama4` converts it) or its MX version, else None. Known by class name
    and module: transformers is not imported."""
    cls = type(mod)
    if cls.__name__ == "MXLlama4TextExperts" and cls.__module__ == "mxmoe.integrations.hf.llama4":
        return int(mod.hidden_size), int(mod.expert_dim)
    if cls.__name__ == "Llama4TextExperts" and cls.__module__.startswith("transformers."):
        return int(mod.hidden_size), int(mod.expert_dim)
    return None


def why_not_plain(mod: nn.Module) -> str | None:
    """Why `mod`, an nn.Linear or GroupedExperts of a subclass, cannot become the MX module (which
    runs the base class's forward on `weight`/`bias` or w1/w2/w3 only), else None: a forward of its
    own or parameters, buffers or modules beyond the base class's would be dropped silently, and
    torch's NonDynamicallyQuantizableLinear (MultiheadAttention's out_proj) is never called, its
    parent reads the weight."""
    base = nn.Linear if isinstance(mod, nn.Linear) else GroupedExperts
    cls = type(mod)
    if cls is base:
        return None
    if parametrize.is_parametrized(mod):  # (a subclass torch makes; from_linear says what to do)
        return "parametrized (torch.nn.utils.parametrize, e.g. weight_norm)"
    if isinstance(mod, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return f"{cls.__name__}: its parent reads its weight and never calls it"
    if cls.forward is not base.forward:
        return f"{cls.__name__}: a {base.__name__} subclass with a forward of its own"
    own = {"weight", "bias"} if base is nn.Linear else {"w1", "w2", "w3"}
    extra = [n for n, _ in mod.named_parameters(recurse=False) if n not in own]
    extra += [n for n, _ in mod.named_buffers(recurse=False)] + [n for n, _ in mod.named_children()]
    if extra:
        return f"{cls.__name__}: a {base.__name__} subclass with {extra[0]!r} of its own"
    return None


def _looks_like_experts(name: str, mod: nn.Module) -> bool:
    """A transformers experts module outside transformers' experts interface (weights of its own,
    not Linear layers, in a module named or of a class named like experts: LongCat-Flash's,
    JetMoE's `input_linear`, DBRX's 2D stacks), which mxmoe cannot convert (Llama 4's it can:
    `llama4_experts_dims`, checked first)."""
    return (
        type(mod).__module__.startswith("transformers.")
        and "expert" in f"{name} {type(mod).__name__}".lower()
        and any(p.ndim >= 2 for p in mod.parameters(recurse=False))
    )


ASKING_OPTIONS = ("recipe_name", "expert_gemm", "filter_fqns", "convert_linears", "convert_grouped_experts")
"""The MXOptions fields that ask for MX arithmetic (what is converted, in which format): set with no
MX converter named, they would be ignored. (Kernel, GEMM-backend and exchange choices are not: the
test suites and launchers pass them to every run.)"""


def asked_options(options: MXOptions, baseline: MXOptions | None = None) -> dict[str, object]:
    """{field: value} of the ASKING_OPTIONS where `options` differs from `baseline` (default: the
    defaults): the MX a user asked for."""
    base = baseline if baseline is not None else MXOptions()
    return {k: getattr(options, k) for k in ASKING_OPTIONS if getattr(options, k) != getattr(base, k)}


def unconverted_error(asked: dict[str, object], converters: list[str], fix: str) -> ValueError:
    """The error of MX options given with no MX converter named (`fix`: how to name one)."""
    given = ", ".join(f"mx.{k}={v!r}" for k, v in asked.items())
    return ValueError(
        f"{given} given, but model.converters={list(converters)!r} names no MX converter: the run "
        f"would train high precision with these options ignored. Add {fix}, or set "
        "mx.allow_unconverted=true to train high precision anyway"
    )


def _tp_described(parallel_dims) -> str | None:
    """How `parallel_dims` says tensor parallelism is on ("tp=4", "tp_enabled=True"), None if off."""
    if parallel_dims is None:
        return None
    if isinstance(parallel_dims, dict):
        tp = int(parallel_dims.get("tp", 1) or 1)
        return f"tp={tp}" if tp > 1 else None
    if hasattr(parallel_dims, "tp_enabled") and not hasattr(parallel_dims, "tp"):
        return "tp_enabled=True" if parallel_dims.tp_enabled else None
    if hasattr(parallel_dims, "tp"):
        tp = int(parallel_dims.tp or 1)
        return f"tp={tp}" if tp > 1 else None
    raise TypeError(
        f"parallel_dims must be None, a dict like {{'dp_shard': 4, 'ep': 2, 'tp': 1}} or an object with "
        f"`tp` / `tp_enabled`; got {type(parallel_dims).__name__}"
    )


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return torch.device("cuda") if p.device.type == "meta" else p.device
    return torch.device("cpu")


MX_PARAM_DTYPES = (torch.bfloat16, torch.float32)
"""Parameter dtypes an MX module takes (its casts read bf16 or fp32)."""


def _check_dtypes(swaps: list[tuple[nn.Module, str, nn.Module, str, str]]) -> None:
    """ValueError, before anything is converted, for a module to convert whose parameters have a
    dtype the MX casts do not take (float16): its forward would fail deep in an MX op."""
    ok = set(MX_PARAM_DTYPES)
    odd = [(fqn, mod, {p.dtype for p in mod.parameters()} - ok) for _, _, mod, _, fqn in swaps]
    bad = [t for t in odd if t[2]]
    if bad:
        fqn, mod, dtypes = bad[0]
        raise ValueError(
            f"mxmoe.convert: {fqn} ({type(mod).__name__}) has {', '.join(sorted(map(str, dtypes)))} "
            f"parameters ({len(bad)} of the modules to convert do); MX modules take bfloat16 or float32: "
            "model.to(torch.bfloat16) first, or keep them high precision with filter_fqns"
        )


def _check_regiven(regive: list[tuple[nn.Module, str, tuple[int, int], bool]], r: MXRecipe) -> None:
    """ValueError, before anything changes, for a module already MX that cannot take recipe `r`
    (`regive`, from `convert`): a dim not divisible by its block size (its first forward would fail),
    or transformers experts given `expert_gemm="bf16"` (refused as for a first conversion)."""
    unfit = [(fqn, mod, dims) for mod, fqn, dims, _ in regive if any(d % r.block_size for d in dims)]
    if unfit:
        fqn, mod, dims = unfit[0]
        raise ValueError(
            f"mxmoe.convert: {fqn} ({type(mod).__name__}, dims {dims[0]}x{dims[1]}) is MX already and cannot "
            f"take this recipe: its dims are not divisible by block_size={r.block_size} ({len(unfit)} of the "
            "MX modules are not); convert with a recipe of a block size they take, or rebuild them high "
            "precision first"
        )
    hf = [mod for mod, _, _, own in regive if not own]
    if hf:
        from mxmoe.integrations.hf.experts import check_recipe

        check_recipe(hf, r)


def convert(
    model: nn.Module,
    recipe: MXOptions | MXRecipe | None = None,
    parallel_dims=None,
    *,
    log_summary: bool = True,
) -> nn.Module:
    """Swap matching modules of `model` in place for their MX versions; returns `model`.

    nn.Linear -> MXLinear and GroupedExperts -> MXGroupedExperts (sharing the Parameter objects,
    so state-dict keys and optimizer state are unchanged), all with one recipe
    (`recipe` itself when it is an MXRecipe, `recipe.to_recipe()` for MXOptions; default DEFAULT_RECIPE),
    except modules whose FQN contains a `filter_fqns` substring and modules with a dim not
    divisible by the block size (both skipped). Modules already MX with another recipe get the new
    one, with a warning. Convert before applying FSDP (`fully_shard`) or torch.compile.

    Hugging Face transformers models: attention of any name (`implied_entries`) counts as
    `attention` and the router (`gate` beside `experts`, with everything in it) as `router` for
    filter_fqns; an experts module (3D gate_up_proj / down_proj) keeps its parameters and computes
    with `experts_implementation="mxmoe"` (`mxmoe.integrations.hf`), its recipe kept as its
    `mx_recipe`.

    Logs one line (`ConversionReport.summary`) and keeps the report as `model.mx_conversion`, then
    `ConversionReport.finish`: a warning when an MoE model gets no MX experts (naming why), a
    ValueError when nothing is MX unless `allow_unconverted` (log_summary=False does neither: a
    front end that converts more adds to the report, logs it and calls `finish`). A filter_fqns
    entry of the caller's (not a default one) that matches no module of the model is warned of.
    Raises ValueError for an unknown recipe/choice, tensor parallelism (tp > 1), a cast kernel that
    cannot run on the model's device (meta counts as CUDA), or a module to convert with float16
    parameters (before any module changes); TypeError for a `model` that is not an nn.Module or is
    itself a Linear or GroupedExperts (nothing to swap it in).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (nn.Linear, GroupedExperts)):  # (their MX versions are subclasses)
        use = (
            "it is MX already (its recipe: model.recipe)"
            if isinstance(model, (MXLinear, MXGroupedExperts))
            else "use mxmoe.nn.MXLinear.from_linear(model, recipe)"
            if isinstance(model, nn.Linear)
            else "use mxmoe.nn.MXGroupedExperts.from_experts(model, recipe)"
        )
        raise TypeError(
            f"convert: model is itself a {type(model).__name__}; convert swaps the modules inside a model "
            f"in place and cannot replace the model object: {use}"
        )
    if not isinstance(log_summary, bool):
        raise TypeError(f"convert: log_summary={log_summary!r}: expected a bool")
    if recipe is None:
        recipe = MXOptions()
    if isinstance(recipe, MXRecipe):
        opts = MXOptions()
        r, filter_fqns, do_lin, do_exp = recipe, opts.filter_fqns, True, True
    elif isinstance(recipe, MXOptions):
        opts = recipe
        r, filter_fqns = recipe.to_recipe(), list(recipe.filter_fqns)  # to_recipe checks every field
        do_lin, do_exp = recipe.convert_linears, recipe.convert_grouped_experts
    else:
        raise TypeError(f"recipe must be an MXRecipe or mxmoe.MXOptions, got {type(recipe).__name__}")
    tp = _tp_described(parallel_dims)
    if tp is not None:
        raise ValueError(
            f"tensor parallelism with MX is not supported yet (parallel_dims has {tp}); "
            "use tp=1 with data/expert parallelism"
        )
    device = _model_device(model)
    for name, kernel in (("dim1_kernel", r.dim1_kernel), ("dim0_kernel", r.dim0_kernel)):
        if kernel != "auto":
            reason = why_unavailable(kernel, device)
            if reason is not None:
                raise ValueError(f"recipe {name}={kernel!r} cannot run for a model on {device}: {reason}")

    report = ConversionReport(r)
    implied = implied_entries(model)
    swaps: list[tuple[nn.Module, str, nn.Module, str, str]] = []  # (parent, name, module, kind, FQN)
    # MX modules of another recipe, given this one once every check passed: (module, FQN, dims,
    # whether the recipe is its `recipe` (mxmoe's modules) rather than its `mx_recipe`)
    regive: list[tuple[nn.Module, str, tuple[int, int], bool]] = []
    hf_hp: list[nn.Module] = []  # transformers experts modules left high precision

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in _children(parent):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            hf_dims = hf_experts_dims(child)
            l4_dims = llama4_experts_dims(child)
            if isinstance(child, (GroupedExperts, MXGroupedExperts)) or (hf_dims or l4_dims) is not None:
                report.experts.append(fqn)
            elif _looks_like_experts(child_name, child):
                report.experts.append(fqn)
                why = f"{type(child).__name__}: experts of a kind mxmoe does not convert"
                report.skipped.append((fqn, why))
            # transformers experts are MX while their config still says so (set_experts_implementation
            # since the last conversion would have them compute in high precision)
            hf_mx_now = hf_dims is not None and child.config._experts_implementation == "mxmoe"
            mx_now = getattr(child, "mx_recipe", None) if hf_mx_now or l4_dims is not None else None
            if isinstance(child, (MXLinear, MXGroupedExperts)) or isinstance(mx_now, MXRecipe):
                if (mx_now or child.recipe) != r:
                    report.reconfigured.append(fqn)
                    if isinstance(child, MXLinear):
                        dims = (child.in_features, child.out_features)
                    elif isinstance(child, MXGroupedExperts):
                        dims = (child.dim, child.hidden_dim)
                    else:
                        dims = hf_dims or l4_dims
                    regive.append((child, fqn, dims, mx_now is None))
                else:
                    report.already.append(fqn)
                continue
            if isinstance(child, nn.Linear) and do_lin:
                kind, dims = "Linear", (child.in_features, child.out_features)
            elif isinstance(child, GroupedExperts) and do_exp:
                kind, dims = "GroupedExperts", (child.dim, child.hidden_dim)
            elif hf_dims is not None and do_exp:
                kind, dims = "transformers experts", hf_dims
            elif l4_dims is not None and do_exp:
                kind, dims = "Llama 4 experts", l4_dims
            else:
                if hf_dims is not None:
                    hf_hp.append(child)
                visit(child, fqn)
                continue
            hit = _filter_hit(fqn, filter_fqns, implied[fqn])
            why = None
            if hit is not None:
                why = f"filter_fqns {hit!r}"
            elif kind == "Linear" and isinstance(child.weight, nn.parameter.UninitializedParameter):
                why = "uninitialized (lazy): run a forward first"  # an MXLinear would never initialize it
            elif parametrize.is_parametrized(child):  # its weight is computed: no Parameter to share
                why = "parametrized (torch.nn.utils.parametrize, e.g. weight_norm)"
            elif kind in ("Linear", "GroupedExperts") and (odd := why_not_plain(child)):
                report.skipped.append((fqn, odd))
                visit(child, fqn)  # its own modules (a wrapper's Linear layers) may convert
                continue
            elif any(d % r.block_size for d in dims):
                why = f"dims {dims[0]}x{dims[1]} not divisible by {r.block_size}"
            if why is not None:
                report.skipped.append((fqn, why))
                if hf_dims is not None:
                    hf_hp.append(child)
                continue
            swaps.append((parent, child_name, child, kind, fqn))

    visit(model, "")
    _check_dtypes(swaps)  # before any module changes
    _check_regiven(regive, r)
    hf_mx = [child for _, _, child, kind, _ in swaps if kind == "transformers experts"]
    if hf_mx:
        from mxmoe.integrations.hf import use_mx_experts  # transformers is there: its model is

        use_mx_experts(hf_mx, hf_hp, r)  # first: it refuses a recipe they cannot take
    l4_mx = [child for _, _, child, kind, _ in swaps if kind == "Llama 4 experts"]
    if l4_mx:
        from mxmoe.integrations.hf.llama4 import use_mx_llama4_experts

        use_mx_llama4_experts(l4_mx, r)  # (refuses expert_gemm="bf16" before any module changes)
    for child, _, _, own in regive:
        if own:
            child.recipe = r
        else:
            child.mx_recipe = r
    made: dict[int, nn.Module] = {}  # id(module) -> its MX version: a shared module stays one module
    for parent, child_name, child, kind, fqn in swaps:
        if kind == "Linear":
            new = made.get(id(child)) or MXLinear.from_linear(child, r)
        elif kind == "GroupedExperts":
            new = made.get(id(child)) or MXGroupedExperts.from_experts(child, r)
        else:
            new = child  # (changed in place above)
        made[id(child)] = new
        if new is not child:
            setattr(parent, child_name, new)
        report.converted.setdefault(kind, []).append(fqn)
    names = [n for n, _ in model.named_modules()]
    for f in filter_fqns:
        if f not in DEFAULT_FILTER_FQNS and all(_filter_hit(n, [f]) is None for n in names):
            warnings.warn(
                f"mxmoe.convert: filter_fqns entry {f!r} matches no module of the model (FQNs look "
                f"like {max(names, key=len)!r}): it keeps nothing high precision",
                stacklevel=2,
            )
    if report.reconfigured:
        warnings.warn(
            f"mxmoe.convert: {len(report.reconfigured)} modules were already MX with another recipe "
            f"(e.g. {report.reconfigured[0]}); they now use {recipe_name(r)}",
            stacklevel=2,
        )
    model.mx_conversion = report
    if log_summary:
        log.info("%s", report.summary())
        report.finish(opts)
    return model
