"""FSDP2 all-gathers of MX weights as MXFP8 (`MXOptions.fsdp_mxfp8_all_gather`).

`enable_mxfp8_all_gather(model, shard_world_size)` (before `fully_shard`) wraps the weight of each
MXLinear and the w1/w2/w3 of each MXGroupedExperts in `MXShardedWeight`, a tensor subclass whose
FSDP2 all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`) makes every rank cast
its own shard (in the compute dtype, FSDP's param_dtype) and hands FSDP the MX elements and scales
instead of the high-precision shard: 1 + 1/32 bytes an element instead of 2 (bf16) or 4 (fp32).
The forward's gather (outside autograd's backward) sends the cast along the last dim (the forward
GEMM's operand), the backward's the cast along dim -2 (the dgrad's), and the gathered weight
(`mxmoe.quant.gathered.MXGatheredWeight`) feeds the GEMMs with no cast.

Two kinds of weight gather in the compute dtype instead, decided from FSDP2's state at each
weight's first gather and logged with a warning: those of a module FSDP2 does not reshard after the
forward (its backward has no gather; an MXFP8 gather plus a second one for the dgrad's layout would
send more bytes than bf16, the second outside FSDP2's overlap), and those whose forward activation
checkpointing recomputes in the backward (a `CheckpointWrapper` inside the FSDP module, as
torchtitan applies it: the recompute reads the forward's layout after the backward's gather). Where
FSDP2's state cannot show it (checkpointing applied around the FSDP module), a GEMM that needs the
layout the weight does not hold gathers it from the shards (a collective; the same bits), eager
only: a compiled graph cannot gather (`mxmoe.quant.gathered`).

Exactness: the gathered cast equals the cast of the whole weight bit for bit when each shard holds
whole blocks: the shard dim is dim 0 (FSDP's default), and a 2D weight (N, K) has N divisible by
32·world (the dgrad's blocks run along N), a 3D expert weight (E, N, K) has E divisible by world
(each expert whole on one rank). Any other weight is left plain (its gather stays high precision)
and the conversion log says why; a sharding seen only at run time (another mesh, Shard(1)) gathers
that weight in the compute dtype with a warning.

Master weights, gradients (plain tensors), the optimizer and state dicts (plain tensors, the same
keys: checkpoints are interchangeable with runs without the option) do not change.
FSDP2's extension API (`fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`,
`fsdp_post_all_gather(..., out=)`) is in torch >= 2.6; `check_fsdp_extension` refuses older.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from mxmoe.quant.gathered import MXGatheredWeight, layout_tag
from mxmoe.quant.mx_tensor import to_mx
from mxmoe.recipe import MXRecipe

log = logging.getLogger(__name__)

_PRESERVE = {  # ops FSDP2 applies to the sharded parameter (chunk, pad, copy, move): stay wrapped
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.narrow.default,
}


def check_fsdp_extension() -> None:
    """RuntimeError unless this torch's FSDP2 has the all-gather extension with the 5-argument
    fsdp_pre_all_gather and `out=` in fsdp_post_all_gather (torch >= 2.6; mxmoe runs 2.11+)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError as e:  # pragma: no cover - torch < 2.6
        raise RuntimeError(f"mx.fsdp_mxfp8_all_gather needs FSDP2 (torch >= 2.6): {e}") from e
    src = getattr(_fsdp_param.FSDPParam, "init_unsharded_param", None)
    if src is None or not hasattr(_fsdp_param.FSDPParam, "all_gather_inputs"):  # pragma: no cover
        raise RuntimeError(
            f"mx.fsdp_mxfp8_all_gather: torch {torch.__version__}'s FSDP2 has no all-gather extension"
        )


def _phase() -> str:
    """"dim1" inside autograd's backward (the gather for the dgrad), else "dim0" (the forward's)."""
    return "dim1" if torch._C._current_graph_task_id() != -1 else "dim0"


def shard_blocks_ok(shape: tuple[int, ...], world: int, block_size: int) -> str | None:
    """None when a weight of `shape` sharded along dim 0 over `world` ranks gives each rank whole
    blocks of both casts (module doc); else why not (one rank: FSDP2 gathers nothing, and its
    one-rank path takes no all-gather extension with several inputs)."""
    if world == 1:
        return "FSDP over one rank gathers nothing"
    if len(shape) == 2:
        n = shape[0]
        if n % (block_size * world):
            return f"dim 0 ({n}) is not divisible by {block_size}·world ({block_size * world})"
    elif len(shape) == 3:
        if shape[0] % world:
            return f"{shape[0]} experts are not divisible by the shard world ({world})"
    else:
        return f"a {len(shape)}D weight"
    if any(d % block_size for d in shape[-2:]):
        return f"its last two dims {tuple(shape[-2:])} are not divisible by {block_size}"
    return None


@dataclass
class _Plan:
    """How a wrapped weight gathers, shared by the sharded tensors FSDP2 derives from it (chunks,
    copies, a reset after loading a checkpoint); decided at its first gather (`_decide`)."""

    decided: bool = False
    hp_reason: str | None = None
    """Set: the weight gathers in the compute dtype, for this reason."""
    phase_layouts: bool = False
    """The forward reads only the forward's gather, the backward only the backward's (the module
    reshards after the forward and recomputes nothing): what a compiled graph relies on."""
    warned: bool = False
    world: int | None = None
    """The FSDP shard degree the wrap was judged for (`wrap_weight`'s world), checked at the first
    gather against the mesh's."""


_WORLDS_WARNED: set[tuple[int, int]] = set()


def _check_world(given: int | None, world: int) -> None:
    """Warn once per (given, actual) where the wrap was judged for another shard degree than FSDP2's:
    weights that would gather MXFP8 at the real degree were left in high precision (or wrapped ones
    fall back), for a reason that does not hold."""
    if given is None or given == world or (given, world) in _WORLDS_WARNED:
        return
    _WORLDS_WARNED.add((given, world))
    log.warning(
        "fsdp_mxfp8_all_gather: the MX weights were wrapped for %d FSDP ranks (shard_world_size) but "
        "FSDP2 shards them over %d: which weights gather MXFP8 was judged for the wrong size; pass the "
        "mesh's size (mesh.size()) to enable_mxfp8_all_gather", given, world,
    )


def _fsdp_params():
    """(FSDP module, its parameter group, FSDPParam) of every FSDP2-sharded parameter in this
    process (FSDP2's registry of module states)."""
    from torch.distributed._composable_state import _module_state_mapping

    for fsdp_module, ref in list(_module_state_mapping.items()):
        group = getattr(ref(), "_fsdp_param_group", None)
        for fp in group.fsdp_params if group is not None else ():
            yield fsdp_module, group, fp


def _decide(plan: _Plan, name: str) -> None:
    """Decide `plan`, and every other undecided plan of a wrapped weight FSDP2 shards (one pass over
    FSDP2's parameters, at the first gather), from the state of the group that holds each (module
    doc): a module FSDP2 does not reshard after the forward (no backward gather), or whose forward
    activation checkpointing recomputes in the backward (that reads the forward's layout after the
    backward's gather), gathers in the compute dtype; any other gathers MXFP8 by phase."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    recomputed: dict[int, set[int]] = {}  # FSDP module -> the modules a CheckpointWrapper in it holds
    for fsdp_module, group, fp in _fsdp_params():
        t = fp.sharded_param
        while not isinstance(t, MXShardedWeight) and hasattr(t, "_local_tensor"):
            t = t._local_tensor
        if not isinstance(t, MXShardedWeight) or t._plan.decided:
            continue
        p = t._plan
        if id(fsdp_module) not in recomputed:
            recomputed[id(fsdp_module)] = {id(m) for cw in fsdp_module.modules()
                                           if isinstance(cw, CheckpointWrapper) for m in cw.modules()}
        if group.post_forward_mesh_info is None:
            p.hp_reason = "its FSDP module does not reshard after the forward (no backward gather)"
        elif id(fp._module_info.module) in recomputed[id(fsdp_module)]:
            p.hp_reason = "activation checkpointing recomputes its forward in the backward"
        p.phase_layouts, p.decided = p.hp_reason is None, True
    if not plan.decided:
        plan.decided = True
        log.warning("%s: its FSDP2 parameter group was not found; it gathers MXFP8 eager only", name)


class MXShardedWeight(Tensor):
    """A master weight (plain data `_t`, any dtype) that FSDP2 all-gathers as MX (module doc).
    Every op but FSDP's own sharding ops (`_PRESERVE`) sees the plain tensor."""

    _t: Tensor
    _recipe: MXRecipe
    _name: str
    _cast_dtype: torch.dtype | None
    _plan: _Plan

    @staticmethod
    def __new__(cls, t: Tensor, recipe: MXRecipe, name: str = "", cast_dtype: torch.dtype | None = None,
                plan: _Plan | None = None):
        return Tensor._make_wrapper_subclass(
            cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(), dtype=t.dtype,
            layout=t.layout, device=t.device, requires_grad=t.requires_grad,
        )

    def __init__(self, t: Tensor, recipe: MXRecipe, name: str = "", cast_dtype: torch.dtype | None = None,
                 plan: _Plan | None = None):
        """cast_dtype: the dtype the module's forward converts the weight to before its MX cast (e.g.
        torchtitan 0.2's experts: bf16); None: the gathered dtype (FSDP's param_dtype). plan: the
        gather plan shared with the tensor this one derives from (None: a new one)."""
        self._t, self._recipe, self._name, self._cast_dtype = t, recipe, name, cast_dtype
        self._plan = plan if plan is not None else _Plan()

    def _like(self, t: Tensor) -> MXShardedWeight:
        return MXShardedWeight(t, self._recipe, self._name, self._cast_dtype, self._plan)

    def __repr__(self) -> str:
        return f"MXShardedWeight({self._name or 'weight'}, {self._t!r})"

    def __tensor_flatten__(self):
        return ["_t"], (self._recipe, self._name, self._cast_dtype, self._plan)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return MXShardedWeight(inner["_t"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = next(a for a in pytree.tree_leaves(args) if isinstance(a, MXShardedWeight))
        if func is torch.ops.aten.detach.default:
            return first._like(args[0]._t.detach())
        args, kwargs = pytree.tree_map_only(MXShardedWeight, lambda t: t._t, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(Tensor, first._like, out)

    # FSDP2's all-gather extension -------------------------------------------------------------

    def _cast(self, layout: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """This shard cast in `layout`, as it is sent (module doc of mxmoe.quant.gathered)."""
        w = self._t.to(self._cast_dtype or dtype)
        mx = to_mx(w, -1 if layout == "dim0" else -2, recipe=self._recipe)
        q, s = mx.qdata_blocked, mx.scale_blocked
        if layout == "dim1" and w.ndim == 2:  # storage (K, rows): send (rows, K), rows stack
            q, s = q.t().contiguous(), s.t().contiguous()
        return q, s

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self._t.dtype
        world = mesh.size()
        _check_world(self._plan.world, world)
        why = shard_blocks_ok(tuple(outer_size), world, self._recipe.block_size)
        rows = -(-outer_size[0] // world)
        if why is None and tuple(self._t.shape) != (rows, *outer_size[1:]):
            why = f"its shard {tuple(self._t.shape)} is not dim 0's 1/{world} of {tuple(outer_size)}"
        if not self._plan.decided:
            _decide(self._plan, self._name or "a weight")
        why = why or self._plan.hp_reason
        if why is not None:  # the compute dtype, padded to FSDP's padded shard
            if not self._plan.warned:
                log.warning("%s gathers in %s, not MXFP8: %s", self._name or "a weight", dtype, why)
                self._plan.warned = True
            w = self._t.to(dtype)
            if w.shape[0] != rows:
                w = torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])
            return (w,), ("hp", tuple(outer_size))
        layout = _phase()
        q, s = self._cast(layout, dtype)
        return (q, s, layout_tag(layout, q.device)), (layout, tuple(outer_size), dtype, mesh.get_group())

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if metadata[0] == "hp":
            (g,) = outputs
            if out is not None:
                return None
            return g[: metadata[1][0]], (g,)
        layout, shape, dtype, group = metadata
        q, s, tag = outputs
        if out is not None:
            from torch.distributed.tensor import DTensor

            if isinstance(out, DTensor):  # a parameter of tensor or expert parallelism
                out = out._local_tensor
            if not isinstance(out, MXGatheredWeight):
                raise RuntimeError(f"FSDP2 handed {type(out).__name__} as the unsharded MX weight")
            out.set_data(q, s, layout, _Regather(self, dtype, group), tag)  # this gather's shard
            return None
        return MXGatheredWeight(shape, param_dtype, q, s, layout, self._recipe.fmt.name,
                                _Regather(self, dtype, group), cast_dtype=self._cast_dtype,
                                phase_layouts=self._plan.phase_layouts, tag=tag), (q, s, tag)


@dataclass
class _Regather:
    """Gathers the other layout of a gathered weight on demand (see MXGatheredWeight): each rank
    casts its shard, one all-gather of elements and one of scales over the shard group."""

    shard: MXShardedWeight
    dtype: torch.dtype
    group: object

    def __call__(self, layout: str) -> tuple[Tensor, Tensor]:
        world = dist.get_world_size(self.group)
        res = []
        for t in self.shard._cast(layout, self.dtype):
            o = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.all_gather_into_tensor(o.view(torch.uint8), t.view(torch.uint8), group=self.group)
            res.append(o)
        return res[0], res[1]


@dataclass
class GatherReport:
    """What `enable_mxfp8_all_gather` did: weights that gather MXFP8 and those left high precision (why)."""

    mx: list[str] = field(default_factory=list)
    plain: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        s = f"fsdp_mxfp8_all_gather: {len(self.mx)} weights gather MXFP8"
        if self.plain:
            s += f"; {len(self.plain)} gather high precision: " + "; ".join(
                f"{k} ({v})" for k, v in self.plain.items()
            )
        return s


def _unwrap_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: the wrapped weights appear as plain tensors (DTensors of plain shards)."""
    from torch.distributed.tensor import DTensor

    for k, v in list(state_dict.items()):
        if not k.startswith(prefix):
            continue
        if isinstance(v, DTensor) and isinstance(v._local_tensor, MXShardedWeight):
            state_dict[k] = DTensor.from_local(
                v._local_tensor._t, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                stride=v.stride(),
            )
        elif isinstance(v, MXShardedWeight):
            state_dict[k] = v._t


def mx_weights(
    model: nn.Module, skip_experts: bool = False, expert_types: tuple[type, ...] = ()
) -> list[tuple[str, nn.Module, str]]:
    """(fully qualified name, module, attribute) of each MX weight: MXLinear.weight and the w1, w2,
    w3 of MXGroupedExperts and of `expert_types` (a front end's MX experts; none with skip_experts;
    those with expert_gemm='bf16' too, which `enable_mxfp8_all_gather` leaves plain, naming them)."""
    from mxmoe.nn.linear import MXLinear
    from mxmoe.nn.mx_experts import MXGroupedExperts

    out = []
    for name, m in model.named_modules():
        attrs = ("weight",) if isinstance(m, MXLinear) else ()
        experts = isinstance(m, (MXGroupedExperts, *expert_types))
        if experts and not skip_experts:
            attrs = ("w1", "w2", "w3")
        out += [(f"{name}.{a}" if name else a, m, a) for a in attrs]
    return out


def wrap_weight(
    module: nn.Module, attr: str, recipe: MXRecipe, world: int, fqn: str = "",
    cast_dtype: torch.dtype | None = None,
) -> str | None:
    """Wrap `module.attr` (a Parameter, or a DTensor Parameter of tensor or expert parallelism: its
    local tensor, which FSDP2 shards along dim 0) in MXShardedWeight if its shards over `world` FSDP
    ranks hold whole blocks; returns None if wrapped (or already wrapped), else why not (the weight
    is left as it is). cast_dtype: see MXShardedWeight. RuntimeError if FSDP2 shards it already
    (the wrap must come before `fully_shard`)."""
    from torch.distributed.tensor import DTensor

    p = getattr(module, attr)
    local = p._local_tensor if isinstance(p, DTensor) else p.data
    if isinstance(local, MXShardedWeight):
        return None
    if any(fp.sharded_param is p for _, _, fp in _fsdp_params()):
        raise RuntimeError(
            f"fsdp_mxfp8_all_gather: {fqn or attr} is sharded by FSDP2 already: wrap the MX weights "
            "(mxmoe.nn.fsdp.enable_mxfp8_all_gather / wrap_weight) before fully_shard"
        )
    why = shard_blocks_ok(tuple(local.shape), world, recipe.block_size)
    if why is not None:
        return why
    data = MXShardedWeight(local.detach(), recipe, fqn, cast_dtype)
    data._plan.world = world
    if isinstance(p, DTensor):
        data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    setattr(module, attr, nn.Parameter(data, requires_grad=p.requires_grad))
    if not getattr(module, "_mx_state_dict_hook", False):
        module._register_state_dict_hook(_unwrap_state_dict)
        module._mx_state_dict_hook = True
    return None


def enable_mxfp8_all_gather(
    model: nn.Module, shard_world_size: int, expert_shard_world_size: int | None = None,
    skip_experts: bool = False, expert_types: tuple[type, ...] = (),
    expert_cast_dtype: torch.dtype | None = None,
) -> GatherReport:
    """Wrap each MX weight of `model` whose shards hold whole blocks (module doc) in MXShardedWeight,
    before `fully_shard`, so that FSDP2 gathers it as MXFP8. shard_world_size: the FSDP shard degree
    of dense weights; expert_shard_world_size: that of the experts (default: the same);
    skip_experts: leave the experts alone (not FSDP-sharded, e.g. under expert parallelism in
    mxmoe's trainer); expert_types: a front end's MX experts classes; expert_cast_dtype: the dtype
    their forward converts the weights to before the MX cast (MXShardedWeight's cast_dtype). Logs
    and returns what it did; a model already wrapped is left as it is."""
    check_fsdp_extension()
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"enable_mxfp8_all_gather: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if not isinstance(skip_experts, bool):
        raise TypeError(f"enable_mxfp8_all_gather: skip_experts={skip_experts!r}: expected a bool")
    if not isinstance(expert_types, tuple) or not all(isinstance(t, type) for t in expert_types):
        raise TypeError(
            f"enable_mxfp8_all_gather: expert_types={expert_types!r}: expected a tuple of classes (the "
            "front end's MX experts modules), e.g. (MyMXExperts,)"
        )
    if expert_cast_dtype not in (None, torch.bfloat16, torch.float32):
        raise TypeError(
            f"enable_mxfp8_all_gather: expert_cast_dtype={expert_cast_dtype!r}: expected None, "
            "torch.bfloat16 or torch.float32 (the dtype the experts' forward casts the weights to; the "
            "MX casts read bf16 or fp32)"
        )
    for name, v in (("shard_world_size", shard_world_size),
                    ("expert_shard_world_size", expert_shard_world_size)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r}: expected an int >= 1 (the FSDP shard degree, mesh.size())")
    ew = shard_world_size if expert_shard_world_size is None else expert_shard_world_size
    report = GatherReport()
    for fqn, m, attr in mx_weights(model, skip_experts, expert_types):
        dense = attr == "weight"
        if not dense and m.recipe.expert_gemm != "mx":
            gemm = m.recipe.expert_gemm
            report.plain[fqn] = f"expert_gemm={gemm!r}: its GEMMs take the weight in high precision"
            continue
        why = wrap_weight(m, attr, m.recipe, shard_world_size if dense else ew, fqn,
                          None if dense else expert_cast_dtype)
        if why is None:
            report.mx.append(fqn)
        else:
            report.plain[fqn] = why
    if not report.mx and not report.plain:
        warnings.warn(
            f"enable_mxfp8_all_gather: {type(model).__name__} has no MX weight to wrap (convert it with "
            "mxmoe.convert first); every weight gathers in its own dtype",
            stacklevel=2,
        )
    log.info(report.summary())
    return report
