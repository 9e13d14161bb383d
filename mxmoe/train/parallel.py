"""Process groups, expert parallelism and FSDP2 for the trainer.

Layout over W ranks with expert-parallel degree ep (ep divides W):
  - dense parameters: FSDP2 (`fully_shard`) over all W ranks (a 1D "dp" mesh);
  - experts: rank r holds experts [(r % ep) * E/ep, ...) of every MoE layer; ranks r and r' with
    the same r % ep hold the same experts (the "edp" replicas, W / ep of them). The (edp, ep) mesh
    has rank = edp_index * ep + ep_index, so each ep group is ep consecutive ranks.
Every rank is data-parallel (reads its own batch). Gradients: FSDP averages dense gradients over
W; expert gradients arrive summed over the ep group through the all-to-all backward, are summed
over the edp replicas and divided by W (`reduce_expert_grads`), which is the gradient of the mean
of the per-rank losses, as for the dense ones.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass
class ParallelDims:
    """Degrees of parallelism (what `mxmoe.convert` checks: it refuses tp > 1)."""

    world_size: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp_shard > 1


def check_device(device_pref: str) -> bool:
    """Whether training.device `device_pref` picks CUDA here; ValueError naming training.device for
    a value other than auto, cpu or cuda, or cuda without a GPU."""
    if device_pref not in ("auto", "cpu", "cuda"):
        raise ValueError(f"training.device={device_pref!r}: expected auto, cpu or cuda")
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError(
            f"training.device={device_pref!r}: no CUDA GPU is available here (torch.cuda.is_available() "
            "is false); pass --training.device=cpu (or auto: a GPU when there is one)"
        )
    return use_cuda


def launch_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as the launcher (torchrun) set them; unset: 0, 1, 0 (one
    process). ValueError naming the variable, its value and what is expected for one that is not an
    integer, WORLD_SIZE < 1, RANK outside [0, WORLD_SIZE) (a rank that would otherwise wait at the
    rendezvous for parallelism.timeout_s, or train alone in silence), RANK unset with WORLD_SIZE > 1,
    LOCAL_RANK < 0, or (WORLD_SIZE > 1, before the rendezvous) MASTER_ADDR / MASTER_PORT unset or a
    port that is not one."""

    def read(name: str, default: str) -> int:
        value = os.environ.get(name, default)
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={value!r}: expected an integer (torchrun sets it; launched "
                "another way, set RANK, WORLD_SIZE and LOCAL_RANK for every process)"
            ) from None

    world = read("WORLD_SIZE", "1")
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world}: expected the number of processes, >= 1")
    if world > 1 and "RANK" not in os.environ:
        raise ValueError(
            f"environment variable WORLD_SIZE={world} but RANK is not set: expected each process's rank, "
            f"0..{world - 1} (torchrun sets both)"
        )
    rank = read("RANK", "0")
    if not 0 <= rank < world:
        raise ValueError(
            f"environment variable RANK={rank}: expected 0 <= RANK < WORLD_SIZE={world} (every process of "
            "the run needs its own rank among WORLD_SIZE)"
        )
    local_rank = read("LOCAL_RANK", "0")
    if local_rank < 0:
        raise ValueError(f"environment variable LOCAL_RANK={local_rank}: expected >= 0")
    if world > 1 and not dist.is_initialized():  # env:// reads them (torch: a bare int() error)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ValueError(
                    f"environment variable WORLD_SIZE={world} but {name} is not set: expected rank 0's "
                    "address and a free port on it, the same for every process (torchrun sets both)"
                )
        port = os.environ["MASTER_PORT"]
        if not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"environment variable MASTER_PORT={port!r}: expected a TCP port, 1..65535")
    return rank, world, local_rank


def init_distributed(device_pref: str, timeout_s: int) -> tuple[int, int, torch.device, bool]:
    """(rank, world_size, device, initialized_here). Starts the default process group when
    launched by torchrun with WORLD_SIZE > 1: nccl on CUDA, gloo on CPU, with `timeout_s`.
    ValueError naming training.device when the device asked for is not there, naming the environment
    variable when RANK, WORLD_SIZE or LOCAL_RANK is malformed or inconsistent (`launch_env`)."""
    _, world, local_rank = launch_env()
    use_cuda = check_device(device_pref)
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"training.device={device_pref!r}: LOCAL_RANK={local_rank} needs CUDA device {local_rank}, but "
            f"{torch.cuda.device_count()} are visible; start at most {torch.cuda.device_count()} processes "
            "per node (torchrun --nproc_per_node), or pass --training.device=cpu"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world == 1 or dist.is_initialized():
        return (dist.get_rank() if dist.is_initialized() else 0), world, device, False
    try:
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    except dist.DistError as e:  # the rendezvous: a rank missing, or another address or port
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        env = {k: os.environ.get(k, "unset") for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
        raise CollectiveFailed(
            f"rank {os.environ.get('RANK', '?')}: the {world} ranks did not all meet at start within "
            f"parallelism.timeout_s={timeout_s} s ({what}): a rank did not start or stopped before "
            "(its own output says why), or the ranks were given another "
            + " / ".join(f"{k} (here {v})" for k, v in env.items())
        ) from None
    return dist.get_rank(), dist.get_world_size(), device, True


def make_parallel_dims(world: int, dp_shard: int, ep: int, tp: int) -> ParallelDims:
    return ParallelDims(world_size=world, dp_shard=world if dp_shard == -1 else dp_shard, ep=ep, tp=tp)


def check_parallel_dims(pd: ParallelDims, num_experts: int) -> None:
    """Validate degrees against the world size and the model (tp is refused elsewhere)."""
    if pd.dp_shard != pd.world_size:
        raise ValueError(
            f"parallelism.data_parallel_shard_degree={pd.dp_shard}: only -1 or the world size "
            f"({pd.world_size}) is supported (dense parameters are sharded over every rank)"
        )
    if pd.ep < 1 or pd.world_size % pd.ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={pd.ep} must be >= 1 and divide the world size "
            f"{pd.world_size}"
        )
    if pd.ep > 1 and num_experts == 0:
        raise ValueError(
            f"parallelism.expert_parallel_degree={pd.ep}: the model is dense (model.num_experts=0), "
            "it has no experts to split; use 1"
        )
    if pd.ep > 1 and num_experts % pd.ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree={pd.ep} must divide model num_experts={num_experts}"
        )
    if pd.tp != 1:
        raise ValueError(
            f"parallelism.tensor_parallel_degree={pd.tp}: tensor parallelism is not supported (use 1)"
        )


def build_meshes(pd: ParallelDims, device: torch.device, timeout_s: int | None = None):
    """(dp_mesh over all ranks, expert mesh (edp, ep) or None).

    timeout_s: the collective timeout of every mesh group. init_device_mesh creates sub-groups
    (ep, edp) with torch's default timeout (30 min gloo, 10 min nccl), not the default group's,
    so it is set on each of them here (as torchtitan does).
    """
    from torch.distributed.device_mesh import init_device_mesh

    dev = device.type
    dp_mesh = init_device_mesh(dev, (pd.world_size,), mesh_dim_names=("dp",))
    ep_mesh = None
    if pd.ep > 1:
        ep_mesh = init_device_mesh(dev, (pd.world_size // pd.ep, pd.ep), mesh_dim_names=("edp", "ep"))
    if timeout_s is not None:
        timeout = datetime.timedelta(seconds=timeout_s)
        groups = [dp_mesh.get_group("dp")]
        if ep_mesh is not None:
            groups += [ep_mesh.get_group("edp"), ep_mesh.get_group("ep")]
        for group in groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return dp_mesh, ep_mesh


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".experts." in n]


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    ignore_experts: bool,
    param_dtype: torch.dtype | None = None,
    mxfp8_all_gather: bool = False,
) -> None:
    """FSDP2 on each block and the root. With expert parallelism (`ignore_experts`) the expert
    weights are left out (sharded by EP instead); without it they are FSDP-sharded like the rest.

    param_dtype: the dtype parameters are all-gathered and computed in (FSDP2's
    MixedPrecisionPolicy, gradients reduced in fp32, as torchtitan does); None: their own (fp32).
    mxfp8_all_gather: gather the MX weights as MXFP8 (`mxmoe.nn.fsdp.enable_mxfp8_all_gather`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mxfp8_all_gather:
        from mxmoe.nn.fsdp import enable_mxfp8_all_gather

        enable_mxfp8_all_gather(model, dp_mesh.size(), skip_experts=ignore_experts)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)

    for blk in model.layers:
        ignored = (
            {p for n, p in blk.named_parameters() if n.startswith("moe.experts.")}
            if ignore_experts
            else set()
        )
        fully_shard(blk, mesh=dp_mesh, ignored_params=ignored or None, mp_policy=mp)
    root_ignored = set(expert_params(model)) if ignore_experts else set()
    fully_shard(
        model, mesh=dp_mesh, ignored_params=root_ignored or None, reshard_after_forward=False, mp_policy=mp
    )


def reduce_expert_grads(params: list[nn.Parameter], edp_group, world_size: int) -> None:
    """Sum expert gradients over the edp replicas and divide by the world size (see module doc)."""
    for p in params:
        if p.grad is None:
            continue
        if edp_group is not None and dist.get_world_size(edp_group) > 1:
            dist.all_reduce(p.grad, group=edp_group)
        p.grad.div_(world_size)


def clip_grad_norm(
    dense: list[nn.Parameter],
    experts: list[nn.Parameter],
    max_norm: float,
    replicas: int,
    distributed: bool,
    loss: Tensor | None = None,
) -> float:
    """Clip all gradients to a global L2 norm of `max_norm` (0: only measure). Dense gradients may
    be FSDP DTensor shards; expert gradients are identical on their `replicas` edp copies.

    loss: this rank's loss (a scalar); if it is not finite the returned norm is NaN on every rank
    (folded into the norm's all-reduce, so ranks agree without another collective). Gradients
    are not scaled when the norm is not finite."""
    from torch.distributed.tensor import DTensor

    def local(g: Tensor) -> Tensor:
        return g.to_local() if isinstance(g, DTensor) else g

    dev = next((p.device for p in dense + experts), torch.device("cpu"))
    sq = torch.zeros((), dtype=torch.float32, device=dev)
    for p in dense:
        if p.grad is not None:
            sq += local(p.grad).float().pow(2).sum()
    esq = torch.zeros((), dtype=torch.float32, device=dev)
    for p in experts:
        if p.grad is not None:
            esq += p.grad.float().pow(2).sum()
    sq = sq + esq / replicas
    if loss is not None:
        sq = sq + loss.detach().float() * 0.0  # inf * 0 and NaN * 0 are NaN
    if distributed:
        dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in dense + experts:
            if p.grad is not None:
                local(p.grad).mul_(coef)
    return norm


class CollectiveFailed(RuntimeError):
    """A collective failed on this rank because another rank stopped, stalled or lost its connection;
    the message says which rank (where this rank can tell) and what to check."""


def gather_peers() -> list[tuple[str, int]]:
    """Collective: (host name, pid) of every rank, by rank; what `describe_collective_failure` reads
    to tell which rank is gone."""
    peers: list = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    return peers


def is_collective_failure(e: BaseException) -> bool:
    """Whether `e` is a process-group failure: torch's DistError (NCCL), or the plain RuntimeError
    gloo raises when a peer's connection closes or a collective times out (not any error that
    mentions NCCL: mxmoe's own refusals name it, e.g. a transport that needs an NCCL group)."""
    marks = ("/gloo/", "NCCL error", "ProcessGroupNCCL", "Connection closed by peer")
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(k in str(e) for k in marks))


def _alive(pid: int) -> bool:
    """Whether process `pid` on this host is running (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def describe_collective_failure(
    e: BaseException, rank: int, peers: list[tuple[str, int]], timeout_s: int, wait_s: float = 3.0
) -> str:
    """What `CollectiveFailed` says on `rank` after collective error `e`: the ranks on this host that
    are no longer running (waited for up to `wait_s`: a crashed peer's sockets close while it exits),
    else whether the collective timed out, and what to check. peers: `gather_peers()`'s list."""
    what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    what = what.split("] ", 1)[1] if what.startswith("[") and "] " in what else what  # gloo's source line
    what = what.split(" This is typically caused by")[0].rstrip(".")  # and its general advice
    host = socket.gethostname()
    local = {r: pid for r, (h, pid) in enumerate(peers) if h == host and r != rank}
    remote = sorted({h for r, (h, _) in enumerate(peers) if h != host})
    deadline = time.monotonic() + wait_s
    while True:
        gone = [r for r, pid in local.items() if not _alive(pid)]
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if gone:
        names = ", ".join(f"rank {r} (pid {local[r]} on {host})" for r in gone)
        return (
            f"rank {rank}: a collective failed because {names} stopped ({what}). That rank's own output "
            "names its error; if it printed none it was killed from outside: look for the OOM killer "
            f"(dmesg / journalctl -k on {host}) or a stop by the job scheduler"
        )
    elsewhere = f"; ranks on other hosts ({', '.join(remote)}): their output and memory" if remote else ""
    if "timed out" in what.lower() or "timeout" in what.lower():
        return (
            f"rank {rank}: a collective timed out after parallelism.timeout_s={timeout_s} s ({what}): "
            "another rank did not join it, stalled or much slower; the rank whose log stops first is "
            f"the one to look at{elsewhere}. If a step or a checkpoint legitimately takes longer, raise "
            "--parallelism.timeout_s"
        )
    here = f"the other ranks on this host ({host}) are still running" if local else "no other rank runs here"
    return (
        f"rank {rank}: a collective failed ({what}): another rank stopped or its connection broke, and "
        f"{here}{elsewhere}; check the network between the hosts (MASTER_ADDR, firewalls)"
    )
