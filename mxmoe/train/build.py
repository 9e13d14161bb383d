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
import os
import typing

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mxmoe.models import Transformer, apply_expert_parallel, model_args
from mxmoe.models.moe import ModelArgs
from mxmoe.nn.converter import asked_options, unconverted_error
from mxmoe.train import determinism, parallel, profiling
from mxmoe.train.checkpoint import TRAIN_STATE, Checkpointer, CheckpointError
from mxmoe.train.checkpoint.common import STEP_DIR
from mxmoe.train.config import Converter, JobConfig, check_limits, check_ranks_data
from mxmoe.train.data import VOCAB_SIZE, PackedDataset, ShardedSampler, load_corpus

log = logging.getLogger("mxmoe.train")

_TUNABLE_MODEL_ARGS = ("max_seq_len", "aux_loss_coef", "bias_update_rate", "init_std")
"""ModelArgs fields a resumed run may change (max_seq_len follows training.seq_len, checked apart)."""

COMPILE_MODES = ("blocks", "full", "reduce_overhead")
"""`build_model(compile=...)`: each block's parts (`compile_submodules`, the trainer's
compile.enable), the whole model with fullgraph=True (compile.whole_model), or the same with
mode="reduce-overhead" (inductor's CUDA graphs; `mxmoe bench train` only)."""


MX_CONVERTERS: tuple[str, ...] = typing.get_args(Converter)
"""The names of mxmoe's converter, as in every front end (torchtitan's `--model.converters` too);
parsing keeps one of them, "mx" (`mxmoe.train.config.Model`)."""


def uses_mx(cfg: JobConfig) -> bool:
    """Whether cfg's model.converters names mxmoe's converter (by either name)."""
    return any(c in MX_CONVERTERS for c in cfg.model.converters)


def check_values(cfg: JobConfig) -> None:
    """ValueError naming the setting, the value and what is accepted, before anything is built."""
    t, sched = cfg.training, cfg.lr_scheduler
    if not cfg.job.dump_folder.strip():  # not "no folder": the run wrote into the working folder
        raise ValueError(
            f"job.dump_folder={cfg.job.dump_folder!r}: expected the run's folder (metrics.jsonl, "
            "config.json, its lock); give --job.dump_folder=. for the working folder"
        )
    unknown = sorted(set(cfg.model.converters) - set(MX_CONVERTERS))
    if unknown:
        raise ValueError(
            f"model.converters={cfg.model.converters!r}: unknown converter(s) {unknown}; expected one "
            f"of {list(MX_CONVERTERS)} (the same converter)"
        )
    if t.mixed_precision not in ("bf16", "fp32", "tf32"):
        raise ValueError(f"training.mixed_precision={t.mixed_precision!r}: expected bf16, fp32 or tf32")
    if not 0 <= t.cpu_threads < 2**31:  # (torch.set_num_threads takes an int32: "Overflow when unpacking")
        raise ValueError(
            f"training.cpu_threads={t.cpu_threads}: expected >= 0 (0 = torch's default) and < 2**31"
        )
    m = cfg.model
    for key, value, low in (
        ("model.dim", m.dim, 1),
        ("model.n_layers", m.n_layers, 1),
        ("model.n_heads", m.n_heads, 1),
        ("model.num_experts", m.num_experts, 0),
        ("model.top_k", m.top_k, 1),
        ("model.moe_hidden_dim", m.moe_hidden_dim, 1),
        ("model.num_shared_experts", m.num_shared_experts, 0),
        ("data.max_files", cfg.data.max_files, 0),
        ("data.max_file_bytes", cfg.data.max_file_bytes, 1),
        ("training.steps", t.steps, 1),
        ("training.local_batch_size", t.local_batch_size, 1),
        ("training.seq_len", t.seq_len, 1),
        ("lr_scheduler.warmup_steps", sched.warmup_steps, 0),
        ("validation.freq", cfg.validation.freq, 0),
        ("validation.steps", cfg.validation.steps, 0),
        ("checkpoint.interval", cfg.checkpoint.interval, 0),
        ("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, 0),
        ("checkpoint.threads", cfg.checkpoint.threads, 0),
        ("metrics.log_freq", cfg.metrics.log_freq, 1),
    ):
        if value is not None and value < low:  # None: the preset's value
            raise ValueError(f"{key}={value}: expected >= {low}")
    check_limits(cfg)  # every float option (FLOAT_RANGES), the seed, the timeout
    v = cfg.validation
    if v.freq > 0 and v.steps > 0 and cfg.data.val_fraction == 0:
        raise ValueError(
            f"data.val_fraction=0 holds out no validation data, but validation is on "
            f"(validation.freq={v.freq}, validation.steps={v.steps}): give "
            "data.val_fraction > 0 or turn validation off with validation.freq=0"
        )
    mx = cfg.mx
    mx.check("mx.")
    if mx.expert_gemm == "bf16" and not mx.convert_grouped_experts:
        raise ValueError(
            "mx.expert_gemm='bf16' sets how the converted experts compute, but "
            "mx.convert_grouped_experts=false leaves them unconverted (bf16 GEMMs and a bf16 exchange); "
            "drop one of the two"
        )
    if not uses_mx(cfg) and not mx.allow_unconverted:  # MX asked, high precision given
        asked = asked_options(mx)
        if asked:
            raise unconverted_error(asked, cfg.model.converters, "--model.converters=mx")
    if cfg.compile.enable:
        check_compile_backend(cfg.compile.backend, "compile.backend")
    profiling.check(cfg.profiling)
    check_model_overrides(cfg)


_EXPERT_OPTIONS = (
    "top_k",
    "moe_hidden_dim",
    "num_shared_experts",
    "load_balance",
    "aux_loss_coef",
    "bias_update_rate",
)
"""model.* options that configure the routed experts (a dense model has none)."""


def check_model_overrides(cfg: JobConfig) -> None:
    """ValueError naming a model.* option given (not None) that the model it configures ignores:
    an experts option on a dense model (num_experts 0), aux_loss_coef unless load_balance is aux_loss,
    bias_update_rate unless it is bias (they were dropped without a word); and, named as the options,
    the preset-and-overrides values ModelArgs refuses (dim / n_heads, top_k)."""
    from mxmoe.models.moe import PRESETS

    m = cfg.model
    preset = PRESETS[m.name]
    experts = preset.num_experts if m.num_experts is None else m.num_experts
    balance = preset.load_balance if m.load_balance is None else m.load_balance
    given = [k for k in _EXPERT_OPTIONS if getattr(m, k) is not None]
    if experts == 0 and given:
        where = "model.num_experts=0" if m.num_experts is not None else f"model {m.name!r} (num_experts 0)"
        raise ValueError(
            f"model.{given[0]}={getattr(m, given[0])!r} configures routed experts, but {where} is dense: it "
            "has none and would ignore it; drop the option, or give model.num_experts >= 1"
        )

    def named(key: str) -> str:  # "model.dim=64", or "model.dim=64 (preset debug_moe's)" when not given
        v = getattr(m, key)
        if v is not None:
            return f"model.{key}={v}"
        return f"model.{key}={getattr(preset, key)} (preset {m.name}'s)"

    dim = preset.dim if m.dim is None else m.dim
    heads = preset.n_heads if m.n_heads is None else m.n_heads
    if dim % heads or (dim // heads) % 2:  # named as the options, not as ModelArgs' fields
        raise ValueError(
            f"{named('dim')} and {named('n_heads')}: expected a dim divisible by n_heads into an even head "
            f"dim (dim / n_heads = {dim / heads:g})"
        )
    top_k = preset.top_k if m.top_k is None else m.top_k
    if experts and not 1 <= top_k <= experts:
        raise ValueError(f"{named('top_k')}: expected 1 <= top_k <= {named('num_experts')}")
    for key, needs in (("aux_loss_coef", "aux_loss"), ("bias_update_rate", "bias")):
        if getattr(m, key) is not None and balance != needs:
            raise ValueError(
                f"model.{key}={getattr(m, key)!r} applies with model.load_balance={needs!r} only; this model "
                f"balances with load_balance={balance!r} and would ignore it: drop the option, or give "
                f"--model.load_balance={needs}"
            )


def check_bench_values(cfg: JobConfig) -> None:
    """`check_values` for a command that builds the MX model whatever model.converters says (`mxmoe
    bench train`, `mxmoe bench fidelity`): [mx] options without a converter are not refused."""
    check_values(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, converters=["mx"])))


def check_cast_kernels(cfg: JobConfig, device: torch.device) -> None:
    """ValueError naming the mx.* option when a cast kernel it names cannot run on `device` (checked
    before anything is built or trained: `mxmoe bench fidelity`, `mxmoe bench train`)."""
    from mxmoe.quant.backends import why_unavailable

    for key in ("mxfp8_dim0_cast_kernel_choice", "mxfp8_dim1_cast_kernel_choice"):
        kernel = getattr(cfg.mx, key)
        why = None if kernel == "auto" else why_unavailable(kernel, device)
        if why is not None:
            raise ValueError(f"mx.{key}={kernel!r} cannot run on {device.type}: {why}")


def device_memory_bytes(device: torch.device) -> int:
    """The memory one rank can have at most: a GPU's total memory, else the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory_bytes(device: torch.device) -> int:
    """The memory a rank can take now: a GPU's free memory (torch.cuda.mem_get_info), else the
    host's available memory (/proc/meminfo's MemAvailable: free memory and the page cache the kernel
    gives back; os.sysconf's free pages leave that cache out); without /proc/meminfo (not Linux) the
    physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return device_memory_bytes(device)


def memory_floor(margs: ModelArgs, cfg: JobConfig, world: int) -> tuple[int, str]:
    """(bytes, what they are): a lower bound of one rank's memory for this model and batch, in
    Python ints (no overflow): fp32 weights, gradients and both AdamW moments (16 bytes a parameter,
    spread over `world` ranks as FSDP and expert parallelism at best spread them) and, for one local
    batch, the fp32 logits and their log-softmax, which the loss's cross-entropy holds together
    (2 x local_batch_size x seq_len x the byte vocabulary x 4 bytes)."""
    t = cfg.training
    params = margs.num_params()[0]
    state = 16 * params // world
    logits = 2 * 4 * t.local_batch_size * t.seq_len * VOCAB_SIZE
    what = (
        f"{params:,} parameters x 16 bytes (fp32 weights, gradients, AdamW moments) / {world} rank(s) + "
        f"fp32 logits and their log-softmax 2 x {t.local_batch_size} x {t.seq_len} x {VOCAB_SIZE} x 4 bytes"
    )
    return state + logits, what


def check_run(cfg: JobConfig, margs: ModelArgs, device: torch.device, world: int) -> None:
    """ValueError naming the setting for what only the device tells, before anything is built: a
    model and batch that cannot fit the memory the device has available now (`memory_floor`, a
    lower bound: what is refused could not run beside what else holds that memory),
    mx.gemm_backend='native' where torch's MX GEMMs cannot run, and a profiler trace folder that
    cannot be written."""
    need, what = memory_floor(margs, cfg, world)
    have = available_memory_bytes(device)
    if need > have:
        m = cfg.model
        raise ValueError(
            f"model {m.name} (dim {margs.dim}, n_layers {margs.n_layers}, n_heads {margs.n_heads}, "
            f"num_experts {margs.num_experts}, moe_hidden_dim {margs.moe_hidden_dim}) with "
            f"training.local_batch_size={cfg.training.local_batch_size} and training.seq_len="
            f"{cfg.training.seq_len} needs at least {need / 2**30:,.1f} GiB per rank ({what}), more than "
            f"the {have / 2**30:,.1f} GiB available of {device.type}'s "
            f"{device_memory_bytes(device) / 2**30:,.1f} GiB: make the model, the batch or the sequences "
            "smaller"
        )
    if uses_mx(cfg) and cfg.mx.gemm_backend == "native":
        from mxmoe.ops.gemm_backend import native_unavailable

        why = native_unavailable(device)
        if why is not None:
            native = "gemm_backend='native'"
            why = f"mx.{why}" if why.startswith(native) else f"mx.{native}: {why}"
            raise ValueError(f"{why}; use 'auto' or 'emulated'")
    ep = cfg.parallelism.expert_parallel_degree
    if cfg.mx.a2a_transport == "symm" and ep > 1 and device.type != "cuda":
        raise ValueError(
            f"mx.a2a_transport='symm' (symmetric memory between GPUs of one host) cannot run on "
            f"training.device={device.type!r}: use 'auto' or 'nccl' (the process group)"
        )
    profiling.check_folder(cfg.profiling, cfg.job.dump_folder)


def check_compile_backend(backend: str, key: str) -> None:
    """ValueError naming `key` unless torch.compile knows `backend` (torch._dynamo.list_backends,
    the debugging backends included)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"{key}={backend!r}: not a torch.compile backend; expected one of {sorted(known)}")


def lr_lambda(cfg: JobConfig):
    """The LR multiplier of optimizer step `step` (steps taken so far): linear warmup, then cosine
    down to lr_scheduler.min_lr_factor at training.steps."""
    t, s = cfg.training, cfg.lr_scheduler

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        span = max(1, t.steps - s.warmup_steps)
        frac = min(1.0, (step - s.warmup_steps) / span)
        return s.min_lr_factor + (1 - s.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def build_optimizer(model: torch.nn.Module, cfg: JobConfig, distributed: bool) -> torch.optim.Optimizer:
    """AdamW over `model`'s parameters; norms and 1-d parameters without weight decay."""
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    opt = cfg.optimizer
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        foreach=not distributed,  # FSDP DTensors and EP-local tensors do not mix in foreach kernels
    )


def build_model_args(cfg: JobConfig) -> ModelArgs:
    """The ModelArgs of cfg's model (preset + overrides; byte vocabulary, seq_len positions)."""
    m = cfg.model
    overrides = {
        k: getattr(m, k)
        for k in ("dim", "n_layers", "n_heads", "num_experts", *_EXPERT_OPTIONS)
    }
    return model_args(m.name, vocab_size=VOCAB_SIZE, max_seq_len=cfg.training.seq_len, **overrides)


def compile_submodules(model: Transformer, backend: str = "inductor") -> None:
    """compile.enable: torch.compile each block's parts in place (`nn.Module.compile`: parameter
    and state_dict names unchanged); what runs between them (FSDP hooks, residual adds) stays eager.

    Per block: attention, the two norms, and the FFN. A dense block compiles its feed_forward. An
    MoE layer compiles whole, with fullgraph=True: router, token dispatch, routed experts (bf16
    `GroupedExperts` or `MXGroupedExperts`, whose grouped ops are torch.library custom ops with fake
    implementations), combine and shared expert in one graph, so the high-precision and the MX
    model get the same treatment. Without expert parallelism it has no host sync (the expert rows
    are always T * top_k, the per-expert counts stay on the device). With it, the exchange's
    collectives are custom ops too (`mxmoe.comm.custom_ops`): their split sizes stay tensors in the graph
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


def precision_record(cfg: JobConfig) -> dict:
    """The settings that decide a run's arithmetic, {option: value} (JSON): model.converters,
    training.mixed_precision and, with the mx converter, the recipe (its name and resolved format:
    element dtype, block size, scaling mode, expert GEMMs) and what is converted. Each checkpoint
    records it; resuming under another is refused (checkpoint.allow_precision_change). The cast
    kernels and the GEMM backend are left out: they give the same numbers (or run where the
    hardware has them)."""
    from mxmoe.recipe import recipe_from_options

    rec: dict = {
        "model.converters": sorted(cfg.model.converters),
        "training.mixed_precision": cfg.training.mixed_precision,
    }
    if uses_mx(cfg):
        mx = cfg.mx
        r = recipe_from_options(mx.recipe_name, expert_gemm=mx.expert_gemm)
        rec.update(
            {
                "mx.recipe_name": mx.recipe_name,
                "mx.elem_dtype": str(r.elem_dtype),
                "mx.block_size": r.block_size,
                "mx.scaling_mode": r.scaling_mode,
                "mx.expert_gemm": r.expert_gemm,
                "mx.filter_fqns": sorted(mx.filter_fqns),
                "mx.convert_linears": mx.convert_linears,
                "mx.convert_grouped_experts": mx.convert_grouped_experts,
            }
        )
    return rec


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
    """cfg's Transformer on `device`, initialized from debug.seed (`seed_everything` first);
    experts spread over `ep_group` (expert parallelism, when given); converted to MX with `cfg.mx`
    when `mx`; then compiled in place as `compile` says (one of COMPILE_MODES, or None: eager).
    FSDP is the caller's: it wraps the model after this (`parallel.apply_fsdp`)."""
    if compile is not None and compile not in COMPILE_MODES:
        raise ValueError(f"compile={compile!r}: expected None or one of {list(COMPILE_MODES)}")
    determinism.seed_everything(cfg.debug.seed)
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


def fsdp_param_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP2 gathers parameters in (its MixedPrecisionPolicy's param_dtype, gradients
    reduced in fp32): bf16 where the compute is bf16 (training.mixed_precision=bf16 on CUDA, what
    autocast computes in), else None (the fp32 parameters themselves)."""
    if device.type == "cuda" and cfg.training.mixed_precision == "bf16":
        return torch.bfloat16
    return None


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
    corpus: dict  # the data's identity (mxmoe.train.data.Corpus.identity)
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
        return t.local_batch_size * t.seq_len * self.world

    @property
    def epochs(self) -> dict:
        """How much data the whole run reads: tokens_per_epoch (the train split's windows x
        seq_len), run_tokens (steps x global batch x seq_len) and their ratio, epochs (> 1: the
        training data repeats)."""
        t = self.cfg.training
        per_epoch = len(self.train_ds) * t.seq_len
        run_tokens = t.steps * t.local_batch_size * self.world * t.seq_len
        return {
            "steps": t.steps,
            "global_batch": t.local_batch_size * self.world,
            "seq_len": t.seq_len,
            "tokens_per_epoch": per_epoch,
            "run_tokens": run_tokens,
            "epochs": run_tokens / per_epoch,
        }

    def settings(self) -> dict:
        """What the checkpoint records of this run's settings ({option: value}): the resolved
        config and the data's identity (its files' names and sizes, and their bytes), compared with
        a resuming run's."""
        ids = {"data.corpus": self.corpus["sha256"], "data.content": self.corpus.get("content_sha256")}
        return {**self.cfg.flat(), **ids}

    def train_state(self, step: int) -> dict:
        """The non-tensor state a checkpoint keeps beside model and optimizer (JSON)."""
        return {
            "step": step,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "settings": self.settings(),
        }


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
    check_run(cfg, margs, device, world)
    if t.cuda_graph and (device.type != "cuda" or world > 1):
        raise ValueError(
            f"training.cuda_graph=true captures one GPU's step: needs device cuda and one process "
            f"(no FSDP / expert parallelism), got device {device.type} and world size {world}"
        )
    c = cfg.compile
    if c.whole_model and (not c.enable or world > 1):
        raise ValueError(
            "compile.whole_model=true compiles the whole model in one graph: it needs compile.enable=true "
            f"and one process (no FSDP / expert parallelism), got compile.enable={str(c.enable).lower()} "
            f"and world size {world}"
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
    compile = ("full" if c.whole_model else "blocks") if c.enable else None
    model = build_model(
        cfg, device, pd, mx=use_mx, ep_group=ep_group, compile=compile, backend=c.backend
    )
    exp_params = parallel.expert_params(model) if ep_mesh is not None else []
    if use_mx and cfg.mx.fsdp_mxfp8_all_gather and not distributed:
        log.info("mx.fsdp_mxfp8_all_gather=true: one process, no FSDP: no weight is all-gathered")
    if cfg.mx.fsdp_mxfp8_all_gather and not use_mx:
        log.warning(
            "mx.fsdp_mxfp8_all_gather=true, but model.converters=%r names no MX converter: no weight is MX, "
            "every weight gathers in the compute dtype", list(cfg.model.converters)
        )
    if distributed:
        parallel.apply_fsdp(
            model,
            dp_mesh,
            ignore_experts=ep_mesh is not None,
            param_dtype=fsdp_param_dtype(cfg, device),
            mxfp8_all_gather=use_mx and cfg.mx.fsdp_mxfp8_all_gather,
        )
    exp_ids = {id(q) for q in exp_params}
    dense_params = [q for q in model.parameters() if id(q) not in exp_ids]
    optimizer = build_optimizer(model, cfg, distributed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    d = cfg.data
    corpus = load_corpus(d.path, d.val_fraction, d.max_files, d.extensions, d.max_file_bytes)
    if distributed:
        check_ranks_data(corpus.identity, d.path)
    train_ds = PackedDataset(corpus.train, t.seq_len, "the train split")
    v = cfg.validation
    val_ds = (
        PackedDataset(corpus.val, t.seq_len, "the validation split") if v.freq > 0 and v.steps > 0 else None
    )
    sampler = ShardedSampler(len(train_ds), t.local_batch_size, rank, world, cfg.debug.seed)

    # what a resumed run must share with the saving one (another world size is fine when the global
    # batch is the same; hyperparameters such as aux_loss_coef may change)
    shape = {k: v for k, v in dataclasses.asdict(margs).items() if k not in _TUNABLE_MODEL_ARGS}
    run_shape = {"model": shape, "global_batch": t.local_batch_size * world, "seq_len": t.seq_len}
    ck = cfg.checkpoint
    ckpt = (
        Checkpointer(
            ck.folder,
            ck.keep_latest_k,
            ep_mesh,
            run=run_shape,
            precision=precision_record(cfg),
            allow_precision_change=ck.allow_precision_change,
            threads=ck.threads,
        )
        if ck.folder
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
        corpus=corpus.identity,
        train_ds=train_ds,
        val_ds=val_ds,
        sampler=sampler,
        ckpt=ckpt,
        step=0,
        # a captured step must not keep autocast's weight casts in a cache outside the graph
        amp=autocast(cfg, device, cache_enabled=not t.cuda_graph),
        aux_coef=aux_loss_weight(margs),
    )
    if ckpt is not None and ck.resume and (path := ckpt.resume_path(ck.fallback)) is not None:
        _resume(run, path)
    return run


DATA_KEYS = ("data.path", "data.val_fraction", "data.max_files", "data.extensions", "debug.seed")
"""The options that decide the data order a resume continues (with training.seq_len, checked as the
run's shape)."""


def _check_same_data(run: Run, path, st: dict) -> None:
    """ValueError naming checkpoint `path` and each data option (DATA_KEYS; else the corpus's files)
    whose value differs from the saving run's, when its sampler (sequence count, seed) is not this
    run's: the data order could not continue."""
    sd, sampler = st["sampler"], run.sampler
    if int(sd["n"]) == sampler.n and int(sd["seed"]) == sampler.seed:
        return
    saved, now = st.get("settings") or {}, run.settings()
    differ = [k for k in DATA_KEYS if k in saved and saved[k] != now[k]]
    diffs = [f"{k}: checkpoint {saved[k]!r}, this run {now[k]!r}" for k in differ]
    if not diffs and saved.get("data.corpus") not in (None, now["data.corpus"]):
        diffs = [f"the files under data.path={now['data.path']!r} changed since the save"]
    diffs.append(f"training sequences: checkpoint {sd['n']}, this run {sampler.n}")
    if int(sd["seed"]) != sampler.seed and "debug.seed" not in saved:
        diffs.append(f"debug.seed: checkpoint {sd['seed']}, this run {sampler.seed}")
    raise ValueError(
        f"checkpoint {path} was trained on other data or with another seed ({'; '.join(diffs)}): its data "
        "order cannot be continued; resume with its data.* options and debug.seed, or start a new "
        "--checkpoint.folder (or --checkpoint.resume=false)"
    )


def _resume(run: Run, path) -> None:
    """Load checkpoint `path` into `run`. The run trains with its own settings from the resumed step
    on: its optimizer settings (lr, betas, weight decay, eps, ...) replace the saved ones in the
    param groups (the moments and step counts stay the checkpoint's) and the LR schedule is this
    config's, at the resumed step; the log names each setting that differs from the saving run's."""
    cfg, optimizer = run.cfg, run.optimizer
    own = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
    st = run.ckpt.load(path, run.model, optimizer, run.train_state(0))
    named = STEP_DIR.match(path.name)
    check_train_state(st, path / TRAIN_STATE, int(named.group(1)) if named else None)
    run.step = st["step"]
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)  # initial_lr (optimizer.lr) included: the schedule's base
    # LambdaLR at the resumed step: lr = optimizer.lr x lr_lambda(step), as the uninterrupted run's
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg), last_epoch=run.step - 1)
    _check_same_data(run, path, st)
    run.sampler.load_state_dict(st["sampler"])
    log.info("resumed from %s at step %d", path, run.step)
    if run.rank != 0:
        return
    saved = st.get("settings")
    if saved is None:
        log.info(
            "checkpoint %s records no settings (saved by an earlier mxmoe): this run's optimizer and "
            "schedule settings apply from step %d",
            path,
            run.step + 1,
        )
        return
    now = run.settings()
    changed = [
        f"{k}={now.get(k)!r} (checkpoint: {saved.get(k)!r})"
        for k in sorted(set(now) | set(saved))
        if now.get(k) != saved.get(k)
    ]
    if changed:
        log.warning(
            "resuming %s with settings that differ from the run that saved it; this run's apply from "
            "step %d: %s",
            path.name,
            run.step + 1,
            ", ".join(changed),
        )


def check_train_state(st: dict, file, step: int | None = None) -> None:
    """CheckpointError naming `file` and the key unless `st` is a trainer state this trainer wrote:
    an int step (`step`, its folder's, when given), the sampler's position (ints), and, when
    present, the settings (an object)."""
    sampler = st.get("sampler")
    problem = None
    if type(st.get("step")) is not int or st["step"] < 0:
        problem = f"step={st.get('step')!r}: expected an int >= 0"
    elif step is not None and st["step"] != step:
        problem = f"step={st['step']}: expected {step}, the step its folder is named after"
    elif not isinstance(sampler, dict):
        problem = f"sampler={sampler!r}: expected the data position, an object"
    else:
        for k in ("epoch", "step", "seed", "n"):
            if type(sampler.get(k)) is not int or sampler[k] < 0:
                problem = f"sampler.{k}={sampler.get(k)!r}: expected an int >= 0"
                break
    if problem is None and not isinstance(st.get("settings", {}), dict):
        problem = f"settings={st['settings']!r}: expected an object"
    if problem is not None:
        raise CheckpointError(
            f"checkpoint file {file}: {problem}, not the trainer state this trainer writes: refused; "
            "resume from another checkpoint or start a new --checkpoint.folder"
        )
