"""What one training run is made of, built from its JobConfig: `build_run` returns a `Run`.

`mxmoe.train.trainer` checks the settings (`check_values`), starts the processes, calls
`build_run` and loops over the steps of the Run. `mxmoe bench train` builds its model and optimizer
with the same functions (`build_model`, `build_optimizer`, `autocast`), so a benchmarked step is the
trainer's step: the same seeding, ModelArgs, conversion, compilation and AdamW.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mxmoe.models import Transformer, apply_expert_parallel, model_args
from mxmoe.models.moe import ModelArgs
from mxmoe.train import determinism, parallel, profiling
from mxmoe.train.checkpoint import Checkpointer
from mxmoe.train.config import JobConfig, check_limits
from mxmoe.train.data import VOCAB_SIZE, PackedDataset, ShardedSampler, load_tokens

log = logging.getLogger("mxmoe.train")

_TUNABLE_MODEL_ARGS = ("max_seq_len", "aux_loss_coef", "bias_update_rate", "init_std")
"""ModelArgs fields a resumed run may change (max_seq_len follows training.seq_len, checked apart)."""

COMPILE_MODES = ("blocks", "full", "reduce_overhead")
"""`build_model(compile=...)`: each block's parts (`compile_submodules`, the trainer's
training.compile), the whole model with fullgraph=True (training.compile_full), or the same with
mode="reduce-overhead" (inductor's CUDA graphs; `mxmoe bench train` only)."""


MX_CONVERTERS = ("mx", "mxmoe")
"""The names of mxmoe's converter, as in every front end (torchtitan's `--model.converters` too)."""


def uses_mx(cfg: JobConfig) -> bool:
    """Whether cfg's model.converters names mxmoe's converter."""
    return any(c in MX_CONVERTERS for c in cfg.model.converters)


def check_values(cfg: JobConfig) -> None:
    """ValueError naming the setting, the value and what is accepted, before anything is built."""
    t = cfg.training
    unknown = sorted(set(cfg.model.converters) - set(MX_CONVERTERS))
    if unknown:
        raise ValueError(
            f"model.converters={cfg.model.converters!r}: unknown converter(s) {unknown}; expected one "
            f"of {list(MX_CONVERTERS)} (the same converter)"
        )
    if t.mixed_precision not in ("bf16", "fp32", "tf32"):
        raise ValueError(f"training.mixed_precision={t.mixed_precision!r}: expected bf16, fp32 or tf32")
    if t.cpu_threads < 0:
        raise ValueError(f"training.cpu_threads={t.cpu_threads}: expected >= 0 (0 = torch's default)")
    for key, value, low in (
        ("training.steps", t.steps, 1),
        ("training.batch_size", t.batch_size, 1),
        ("training.seq_len", t.seq_len, 1),
        ("training.warmup_steps", t.warmup_steps, 0),
        ("training.val_interval", t.val_interval, 0),
        ("training.val_batches", t.val_batches, 0),
        ("checkpoint.interval", cfg.checkpoint.interval, 0),
        ("checkpoint.keep_latest", cfg.checkpoint.keep_latest, 0),
        ("metrics.log_freq", cfg.metrics.log_freq, 1),
    ):
        if value < low:
            raise ValueError(f"{key}={value}: expected >= {low}")
    if not (math.isfinite(t.lr) and t.lr > 0):
        raise ValueError(f"training.lr={t.lr!r}: expected a finite number > 0")
    for key, value, ok, accepted in (
        ("training.min_lr_ratio", t.min_lr_ratio, 0 <= t.min_lr_ratio <= 1, "0 <= value <= 1"),
        ("training.max_norm", t.max_norm, t.max_norm >= 0, "a number >= 0 (0 disables clipping)"),
        ("training.weight_decay", t.weight_decay, 0 <= t.weight_decay < math.inf, "a finite number >= 0"),
        ("training.beta1", t.beta1, 0 <= t.beta1 < 1, "0 <= value < 1"),
        ("training.beta2", t.beta2, 0 <= t.beta2 < 1, "0 <= value < 1"),
    ):
        if not ok:  # NaN fails every comparison
            raise ValueError(f"{key}={value!r}: expected {accepted}")
    mx = cfg.mx
    mx.check("mx.")
    if mx.expert_gemm == "bf16" and not mx.convert_grouped_experts:
        raise ValueError(
            "mx.expert_gemm='bf16' sets how the converted experts compute, but "
            "mx.convert_grouped_experts=false leaves them unconverted (bf16 GEMMs and a bf16 exchange); "
            "drop one of the two"
        )
    if t.compile or t.compile_full:
        check_compile_backend(t.compile_backend, "training.compile_backend")
    check_limits(cfg)
    profiling.check(cfg.profiling)


def check_compile_backend(backend: str, key: str) -> None:
    """ValueError naming `key` unless torch.compile knows `backend` (torch._dynamo.list_backends,
    the debugging backends included)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"{key}={backend!r}: not a torch.compile backend; expected one of {sorted(known)}")


def lr_lambda(cfg: JobConfig):
    """The LR multiplier of optimizer step `step` (steps taken so far): linear warmup, then cosine
    down to training.min_lr_ratio at training.steps."""
    t = cfg.training

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        frac = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def build_optimizer(model: torch.nn.Module, cfg: JobConfig, distributed: bool) -> torch.optim.Optimizer:
    """AdamW over `model`'s parameters; norms and 1-d parameters without weight decay."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    t = cfg.training
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        foreach=not distributed,  # FSDP DTensors and EP-local tensors do not mix in foreach kernels
    )


def build_model_args(cfg: JobConfig) -> ModelArgs:
    """The ModelArgs of cfg's model (preset + overrides; byte vocabulary, seq_len positions)."""
    m = cfg.model
    overrides = {
        k: getattr(m, k)
        for k in (
            "dim",
            "n_layers",
            "n_heads",
            "num_experts",
            "top_k",
            "moe_hidden_dim",
            "num_shared_experts",
            "load_balance",
            "aux_loss_coef",
            "bias_update_rate",
        )
    }
    return model_args(m.name, vocab_size=VOCAB_SIZE, max_seq_len=cfg.training.seq_len, **overrides)


def compile_submodules(model: Transformer, backend: str = "inductor") -> None:
    """training.compile: torch.compile each block's parts in place (`nn.Module.compile`: parameter
    and state_dict names unchanged); what runs between them (FSDP hooks, residual adds) stays eager.

    Per block: attention, the two norms, and the FFN. A dense block compiles its feed_forward. An
    MoE layer compiles whole, with fullgraph=True: router, token dispatch, routed experts (bf16
    `GroupedExperts` or `MXGroupedExperts`, whose grouped ops are torch.library custom ops with fake
    implementations), combine and shared expert in one graph, so the high-precision and the MX
    model get the same treatment. Without expert parallelism it has no host sync (the expert rows
    are always T * top_k, the per-expert counts stay on the device). With it, the exchange's
    collectives are custom ops too (`mxmoe.comm.ops`): their split sizes stay tensors in the graph
    and are read on the host inside the ops, so the layer still compiles as one graph.
    """
    for blk in model.layers:
        for sub in (blk.attention, blk.attention_norm, blk.ffn_norm, blk.feed_forward):
            if sub is not None:
                sub.compile(backend=backend)
        if blk.moe is not None:
            blk.moe.compile(backend=backend, fullgraph=True)
    model.norm.compile(backend=backend)


def mx_convert(model: torch.nn.Module, cfg: JobConfig, pd: parallel.ParallelDims):
    """`mxmoe.convert(model, ...)` with the options of `cfg.mx` (the trainer's `--mx.*`), in place;
    returns its ConversionReport (also `model.mx_conversion`)."""
    import mxmoe

    mxmoe.convert(model, cfg.mx, parallel_dims=pd)
    return model.mx_conversion


def precision(model: torch.nn.Module, cfg: JobConfig) -> str:
    """What the mx converter actually did: the modules now MX, or that it swapped none."""
    from mxmoe.nn import MXGroupedExperts, MXLinear

    n = sum(isinstance(mod, (MXLinear, MXGroupedExperts)) for mod in model.modules())
    if n == 0:
        return "high precision (the mx converter swapped no module)"
    hp = sum(isinstance(m, MXGroupedExperts) and m.recipe.expert_gemm == "bf16" for m in model.modules())
    what = f" ({hp} of them experts in the compute dtype on MX-rounded rows: expert_gemm=bf16)" if hp else ""
    return f"MXFP8 {cfg.mx.recipe_name} in {n} modules{what}"


def build_model(
    cfg: JobConfig,
    device: torch.device,
    pd: parallel.ParallelDims,
    *,
    mx: bool,
    ep_group: dist.ProcessGroup | None = None,
    compile: str | None = None,
    backend: str = "inductor",
) -> Transformer:
    """cfg's Transformer on `device`, initialized from training.seed (`seed_everything` first);
    experts spread over `ep_group` (expert parallelism, when given); converted to MX with `cfg.mx`
    when `mx`; then compiled in place as `compile` says (one of COMPILE_MODES, or None: eager).
    FSDP is the caller's: it wraps the model after this (`parallel.apply_fsdp`)."""
    if compile is not None and compile not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: expected None or one of {list(COMPILE_MODES)}")
    determinism.seed_everything(cfg.training.seed)
    with torch.device(device):
        model = Transformer(build_model_args(cfg))
    if ep_group is not None:
        # the exchange's options are the converter's ([mx]): with no MX experts, rows go unquantized
        apply_expert_parallel(model, ep_group, transport=cfg.mx.a2a_transport, mxfp8=cfg.mx.mxfp8_a2a)
    if mx:
        mx_convert(model, cfg, pd)
    if compile == "blocks":
        compile_submodules(model, backend=backend)
    elif compile == "full":
        model.compile(fullgraph=True, backend=backend)  # in place: parameter and state_dict names unchanged
    elif compile == "reduce_overhead":
        model.compile(fullgraph=True, backend=backend, mode="reduce-overhead")
    return model


def set_matmul_precision(cfg: JobConfig, device: torch.device) -> None:
    """training.mixed_precision=tf32 on CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa
    inputs, fp32 accumulation; weights and activations stay fp32); else torch's default (IEEE fp32
    for fp32 matmuls). Process-wide: every run built in this process sets it."""
    if device.type == "cuda":
        tf32 = cfg.training.mixed_precision == "tf32"
        torch.backends.cuda.matmul.fp32_precision = "tf32" if tf32 else "none"


def autocast(cfg: JobConfig, device: torch.device, *, cache_enabled: bool = True):
    """training.mixed_precision=bf16 on CUDA: bf16 autocast over the fp32 weights (a captured CUDA
    graph needs cache_enabled=False: no weight casts kept outside the graph); else no autocast."""
    if device.type == "cuda" and cfg.training.mixed_precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache_enabled)
    return contextlib.nullcontext()


def aux_loss_weight(margs: ModelArgs) -> float:
    """The weight of the router's auxiliary loss in the trained loss (0 without aux_loss balancing)."""
    return margs.aux_loss_coef if margs.load_balance == "aux_loss" else 0.0


@dataclasses.dataclass
class Run:
    """One training run's parts, as `build_run` made them; the trainer's loop steps through it."""

    cfg: JobConfig
    rank: int
    world: int
    device: torch.device
    distributed: bool  # torch.distributed is initialized (FSDP / expert parallelism apply)
    pd: parallel.ParallelDims
    margs: ModelArgs
    model: Transformer  # expert-parallel, converted, compiled and FSDP-wrapped as configured
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    dense_params: list[torch.nn.Parameter]  # clipped over the whole world
    exp_params: list[torch.nn.Parameter]  # expert-parallel parameters (empty without EP)
    ep_mesh: DeviceMesh | None  # ("edp", "ep") with expert parallelism, else None
    edp_group: dist.ProcessGroup | None  # ranks holding the same experts: expert gradients reduced over it
    train_ds: PackedDataset
    val_ds: PackedDataset | None  # None: no validation
    sampler: ShardedSampler
    ckpt: Checkpointer | None  # None: no checkpoint.folder
    step: int  # optimizer steps already taken (a resumed run's step, else 0)
    amp: contextlib.AbstractContextManager  # autocast (or nothing) around the forward
    aux_coef: float  # aux_loss_weight(margs)

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.training
        return t.batch_size * t.seq_len * self.world

    def train_state(self, step: int) -> dict:
        """The non-tensor state a checkpoint keeps beside model and optimizer."""
        return {"step": step, "scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict()}


def build_run(cfg: JobConfig, rank: int, world: int, device: torch.device) -> Run:
    """Everything a run needs, after `check_values(cfg)` and with the process group (if any) up:
    parallel dims and meshes, the model (`build_model`; then FSDP), AdamW and its LR schedule, the
    data and its sampler, the checkpointer, and the state of a resumed run loaded into all of them."""
    t, p = cfg.training, cfg.parallelism
    use_mx = uses_mx(cfg)
    distributed = dist.is_initialized()
    pd = parallel.make_parallel_dims(
        world, p.data_parallel_shard_degree, p.expert_parallel_degree, p.tensor_parallel_degree
    )
    margs = build_model_args(cfg)
    if t.cuda_graph and (device.type != "cuda" or world > 1):
        raise ValueError(
            f"training.cuda_graph=true captures one GPU's step: needs device cuda and one process "
            f"(no FSDP / expert parallelism), got device {device.type} and world size {world}"
        )
    if t.compile_full and (t.compile or world > 1):
        raise ValueError(
            "training.compile_full=true compiles the whole model in one graph: it needs one process "
            f"(no FSDP / expert parallelism) and training.compile=false (per-block compile), got world "
            f"size {world} and training.compile={t.compile}"
        )
    set_matmul_precision(cfg, device)
    if pd.tp > 1 and use_mx:
        # the converter owns this refusal: let it raise its own error before anything is built
        mx_convert(torch.nn.Module(), cfg, pd)
    parallel.check_parallel_dims(pd, margs.num_experts)

    dp_mesh = ep_mesh = ep_group = edp_group = None
    if distributed:
        dp_mesh, ep_mesh = parallel.build_meshes(pd, device, p.timeout_s)
        if ep_mesh is not None:
            ep_group, edp_group = ep_mesh.get_group("ep"), ep_mesh.get_group("edp")
    compile = "blocks" if t.compile else "full" if t.compile_full else None
    model = build_model(
        cfg, device, pd, mx=use_mx, ep_group=ep_group, compile=compile, backend=t.compile_backend
    )
    exp_params = parallel.expert_params(model) if ep_mesh is not None else []
    if distributed:
        parallel.apply_fsdp(model, dp_mesh, ignore_experts=ep_mesh is not None)
    exp_ids = {id(q) for q in exp_params}
    dense_params = [q for q in model.parameters() if id(q) not in exp_ids]
    optimizer = build_optimizer(model, cfg, distributed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    d = cfg.data
    train_tokens, val_tokens = load_tokens(d.path, d.val_fraction, d.max_files, d.extensions)
    train_ds = PackedDataset(train_tokens, t.seq_len)
    val_ds = PackedDataset(val_tokens, t.seq_len) if t.val_interval > 0 and t.val_batches > 0 else None
    sampler = ShardedSampler(len(train_ds), t.batch_size, rank, world, t.seed)

    # what a resumed run must share with the saving one (another world size is fine when the global
    # batch is the same; hyperparameters such as aux_loss_coef may change)
    shape = {k: v for k, v in dataclasses.asdict(margs).items() if k not in _TUNABLE_MODEL_ARGS}
    run_shape = {"model": shape, "global_batch": t.batch_size * world, "seq_len": t.seq_len}
    ckpt = (
        Checkpointer(cfg.checkpoint.folder, cfg.checkpoint.keep_latest, ep_mesh, run=run_shape)
        if cfg.checkpoint.folder
        else None
    )
    run = Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        distributed=distributed,
        pd=pd,
        margs=margs,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dense_params=dense_params,
        exp_params=exp_params,
        ep_mesh=ep_mesh,
        edp_group=edp_group,
        train_ds=train_ds,
        val_ds=val_ds,
        sampler=sampler,
        ckpt=ckpt,
        step=0,
        # a captured step must not keep autocast's weight casts in a cache outside the graph
        amp=autocast(cfg, device, cache_enabled=not t.cuda_graph),
        aux_coef=aux_loss_weight(margs),
    )
    if (
        ckpt is not None
        and cfg.checkpoint.resume
        and (path := ckpt.resume_path(cfg.checkpoint.fallback)) is not None
    ):
        st = ckpt.load(path, model, optimizer, run.train_state(0))
        run.step = int(st["step"])
        for group in optimizer.param_groups:  # the saving run may have had another world size
            group["foreach"] = not distributed
        scheduler.load_state_dict(st["scheduler"])
        sampler.load_state_dict(st["sampler"])
        log.info("resumed from %s at step %d", path, run.step)
    return run
