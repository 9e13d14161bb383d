"""`mxmoe train`: train an MoE (or dense) byte-level language model, bf16 or MXFP8.

One process on CPU or one GPU; several with torchrun (FSDP2 for dense parameters, expert
parallelism for experts, see mxmoe.train.parallel). Configuration: mxmoe.train.config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mxmoe.models import GraphedStep, LocalExperts, Transformer, apply_expert_parallel, model_args
from mxmoe.train import determinism, parallel, profiling
from mxmoe.train.checkpoint import Checkpointer, CheckpointError, claim_folder
from mxmoe.train.config import ConfigError, JobConfig, check_limits, check_ranks_agree, help_text, parse_args
from mxmoe.train.data import VOCAB_SIZE, PackedDataset, ShardedSampler, eval_windows, load_tokens
from mxmoe.train.metrics import MetricsWriter, RunLock, new_run_id

log = logging.getLogger("mxmoe.train")


class _ConsoleHandler(logging.StreamHandler):
    """Writes through `tqdm.write`, so lines land above a live progress bar, not through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def console_logging(rank: int):
    """The "mxmoe" logger for one command-line run: INFO (rank 0 only: progress lines, the
    `mxmoe.convert` report, the summary) to stdout, warnings and errors (every rank) to stderr.
    Removed again on exit, so runs in one process (tests) do not stack handlers."""
    logger = logging.getLogger("mxmoe")
    handlers = []
    if rank == 0:
        out = _ConsoleHandler(sys.stdout)
        out.setLevel(logging.INFO)
        out.addFilter(lambda r: r.levelno < logging.WARNING)
        out.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        handlers.append(out)
    err = _ConsoleHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    where = f" (rank {rank})" if rank else ""
    err.setFormatter(logging.Formatter(f"mxmoe %(levelname)s{where}: %(message)s"))
    handlers.append(err)
    saved = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in handlers:
        logger.addHandler(h)
    try:
        yield
    finally:
        for h in handlers:
            logger.removeHandler(h)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def memory_gib(device: torch.device) -> float:
    """Peak memory: CUDA max allocated on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


_TUNABLE_MODEL_ARGS = ("max_seq_len", "aux_loss_coef", "bias_update_rate", "init_std")
"""ModelArgs fields a resumed run may change (max_seq_len follows training.seq_len, checked apart)."""


def lr_lambda(cfg: JobConfig):
    t = cfg.training

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        frac = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def build_optimizer(model: torch.nn.Module, cfg: JobConfig, distributed: bool) -> torch.optim.Optimizer:
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


def build_model_args(cfg: JobConfig):
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
    MoE layer without expert parallelism (its dispatch is `LocalExperts`: one process, or FSDP
    only) compiles whole, with fullgraph=True: router, token permutation, routed experts (bf16
    `GroupedExperts` or `MXGroupedExperts`, whose grouped ops are torch.library custom ops with fake
    implementations), unpermutation and shared expert in one graph, so the high-precision and the
    MX model get the same treatment. It has no host sync: the expert rows are always T * top_k, the
    per-expert counts stay on the device. With expert parallelism the all-to-all needs the split
    sizes on the host (and its collectives stay out of compiled graphs): the router and the shared
    expert are compiled, the permutation, the experts and the exchange run eager.
    """
    for blk in model.layers:
        for sub in (blk.attention, blk.attention_norm, blk.ffn_norm, blk.feed_forward):
            if sub is not None:
                sub.compile(backend=backend)
        moe = blk.moe
        if moe is None:
            continue
        if isinstance(moe.dispatch, LocalExperts):
            moe.compile(backend=backend, fullgraph=True)
        else:
            moe.router.compile(backend=backend)
            if moe.shared_expert is not None:
                moe.shared_expert.compile(backend=backend)
    model.norm.compile(backend=backend)


def mx_convert(model: torch.nn.Module, cfg: JobConfig, pd: parallel.ParallelDims):
    """`mxmoe.convert(model, ...)` with the options of `cfg.mx` (the trainer's `--mx.*`), in place;
    returns its ConversionReport (also `model.mx_conversion`)."""
    import mxmoe
    from mxmoe.nn import MXConfig

    mx = cfg.mx
    mxmoe.convert(
        model,
        MXConfig(
            recipe_name=mx.recipe_name,
            mxfp8_dim1_cast_kernel_choice=mx.mxfp8_dim1_cast_kernel_choice,
            mxfp8_dim0_cast_kernel_choice=mx.mxfp8_dim0_cast_kernel_choice,
            filter_fqns=list(mx.filter_fqns),
            convert_linears=mx.convert_linears,
            convert_grouped_experts=mx.convert_grouped_experts,
            gemm_backend=mx.gemm_backend,
            expert_gemm=mx.expert_gemm,
        ),
        parallel_dims=pd,
    )
    return model.mx_conversion


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the run stops before the optimizer step."""


class _Stop:
    """SIGTERM sets a flag; the loop finishes its step, checkpoints and returns."""

    def __init__(self):
        self.requested = False
        self.prev = None

    def install(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread():
            self.prev = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        if self.prev is not None:
            signal.signal(signal.SIGTERM, self.prev)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"mxmoe train: {e}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    with console_logging(rank):
        return _main(cfg)


def _main(cfg: JobConfig) -> int:
    try:
        return train(cfg)
    except (ValueError, TypeError, NotImplementedError) as e:  # bad settings: a clear message, no trace
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, TrainingDiverged) as e:  # the run cannot go on: say why, exit 1
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return 1


def check_values(cfg: JobConfig) -> None:
    """ValueError naming the setting, the value and what is accepted, before anything is built."""
    t = cfg.training
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
    from mxmoe.recipe import recipe_from_options

    mx = cfg.mx
    recipe_from_options(
        mx.recipe_name,
        mx.mxfp8_dim1_cast_kernel_choice,
        mx.mxfp8_dim0_cast_kernel_choice,
        mx.gemm_backend,
        expert_gemm=mx.expert_gemm,
        option_prefix="mx.",
    )
    if mx.expert_gemm == "hp" and not mx.convert_grouped_experts:
        raise ValueError(
            "mx.expert_gemm='hp' sets how the converted experts compute, but "
            "mx.convert_grouped_experts=false leaves them unconverted (bf16 GEMMs and a bf16 exchange); "
            "drop one of the two"
        )
    check_limits(cfg)


def train(cfg: JobConfig) -> int:
    """One training run; with training.deterministic, all of it (CUDA's first use included) runs in
    `determinism.deterministic_mode`."""
    with determinism.deterministic_mode(cfg.training.deterministic):
        return _train_run(cfg)


def _train_run(cfg: JobConfig) -> int:
    t, p = cfg.training, cfg.parallelism
    unknown = sorted(set(cfg.model.converters) - {"mx"})
    if unknown:
        raise ValueError(
            f"model.converters={cfg.model.converters!r}: unknown converter(s) {unknown}; expected 'mx'"
        )
    use_mx = "mx" in cfg.model.converters
    if t.mixed_precision not in ("bf16", "fp32"):
        raise ValueError(f"training.mixed_precision={t.mixed_precision!r}: expected bf16 or fp32")
    if t.cpu_threads < 0:
        raise ValueError(f"training.cpu_threads={t.cpu_threads}: expected >= 0 (0 = torch's default)")
    check_values(cfg)
    profiling.check(cfg.profiling)
    rank, world, device, own_pg = parallel.init_distributed(t.device, p.timeout_s)
    threads = torch.get_num_threads()
    if device.type == "cpu" and t.cpu_threads > 0:
        torch.set_num_threads(t.cpu_threads)
    distributed = dist.is_initialized()
    stop = _Stop()
    run_id, locks = new_run_id(), []
    try:
        if distributed:
            check_ranks_agree(cfg)
        # one live run per metrics / checkpoint folder: rank 0 takes the locks and every rank learns
        # the outcome
        busy = None
        if rank == 0:
            try:
                locks.append(RunLock(cfg.metrics.folder, run_id))
                ck = cfg.checkpoint
                if ck.folder:
                    same = os.path.realpath(ck.folder) == os.path.realpath(cfg.metrics.folder)
                    locks += [x for x in [claim_folder(ck.folder, run_id, ck.resume, locked=same)] if x]
            except ValueError as e:
                busy = str(e)
            except OSError as e:  # e.g. a read-only folder: every rank must hear of it, not hang
                busy = f"metrics.folder={cfg.metrics.folder!r}: cannot lock it for this run: {e}"
        if distributed:
            box = [busy]
            dist.broadcast_object_list(box, src=0)
            busy = box[0]
        if busy is not None:
            raise ValueError(busy)
        return _train(cfg, rank, world, device, distributed, use_mx, stop, run_id)
    finally:
        for lock in locks:
            lock.release()
        stop.restore()
        torch.set_num_threads(threads)
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def _train(
    cfg: JobConfig,
    rank: int,
    world: int,
    device: torch.device,
    distributed: bool,
    use_mx: bool,
    stop: _Stop,
    run_id: str,
) -> int:
    t, p, m = cfg.training, cfg.parallelism, cfg.model
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
    if pd.tp > 1 and use_mx:
        # the converter owns this refusal: let it raise its own error before anything is built
        mx_convert(torch.nn.Module(), cfg, pd)
    parallel.check_parallel_dims(pd, margs.num_experts)

    determinism.seed_everything(t.seed)
    with torch.device(device):
        model = Transformer(margs)
    dp_mesh = ep_mesh = edp_group = None
    if distributed:
        dp_mesh, ep_mesh = parallel.build_meshes(pd, device, p.timeout_s)
        if ep_mesh is not None:
            ep_group, edp_group = ep_mesh.get_group("ep"), ep_mesh.get_group("edp")
            apply_expert_parallel(model, ep_group)
    if use_mx:
        mx_convert(model, cfg, pd)
    if t.compile:
        compile_submodules(model)
    elif t.compile_full:
        model.compile(fullgraph=True)  # in place: parameter and state_dict names unchanged
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
    step = 0
    if (
        ckpt is not None
        and cfg.checkpoint.resume
        and (path := ckpt.resume_path(cfg.checkpoint.fallback)) is not None
    ):
        st = ckpt.load(path, model, optimizer, _train_state(0, scheduler, sampler))
        step = int(st["step"])
        for group in optimizer.param_groups:  # the saving run may have had another world size
            group["foreach"] = not distributed
        scheduler.load_state_dict(st["scheduler"])
        sampler.load_state_dict(st["sampler"])
        log.info("resumed from %s at step %d", path, step)

    total, active = margs.num_params()
    log.info("run %s, metrics in %s", run_id, cfg.metrics.folder)
    log.info(
        "model %s: %.1fM params (%.1fM active), %s, device %s, world %d (ep %d), %d train / %d val "
        "sequences",
        m.name,
        total / 1e6,
        active / 1e6,
        _precision(model, cfg) if use_mx else "high precision",
        device,
        world,
        pd.ep,
        len(train_ds),
        len(val_ds) if val_ds else 0,
    )
    metrics = MetricsWriter(
        cfg.metrics.folder, rank == 0, cfg.metrics.tensorboard, cfg.to_dict(), run_id, start_step=step
    )
    amp = (
        # a captured step must not keep autocast's weight casts in a cache outside the graph
        torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=not t.cuda_graph)
        if device.type == "cuda" and t.mixed_precision == "bf16"
        else contextlib.nullcontext()
    )
    aux_coef = margs.aux_loss_coef if margs.load_balance == "aux_loss" else 0.0
    world_group = dist.group.WORLD if distributed else None
    tokens_per_step = t.batch_size * t.seq_len * world

    def loss_of(x, y):
        with amp:
            logits, aux = model(x)
        ce = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1))
        return ce, aux

    graphed = None

    def train_step(x, y):
        """Forward + backward of one batch: (ce, aux)."""
        nonlocal graphed
        if not t.cuda_graph:
            ce, aux = loss_of(x, y)
            (ce + aux_coef * aux).backward()
            return ce, aux
        if graphed is None:  # captured on the first batch (static shapes from then on)

            def step_fn(xs, ys):
                ce, aux = loss_of(xs, ys)
                return ce + aux_coef * aux, ce, aux

            graphed = GraphedStep(step_fn, model.parameters(), (x, y))
        _, ce, aux = graphed(x, y)
        return ce, aux

    # the validation sample: val_batches x batch_size x world windows spread over the whole set
    val_idx = eval_windows(len(val_ds), t.val_batches * t.batch_size * world, world) if val_ds else None
    val_sample_tokens = val_idx.numel() * t.seq_len if val_ds else 0
    if val_ds is not None:
        log.info(
            "validation: %d of %d windows (%d tokens%s), spread over the whole validation set",
            val_idx.numel(),
            len(val_ds),
            val_sample_tokens,
            ", the whole set" if val_idx.numel() == len(val_ds) else "",
        )

    def validate() -> float:
        """Mean cross-entropy per token over the validation sample (all ranks)."""
        model.eval()
        total = torch.zeros(2, device=device, dtype=torch.float64)  # (loss x tokens, tokens)
        with torch.no_grad():
            for idx in val_idx[rank].split(t.batch_size):
                x, y = (a.to(device) for a in val_ds.batch(idx))
                total[0] += loss_of(x, y)[0].double() * y.numel()
                total[1] += y.numel()
        model.train()
        if distributed:
            dist.all_reduce(total)
        return float(total[0] / total[1])

    def save(at: int) -> None:
        ckpt.save(at, model, optimizer, _train_state(at, scheduler, sampler))

    bar = None
    # a bar only on a terminal: redirected to a file, tqdm's frames are one endless line
    if rank == 0 and cfg.metrics.progress_bar and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=t.steps, initial=step, desc="train", dynamic_ncols=True, file=sys.stderr)
    if step >= t.steps:
        log.warning(
            "already at step %d >= training.steps=%d: nothing to train (raise --training.steps or use "
            "a new --checkpoint.folder)",
            step,
            t.steps,
        )
    stop.install()
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start_step, start_t = step, time.perf_counter()
    last_t, last_step, saved_at = start_t, step, step
    loss_sum = torch.zeros(2, device=device)  # (ce, aux) summed over the steps since the last record
    record: dict | None = None
    val_loss = None
    try:
        with profiling.step_profiler(cfg.profiling, cfg.metrics.folder, rank, device, step + 1) as prof_step:
            while step < t.steps:
                step += 1
                x, y = (a.to(device, non_blocking=True) for a in train_ds.batch(sampler.next_indices()))
                ce, aux = train_step(x, y)
                if exp_params:
                    parallel.reduce_expert_grads(exp_params, edp_group, world)
                norm = parallel.clip_grad_norm(
                    dense_params, exp_params, t.max_norm, max(1, world // pd.ep), distributed, loss=ce
                )
                lr = scheduler.get_last_lr()[0]  # the rate this step used (scheduler.step() moves on)
                if not math.isfinite(norm):  # the same on every rank: all stop here, nothing is saved
                    local = float(ce.detach())
                    what = "gradient norm" if math.isfinite(local) else f"loss ({local} on rank {rank})"
                    last_ckpt = f"; the last checkpoint is {ckpt.latest()}" if ckpt is not None else ""
                    raise TrainingDiverged(
                        f"step {step}: non-finite {what} (global gradient norm {norm}) at lr {lr:.3g}: "
                        f"stopped before the optimizer step, nothing saved{last_ckpt}. Lower training.lr "
                        "or training.max_norm, or check the data"
                    )
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                model.update_router_bias(world_group)
                prof_step()
                loss_sum += torch.stack([ce.detach().float(), aux.detach().float()])

                last = step == t.steps
                val_step = val_ds is not None and (step % t.val_interval == 0 or last)
                if step % cfg.metrics.log_freq == 0 or last or val_step:
                    # the training loss of a record is the mean over its interval's steps and ranks
                    n = step - last_step
                    stats = loss_sum / n
                    if distributed:
                        dist.all_reduce(stats)
                        stats /= world
                    loss_sum.zero_()
                    now = time.perf_counter()
                    tps = tokens_per_step * n / max(now - last_t, 1e-9)
                    last_t, last_step = now, step
                    record = {
                        "step": step,
                        "loss": float(stats[0]),
                        "loss_steps": n,
                        "aux_loss": float(stats[1]),
                        "tokens_per_s": tps,
                        "memory_gib": memory_gib(device),
                        "lr": lr,
                        "grad_norm": norm,
                    }
                    if val_step:
                        record["val_loss"] = val_loss = validate()
                        record["val_tokens"] = val_sample_tokens
                        last_t = time.perf_counter()  # validation time is not training throughput
                    metrics.log(record)
                    if bar is None or "val_loss" in record:
                        log.info(_progress_line(record, t.steps))
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{record['loss']:.4f}",
                            tok_s=f"{record['tokens_per_s']:.0f}",
                            mem=f"{record['memory_gib']:.2f}GiB",
                        )
                if bar is not None:
                    bar.update(1)
                every = cfg.checkpoint.interval
                if ckpt is not None and ((every and step % every == 0) or last):
                    save(step)
                    saved_at = step
                requested = stop.requested
                if distributed:
                    flag = torch.tensor([float(requested)], device=device)
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    requested = bool(flag.item())
                if requested:
                    if ckpt is not None and saved_at != step:
                        save(step)
                        saved_at = step
                    log.warning(
                        "SIGTERM: stopped after step %d%s",
                        step,
                        f", checkpoint in {ckpt.folder}" if ckpt else "",
                    )
                    break
    finally:
        if bar is not None:
            bar.close()
        metrics.close()
    if step > start_step:
        elapsed = time.perf_counter() - start_t
        log.info(
            "done: steps %d..%d of %d in %.1f s (%.0f tokens/s including validation and checkpoints); "
            "last training loss %.4f%s; peak memory %.2f GiB; metrics in %s%s",
            start_step + 1,
            step,
            t.steps,
            elapsed,
            tokens_per_step * (step - start_step) / max(elapsed, 1e-9),
            record["loss"] if record else float("nan"),
            f", validation loss {val_loss:.4f}" if val_loss is not None else "",
            memory_gib(device),
            cfg.metrics.folder,
            f"; checkpoint {ckpt.folder / f'step-{saved_at:08d}'}" if ckpt is not None and saved_at else "",
        )
    return 0


def _progress_line(record: dict, steps: int) -> str:
    """One plain log line from a metrics record."""
    line = (
        f"step {record['step']}/{steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
        f"grad_norm {record['grad_norm']:.3g}  {record['tokens_per_s']:.0f} tokens/s  "
        f"memory {record['memory_gib']:.2f} GiB"
    )
    if "val_loss" in record:
        line += f"  val_loss {record['val_loss']:.4f}"
    return line


def _precision(model: torch.nn.Module, cfg: JobConfig) -> str:
    """What the mx converter actually did: the modules now MX, or that it swapped none."""
    from mxmoe.nn import MXGroupedExperts, MXLinear

    n = sum(isinstance(mod, (MXLinear, MXGroupedExperts)) for mod in model.modules())
    if n == 0:
        return "high precision (the mx converter swapped no module)"
    hp = sum(isinstance(m, MXGroupedExperts) and m.recipe.expert_gemm == "hp" for m in model.modules())
    what = f" ({hp} of them high-precision experts on MX-rounded rows: expert_gemm=hp)" if hp else ""
    return f"MXFP8 {cfg.mx.recipe_name} in {n} modules{what}"


def _train_state(step: int, scheduler, sampler) -> dict:
    return {"step": step, "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict()}


if __name__ == "__main__":
    sys.exit(main())
