"""torchtitan 0.2's expert parallelism through mxmoe's dispatch seam.

torchtitan 0.2 builds its `ExpertParallel` style inside its parallelize functions
(`apply_moe_ep_tp`, torchtitan/models/llama4/infra/parallelize.py, which DeepSeek-V3 and Qwen3 use):
a ParallelStyle that shards the experts' parameters on the EP mesh and hooks the experts module's
forward to exchange its inputs (the routed rows, sorted by expert, and per-expert counts) and
outputs in bf16. 0.2 offers no slot a converter can fill (its `expert_parallel_comm_backend` is
"standard" or "deepep", chosen by name in that function). So `install()` makes that function build
`MXExpertParallel` instead: torchtitan's `ExpertParallel` unchanged for every experts module mxmoe
did not convert, while for mxmoe's `MXGroupedExperts` its hooks go through mxmoe's seam at the rows
stage (`mxmoe.comm.a2a_dispatcher.AllToAllDispatcher.exchange_rows` / `return_rows`: torchtitan 0.2's MoE
layer routes and sorts the tokens itself, and combines them after): the rows cross as MXFP8 in the
experts' recipe (the dispatch, and the combine's gradient; bf16 with `mxfp8_a2a = false`) on the
transport `a2a_transport` names, and reach the experts as MX data. The parameters are sharded as
torchtitan shards them (Shard(0)), so checkpoints, FSDP and the optimizer see the same model.

`MXMoEConverter` calls `install()` when it converts experts and expert parallelism is on (EP > 1);
a run without mxmoe's converter, or with EP = 1, never builds this style.
"""

from __future__ import annotations

import torch
import torchtitan.models.llama4.infra.parallelize as _parallelize
from torch import Tensor, nn
from torch.distributed.tensor import DeviceMesh
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.tools.logging import logger

from mxmoe.comm.a2a_dispatcher import make_dispatcher
from mxmoe.integrations.torchtitan.v0_2.experts import MXGroupedExperts
from mxmoe.token_dispatch import describe_exchange

TORCHTITAN_EXPERT_PARALLEL = ExpertParallel
"""torchtitan's own style (what `apply_moe_ep_tp` builds without mxmoe)."""
_LOGGED = False
"""Whether the model `install()` was last called for has logged its exchange."""


class MXExpertParallel(ExpertParallel):
    """torchtitan 0.2's `ExpertParallel`, whose exchange goes through mxmoe's seam for mxmoe's MX
    experts (module docstring). One instance per experts module, as torchtitan makes them."""

    def _mx(self, mod: nn.Module, device_mesh: DeviceMesh):
        """mxmoe's dispatcher for `mod` (None: not mxmoe's experts), made once, outside any compiled
        code (torchtitan 0.2 leaves the experts module out of its compiled regions)."""
        if not hasattr(self, "_mx_dispatcher"):
            d = None
            if isinstance(mod, MXGroupedExperts):
                d = make_dispatcher(device_mesh.get_group(), transport=mod.a2a_transport, mxfp8=mod.mxfp8_a2a)
                if not hasattr(d, "exchange_rows"):
                    raise ValueError(
                        f"a2a_transport={mod.a2a_transport!r} moves tokens itself; torchtitan 0.2's "
                        "expert parallelism hands the experts rows sorted by expert: choose a row "
                        "transport ('auto', 'nccl', 'symm')"
                    )
                global _LOGGED
                if not _LOGGED:  # one line per process: every experts module has the same options
                    logger.info("mxmoe: %s", describe_exchange(d, mod.expert_rows()))
                    _LOGGED = True
            self._mx_dispatcher, self._mx_state = d, None
        return self._mx_dispatcher

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        """torchtitan's sharding (Shard(0) on the EP mesh); then, for MX experts the converter marked
        (`fsdp_mxfp8_all_gather`), the local expert weights are made to gather as MXFP8 over the
        experts' FSDP degree (`mxmoe.nn.fsdp.wrap_weight`)."""
        super()._partition_fn(name, mod, device_mesh)
        world = getattr(mod, "_mx_fsdp_gather_world", None)
        if world is None:
            return
        from mxmoe.nn.fsdp import wrap_weight

        done = []
        for attr in ("w1", "w2", "w3"):
            why = wrap_weight(mod, attr, mod.recipe, world, f"{name}.{attr}" if name else attr,
                              cast_dtype=torch.bfloat16)  # the experts' forward: w.bfloat16()
            if why is not None:
                logger.info("fsdp_mxfp8_all_gather: experts %s gathers high precision: %s", attr, why)
            else:
                done.append(attr)
        if done:
            logger.info("fsdp_mxfp8_all_gather: experts %s gather MXFP8 (FSDP over %d ranks after EP)",
                        ", ".join(done), world)

    def _token_dispatch(self, mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh):
        d = self._mx(mod, device_mesh)
        if d is None:
            return super()._token_dispatch(mod, inputs, device_mesh)
        routed_input, num_tokens_per_expert = inputs
        # the experts compute in bf16 (torchtitan's): the exchange sends and quantizes bf16 rows,
        # the values an unsharded MXGroupedExperts would cast and quantize
        rows, counts, handle = d.exchange_rows(
            routed_input.bfloat16(), num_tokens_per_expert, rows_as=mod.expert_rows()
        )
        self._mx_state = (handle, routed_input.dtype)
        return rows, counts

    def _token_combine(self, mod: nn.Module, routed_output: Tensor, device_mesh: DeviceMesh) -> Tensor:
        d = self._mx(mod, device_mesh)
        if d is None:
            return super()._token_combine(mod, routed_output, device_mesh)
        handle, dtype = self._mx_state
        self._mx_state = None
        return d.return_rows(routed_output, handle).to(dtype)


SAC_SAVE_LISTS = (
    "torchtitan.models.deepseek_v3.infra.parallelize",
    "torchtitan.models.llama4.infra.parallelize",
    "torchtitan.models.qwen3.infra.parallelize",
)
"""torchtitan 0.2's modules whose `_op_sac_save_list` (the ops selective activation checkpointing
keeps instead of recomputing) gets the exchange's collectives, as torchtitan adds DeepEP's."""


def install() -> None:
    """Make torchtitan 0.2's `apply_moe_ep_tp` build `MXExpertParallel` (module docstring), and
    selective activation checkpointing keep the exchange's outputs rather than exchange again."""
    import importlib

    import torch

    from mxmoe.comm import custom_ops  # noqa: F401  (registers torch.ops.mxmoe.a2a_*)

    global _LOGGED
    _LOGGED = False  # the model being converted logs its exchange once
    if _parallelize.ExpertParallel is not MXExpertParallel:
        _parallelize.ExpertParallel = MXExpertParallel
    exchange = [getattr(torch.ops.mxmoe, name).default
                for name in ("a2a_counts", "a2a_rows", "a2a_mxfp8", "a2a_mxfp8_dequant")]
    for name in SAC_SAVE_LISTS:
        save = getattr(importlib.import_module(name), "_op_sac_save_list", None)
        if isinstance(save, set):
            save.update(exchange)


def installed() -> bool:
    """Whether `install()` has run in this process."""
    return _parallelize.ExpertParallel is MXExpertParallel


__all__ = ["MXExpertParallel", "TORCHTITAN_EXPERT_PARALLEL", "install", "installed"]
