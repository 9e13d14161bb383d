"""`mxmoe train`: train an MoE (or dense) byte-level language model, bf16 or MXFP8.

One process on CPU or one GPU; several with torchrun (FSDP2 for dense parameters, expert
parallelism for experts, see mxmoe.train.parallel). Configuration: mxmoe.train.config.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import select
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mxmoe.models import GraphedStep
from mxmoe.models.moe import MoE
from mxmoe.models.routing import expert_rows
from mxmoe.token_dispatch import describe_exchange
from mxmoe.train import determinism, parallel, profiling
from mxmoe.train.build import (  # noqa: F401  (build_model_args .. mx_convert: still importable from here)
    Run,
    build_model_args,
    build_optimizer,
    build_run,
    check_cast_kernels,
    check_values,
    compile_submodules,
    lr_lambda,
    mx_convert,
    precision,
    uses_mx,
)
from mxmoe.train.checkpoint import Checkpointer, CheckpointError, claim_folder
from mxmoe.train.checkpoint.common import process_cpus
from mxmoe.train.checkpoint.folders import enclosing_step_folder
from mxmoe.train.config import ConfigError, JobConfig, check_ranks_agree, parse_args
from mxmoe.train.data import VOCAB_SIZE, eval_windows
from mxmoe.train.metrics import MetricsError, MetricsWriter, RunLock, new_run_id

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


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the run stops before the optimizer step."""


# after training.stop_grace_s: how long the main thread has to unwind StepAbandoned (close the metrics,
# release the folders' locks, leave the process group) before the watchdog ends the process itself
UNWIND_S = 5.0


class StepAbandoned(BaseException):
    """The step in progress when SIGTERM / Ctrl-C came was given up: it did not finish within
    training.stop_grace_s, or a second SIGTERM came. Nothing of it is saved; the checkpoints saved
    before stay as they are. `code`: the exit status, 128 + the signal's number. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on its way (a save's, a collective's) reports it as
    a failure of its own."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class _Stop:
    """SIGTERM or Ctrl-C (SIGINT) sets a flag; the loop finishes its step, checkpoints and returns.
    A second Ctrl-C interrupts at once (KeyboardInterrupt: nothing more is saved); a second SIGTERM
    gives the step up at once (StepAbandoned). A step still running `grace_s` after the first signal
    is given up too: a watchdog thread signals the main thread again, whose handler raises
    StepAbandoned (a step stuck in Python code, or in a sleep or wait that a signal interrupts).
    If the process still runs UNWIND_S after that, or after a second signal, its main thread is
    blocked where no handler runs (e.g. a collective waiting in C++): the watchdog writes why to
    stderr and ends the process (os._exit). The watchdog learns of each signal from the signal
    module's wakeup fd, so it times a step whose main thread never runs the handler too.

    Saves are not timed: once the step's work is done (`finished`), its checkpoint is written,
    however long that takes. A save cut short (a second signal) leaves its `step-N.tmp` (a save
    renames it when whole): the checkpoints before it stay as they are. The loop keeps `step` (the
    step in progress), `finished` (the last step whose work is done: its saves follow), `folder` and
    `last_saved` (for the messages) up to date."""

    def __init__(self):
        self.requested = False
        self.by = "SIGTERM"  # what asked to stop: "SIGTERM" or "Ctrl-C"
        self.prev: dict = {}
        self.grace_s = 0.0
        self.step = self.finished = 0
        self.folder = None  # the checkpoint folder, None without checkpoints
        self.last_saved: int | None = None  # the step of the run's last checkpoint, None before one
        self._expired = False  # the grace is over: the handler raises StepAbandoned
        self._closing = False  # restore() has begun: the handler and the watchdog do nothing
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None  # (read, write) of the wakeup fd
        self._prev_wakeup = -1
        self._main = 0

    def install(self, grace_s: float) -> None:
        """The handlers, the wakeup fd and the watchdog thread; in the main thread only (elsewhere
        signals reach no handler of the run: nothing is installed, as before)."""
        self.grace_s = grace_s
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.prev[sig] = signal.signal(sig, self._handler)
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C handler must never block on a full pipe
        self._pipe = (r, w)
        self._prev_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="mxmoe-stop-watchdog", daemon=True)
        self._thread.start()

    def _handler(self, signum, frame) -> None:
        # flags only: the handler runs between any two bytecodes of the main thread, which may hold
        # any lock (the watchdog thread logs, waits and times instead)
        if self._closing:
            return
        if self._expired:  # the watchdog's signal: the step ran past the grace
            what = f"{self._past_grace()}: stopped without finishing it; {self._saved()}"
            raise StepAbandoned(what, 128 + signum)
        if signum == signal.SIGINT:
            if self.requested and self.by == "Ctrl-C":
                raise KeyboardInterrupt
            self.by = "Ctrl-C"
        elif self.requested:  # a second SIGTERM
            what = ", that save not written" if self.finished == self.step else " without finishing it"
            raise StepAbandoned(
                f"{self._second('SIGTERM')}: stopped at once{what}; {self._saved()}", 128 + signum
            )
        self.requested = True

    def _second(self, name: str) -> str:
        """What a second signal `name` interrupted, for the messages."""
        if self.finished == self.step:
            return f"a second {name} during the checkpoint save after step {self.step}"
        return f"a second {name} during step {self.step}"

    def _past_grace(self) -> str:
        return (
            f"{self.by} came during step {self.step}, which did not finish within "
            f"training.stop_grace_s={self.grace_s:g} s"
        )

    def _saved(self) -> str:
        """What the run has saved, for the messages of a step given up."""
        if self.folder is None:
            return "nothing is saved (no checkpoint.folder)"
        if self.last_saved is None:
            return f"no checkpoint of this run in {self.folder} yet"
        k, n = self.last_saved, self.step
        lost = ""
        if n > k:
            lost = f" (steps {k + 1}..{n} are not saved)" if n > k + 1 else f" (step {n} is not saved)"
        return f"the last checkpoint is {self.folder / f'step-{k:08d}'}, as it was{lost}"

    def _watch(self) -> None:
        """The watchdog thread: reads the signals' numbers from the wakeup fd; times the step after
        the first SIGTERM / SIGINT, then the unwinding after the grace or after a second signal."""
        r = self._pipe[0]
        first = None  # the first signal's number
        deadline = None  # when the grace, or the unwinding, is over
        why = ""  # why the process is unwinding ("" while it is not)
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([r], [], [], wait)
            if self._closing:
                return
            if ready:
                for signum in os.read(r, 64):
                    if signum not in (signal.SIGTERM, signal.SIGINT) or why:
                        continue
                    if first is None:
                        first = signum
                        if self.finished != self.step:
                            log.warning(
                                "%s during step %d: finishing it (training.stop_grace_s=%g s), then stopping",
                                "Ctrl-C" if signum == signal.SIGINT else "SIGTERM", self.step, self.grace_s,
                            )
                        deadline = time.monotonic() + self.grace_s
                    elif signum == signal.SIGTERM or first == signal.SIGINT:  # the second: at once
                        why = self._second("SIGTERM" if signum == signal.SIGTERM else "Ctrl-C")
                        code, deadline = 128 + signum, time.monotonic() + UNWIND_S
                continue
            if not why:  # the grace is over
                with self._lock:
                    if self._closing:
                        return
                    if self.finished == self.step:  # the step is done: its save goes on, however long
                        deadline = None
                        continue
                    self._expired = True
                    signal.pthread_kill(self._main, first)
                why = self._past_grace()
                code, deadline = 128 + first, time.monotonic() + UNWIND_S
                continue
            msg = (
                f"mxmoe train: error: {why}, and the process still ran "
                f"{UNWIND_S:g} s later (its main thread is blocked where no signal handler runs, e.g. in a "
                f"collective or a kernel): exiting now; {self._saved()}\n"
            )
            os.write(2, msg.encode())
            os._exit(code)

    def restore(self) -> None:
        """The previous handlers and wakeup fd back, the watchdog ended (a process that trains again
        installs anew)."""
        self._closing = True
        for sig, prev in self.prev.items():
            signal.signal(sig, prev)
        self.prev = {}
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._prev_wakeup)
        with self._lock:  # a watchdog past its checks has sent its signal (the handler ignores it now)
            os.write(self._pipe[1], b"\0")  # wakes the watchdog, which sees _closing
        self._thread.join()
        for fd in self._pipe:
            os.close(fd)
        self._pipe = self._thread = None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as e:  # tyro: --help (0), or a bad option with its message printed (2)
        return e.code if isinstance(e.code, int) else 2
    except (ConfigError, ValueError, TypeError) as e:
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return 2
    try:
        rank = parallel.launch_env()[0]
    except ValueError as e:
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return 2
    try:
        with console_logging(rank):
            return _main(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the loop, or a second one in it: one line, no trace
        print(
            "mxmoe train: interrupted (Ctrl-C): stopped at once; steps since the last checkpoint are not "
            "saved (one Ctrl-C during training finishes the step and saves)",
            file=sys.stderr,
        )
        return 130
    except StepAbandoned as e:  # the step did not finish in its grace after SIGTERM / Ctrl-C: one line
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return e.code


def _main(cfg: JobConfig) -> int:
    try:
        return train(cfg)
    except (ValueError, TypeError, NotImplementedError) as e:  # bad settings: a clear message, no trace
        print(f"mxmoe train: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, MetricsError, TrainingDiverged, parallel.CollectiveFailed) as e:
        print(f"mxmoe train: error: {e}", file=sys.stderr)  # the run cannot go on: say why, exit 1
        return 1


def train(cfg: JobConfig) -> int:
    """One training run; with debug.deterministic, all of it (CUDA's first use included) runs in
    `determinism.deterministic_mode`."""
    with determinism.deterministic_mode(cfg.debug.deterministic):
        return _train_run(cfg)


def _train_run(cfg: JobConfig) -> int:
    t, p = cfg.training, cfg.parallelism
    check_values(cfg)
    rank, world, device, own_pg = parallel.init_distributed(t.device, p.timeout_s)
    determinism.settle_cublas_config(device)  # deterministic mode on sm90: no GEMM parses the variable
    if uses_mx(cfg):  # a cast kernel the device cannot run, named as the option (not the recipe's field)
        check_cast_kernels(cfg, device)
    threads = torch.get_num_threads()
    if device.type == "cpu" and t.cpu_threads > 0:
        cpus = os.cpu_count()
        if cpus is not None and t.cpu_threads > cpus:
            log.warning(
                "training.cpu_threads=%d is more than the %d CPUs of this host (os.cpu_count()): the "
                "threads take turns on them, which slows every step; at most %d is useful",
                t.cpu_threads, cpus, cpus,
            )
        torch.set_num_threads(t.cpu_threads)
    ck_threads, cpus = cfg.checkpoint.threads, process_cpus()
    if cfg.checkpoint.folder and ck_threads > cpus:
        log.warning(
            "checkpoint.threads=%d is more than the %d CPUs this process may run on: each save writes %d "
            "files a rank (one a thread, empty ones where the threads outnumber the tensors) and hashes "
            "them in as many threads, which take turns on the CPUs; 0 picks min(8, CPUs / the host's ranks)",
            ck_threads, cpus, ck_threads,
        )
    distributed = dist.is_initialized()
    stop = _Stop()
    run_id, locks = new_run_id(), []
    peers: list = []
    try:
        if distributed:
            peers = parallel.gather_peers()
            check_ranks_agree(cfg)
            check_ranks_folder(cfg)
        # one live run per metrics / checkpoint folder: rank 0 takes the locks and every rank learns
        # the outcome
        busy = None
        if rank == 0:
            try:
                refuse_step_folder(cfg.job.dump_folder)
                ck = cfg.checkpoint
                refuse_non_folders({"job.dump_folder": cfg.job.dump_folder, "checkpoint.folder": ck.folder})
                locks.append(RunLock(cfg.job.dump_folder, run_id))
                if ck.folder:
                    same = os.path.realpath(ck.folder) == os.path.realpath(cfg.job.dump_folder)
                    locks += [x for x in [claim_folder(ck.folder, run_id, ck.resume, locked=same)] if x]
            except ValueError as e:
                busy = str(e)
            except OSError as e:  # e.g. a read-only folder: every rank must hear of it, not hang
                where = f"job.dump_folder={cfg.job.dump_folder!r}"
                if cfg.checkpoint.folder:
                    where += f" or checkpoint.folder={cfg.checkpoint.folder!r}"
                busy = f"{where}: cannot lock it for this run: {e}"
        if distributed:
            box = [busy]
            dist.broadcast_object_list(box, src=0)
            busy = box[0]
        if busy is not None:
            raise ValueError(busy)
        code = _train(build_run(cfg, rank, world, device), stop, run_id)
        if distributed:  # every rank done before any tears its process group down (a rank whose peer
            dist.barrier()  # had closed its sockets first aborted in the teardown, now and then)
        return code
    except RuntimeError as e:  # gloo's failures are plain RuntimeErrors: say which rank and what to check
        if distributed and parallel.is_collective_failure(e):
            raise parallel.CollectiveFailed(
                parallel.describe_collective_failure(e, rank, peers, p.timeout_s)
            ) from None
        raise
    finally:
        try:
            for lock in locks:
                lock.release()
            torch.set_num_threads(threads)
            if own_pg and dist.is_initialized():
                dist.destroy_process_group()
        finally:  # last: a step given up still has its watchdog while this unwinds
            stop.restore()


def refuse_non_folders(folders: dict[str, str]) -> None:
    """ValueError naming the setting whose path (a non-empty value of `folders`: setting -> path)
    exists and is not a folder (a file: the lock's "File exists" said neither which nor why)."""
    for name, path in folders.items():
        if path and os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(f"{name}={path!r} is a file, not a folder: expected a folder (made if missing)")


def refuse_step_folder(dump_folder: str) -> None:
    """ValueError naming job.dump_folder if it is or lies in a checkpoint's step folder: the run's
    lock, metrics and config written there are files the checkpoint's manifest does not list, and
    resuming or exporting that checkpoint refuses it."""
    step = enclosing_step_folder(dump_folder)
    if step is not None:
        raise ValueError(
            f"job.dump_folder={dump_folder!r} lies in the checkpoint step folder {str(step)!r}: the run's "
            "lock, metrics and config written there would spoil that checkpoint (files its manifest does "
            "not list); give another --job.dump_folder"
        )


def check_ranks_folder(cfg: JobConfig) -> None:
    """Collective over the default process group: ConfigError on every rank, naming the folder each
    rank resolved, unless they all resolve checkpoint.folder to one absolute folder (a relative one
    from different working folders splits a checkpoint's shards between folders: its save fails at
    the end of the run)."""
    if not cfg.checkpoint.folder:
        return
    world = dist.get_world_size()
    folders: list = [None] * world
    dist.all_gather_object(folders, os.path.realpath(cfg.checkpoint.folder))
    if all(f == folders[0] for f in folders):
        return
    each = "; ".join(f"rank {r}: {f}" for r, f in enumerate(folders))
    raise ConfigError(
        f"the ranks resolve checkpoint.folder={cfg.checkpoint.folder!r} to different folders ({each}): "
        "every rank saves its shard into the one folder; give an absolute --checkpoint.folder on a file "
        "system they share"
    )


def lm_loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, amp
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, router aux loss) of `model` on one batch; x, y: (batch, seq_len) int64 byte
    ids, y the next bytes of x. Logits are cast to fp32 for the loss; `amp` (`build.autocast`) wraps
    the forward. Both results are fp32 scalars; the trained loss is ce + aux_coef * aux."""
    with amp:
        logits, aux = model(x)
    ce = F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1))
    return ce, aux


def exchange_summary(model: torch.nn.Module) -> str:
    """The log line of the model's expert-parallel exchange (its first MoE layer's: every layer
    gets the same options from [mx])."""
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    return describe_exchange(getattr(moe.dispatch, "dispatcher", moe.dispatch), expert_rows(moe.experts))


def _log_run(run: Run, run_id: str) -> None:
    cfg = run.cfg
    total, active = run.margs.num_params()
    log.info("run %s, metrics in %s", run_id, cfg.job.dump_folder)
    log.info(
        "model %s: %.1fM params (%.1fM active), %s, device %s, world %d (ep %d), %d train / %d val "
        "sequences",
        cfg.model.name,
        total / 1e6,
        active / 1e6,
        precision(run.model, cfg) if uses_mx(cfg) else "high precision",
        run.device,
        run.world,
        run.pd.ep,
        len(run.train_ds),
        len(run.val_ds) if run.val_ds else 0,
    )
    if run.pd.ep > 1:
        log.info("%s", exchange_summary(run.model))
    c, e = run.corpus, run.epochs
    skipped = ", ".join(f"{k} {n}" for k, n in sorted(c["skipped"].items()))
    log.info(
        f"data {c['source']}: {c['files']:,} files, {c['train_tokens']:,} train / {c['val_tokens']:,} "
        f"validation tokens, corpus {c['sha256'][:12]}"
        + (f"; skipped {sum(c['skipped'].values())} not regular files ({skipped})" if skipped else "")
    )
    what = (
        f"{e['run_tokens']:,} tokens (training.steps x global batch x seq_len = {e['steps']} x "
        f"{e['global_batch']} x {e['seq_len']}), {e['epochs']:.2f} epochs of the train split's "
        f"{e['tokens_per_epoch']:,} tokens"
    )
    if e["epochs"] > 1 and run.rank == 0:
        log.warning(
            "the run reads %s: its training data repeats, and a loss past the first epoch measures "
            "memorization too. A larger corpus (--data.path=python-env, or a folder) or fewer steps keeps "
            "it to one epoch",
            what,
        )
    else:
        log.info("the run reads %s", what)


class _TrainStep:
    """Forward + backward of one batch, `(ce, aux) = step(x, y)`; with training.cuda_graph, captured
    on the first batch as one CUDA graph (static shapes from then on) and replayed."""

    def __init__(self, run: Run):
        self.run, self.graphed = run, None

    def _loss(self, x, y):
        ce, aux = lm_loss(self.run.model, x, y, self.run.amp)
        return ce + self.run.aux_coef * aux, ce, aux

    def __call__(self, x, y):
        if not self.run.cfg.training.cuda_graph:
            loss, ce, aux = self._loss(x, y)
            loss.backward()
            return ce, aux
        if self.graphed is None:
            self.graphed = GraphedStep(self._loss, self.run.model.parameters(), (x, y))
        _, ce, aux = self.graphed(x, y)
        return ce, aux


class _Validation:
    """The validation sample (validation.steps x local_batch_size x world windows spread over the whole set)
    and its mean cross-entropy per token over all ranks: `loss = validation()`."""

    def __init__(self, run: Run):
        t, val_ds = run.cfg.training, run.val_ds
        self.run = run
        n = run.cfg.validation.steps * t.local_batch_size * run.world
        self.idx = eval_windows(len(val_ds), n, run.world)
        self.tokens = self.idx.numel() * t.seq_len
        log.info(
            "validation: %d of %d windows (%d tokens%s), spread over the whole validation set",
            self.idx.numel(),
            len(val_ds),
            self.tokens,
            ", the whole set" if self.idx.numel() == len(val_ds) else "",
        )

    def __call__(self) -> float:
        run = self.run
        run.model.eval()
        total = torch.zeros(2, device=run.device, dtype=torch.float64)  # (loss x tokens, tokens)
        with torch.no_grad():
            for idx in self.idx[run.rank].split(run.cfg.training.local_batch_size):
                x, y = (a.to(run.device) for a in run.val_ds.batch(idx))
                total[0] += lm_loss(run.model, x, y, run.amp)[0].double() * y.numel()
                total[1] += y.numel()
        run.model.train()
        if run.distributed:
            dist.all_reduce(total)
        return float(total[0] / total[1])


def _diverged(
    run: Run, step: int, ce: torch.Tensor, aux: torch.Tensor, norm: float, lr: float
) -> TrainingDiverged:
    """The error of a non-finite loss or gradient norm at `step`. A checkpoint of step - 1 holds
    the weights this step started from: resuming it computes this step again (the same batch, the
    same weights, whatever the new settings), so rank 0 moves it aside as `step-N.diverged` (kept,
    never resumed) and the error names the checkpoint a resume now starts from."""
    local = float(ce.detach())
    what = "gradient norm" if math.isfinite(local) else f"loss ({local} on rank {run.rank})"
    last_ckpt = ""
    if run.ckpt is not None:
        done = run.ckpt.complete()
        if run.distributed:
            dist.barrier()  # every rank has listed the folder before rank 0 changes it
        if done and done[-1][0] == step - 1:
            path = done.pop()[1]
            try:
                if run.rank == 0:
                    Checkpointer.set_aside(path, "diverged")
                last_ckpt = (
                    f"; checkpoint {path.name} holds the weights this step started from (resuming it "
                    f"repeats this step), moved aside as {path.name}.diverged"
                )
            except OSError as e:
                last_ckpt = (
                    f"; checkpoint {path} holds the weights this step started from (resuming it repeats "
                    f"this step) and could not be moved aside ({e}): move it out of the folder first"
                )
        if done:
            last_ckpt += f"; the last checkpoint is {done[-1][1]}"
        else:
            last_ckpt += f"; no {'other ' if last_ckpt else ''}checkpoint in {run.ckpt.folder} yet"
    clip = "training.max_norm"
    if run.cfg.training.max_norm == 0:
        clip = "turn clipping on (training.max_norm=0 is off)"
    advice = f"Lower optimizer.lr or {clip}, or check the data"
    coef = run.aux_coef
    term = coef * float(aux.detach()) if coef > 0 else 0.0
    if coef > 0 and math.isfinite(local) and not term < abs(local):  # the router's term dominates
        advice = (
            f"Lower model.aux_loss_coef ({coef:g}: its term, {term:.3g} on rank {run.rank}, outweighs the "
            f"LM loss {local:.3g}); else lower optimizer.lr or {clip}, or check the data"
        )
    return TrainingDiverged(
        f"step {step}: non-finite {what} (global gradient norm {norm}) at lr {lr:.3g}: "
        f"stopped before the optimizer step, nothing saved{last_ckpt}. {advice}"
    )


def _check_router_bias(run: Run, step: int, finite_at: int) -> int:
    """`step` if every router's expert_bias is finite after step `step`'s bias update (it moves
    outside the optimizer, past the loss and gradient checks), else TrainingDiverged naming the
    steps since `finite_at` (the last step checked). A host sync: called where the loop has one
    (a record) or needs one (before a save)."""
    if run.model.router_bias_finite():
        return step
    rate = run.model.args.bias_update_rate
    latest = run.ckpt.latest() if run.ckpt is not None else None
    where = f"; the last checkpoint is {latest}" if latest is not None else ""
    since = f" of one of steps {finite_at + 1}-{step}" if finite_at < step - 1 else ""
    raise TrainingDiverged(
        f"step {step}: a router's expert_bias is not finite after the bias update{since} "
        f"(model.bias_update_rate={rate:g}): stopped before saving this step{where}. Lower "
        "model.bias_update_rate"
    )


def _stop_requested(run: Run, stop: _Stop) -> bool:
    """Whether any rank got SIGTERM (every rank learns it, so all stop after the same step)."""
    requested = stop.requested
    if run.distributed:
        flag = torch.tensor([float(requested)], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        requested = bool(flag.item())
    return requested


def _train(run: Run, stop: _Stop, run_id: str) -> int:
    """The loop over the steps of `run`: forward + backward, gradient reduction and clipping,
    optimizer and LR steps; metrics records, validation and checkpoints at their intervals."""
    cfg, model, optimizer, scheduler = run.cfg, run.model, run.optimizer, run.scheduler
    rank, world, device, distributed = run.rank, run.world, run.device, run.distributed
    t, ckpt = cfg.training, run.ckpt
    step = run.step

    _log_run(run, run_id)
    recorded = {**cfg.to_dict(), "corpus": run.corpus, "epochs": run.epochs}  # config.json
    m = cfg.metrics
    metrics = MetricsWriter(
        cfg.job.dump_folder,
        rank == 0,
        m.enable_tensorboard,
        recorded,
        run_id,
        start_step=step,
        wandb=m.enable_wandb,
        wandb_project=m.wandb_project,
    )
    world_group = dist.group.WORLD if distributed else None
    train_step = _TrainStep(run)
    validate = _Validation(run) if run.val_ds is not None else None

    def save(at: int) -> None:
        t0 = time.perf_counter()
        path = ckpt.save(at, model, optimizer, run.train_state(at))
        stop.last_saved = at
        # how long a save takes: what a stop at a time limit must leave it (docs/numerics.md)
        log.info("checkpoint step %d saved in %.1f s: %s", at, time.perf_counter() - t0, path)

    def log_record(at: int, lr: float, norm: float, val_step: bool) -> None:
        """The metrics record of step `at`: its training loss is the mean over the steps since the
        previous record and over the ranks (a collective: every rank calls it at the same step)."""
        nonlocal last_t, last_step, record, val_loss
        n = at - last_step
        stats = loss_sum / n
        if distributed:
            dist.all_reduce(stats)
            stats /= world
        loss_sum.zero_()
        now = time.perf_counter()
        tps = run.tokens_per_step * n / max(now - last_t, 1e-9)
        last_t, last_step = now, at
        record = {
            "step": at,
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
            record["val_tokens"] = validate.tokens
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
    stop.folder = ckpt.folder if ckpt is not None else None
    stop.last_saved = step if ckpt is not None and step > 0 else None  # the checkpoint resumed
    stop.step = stop.finished = step
    stop.install(t.stop_grace_s)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start_step, start_t = step, time.perf_counter()
    last_t, last_step, saved_at, bias_finite_at = start_t, step, step, step
    loss_sum = torch.zeros(2, device=device)  # (ce, aux) summed over the steps since the last record
    record: dict | None = None
    val_loss = None
    try:
        with profiling.step_profiler(cfg.profiling, cfg.job.dump_folder, rank, device, step + 1) as prof_step:
            while step < t.steps:
                step += 1
                stop.step = step
                batch = run.train_ds.batch(run.sampler.next_indices())
                x, y = (a.to(device, non_blocking=True) for a in batch)
                ce, aux = train_step(x, y)
                if run.exp_params:
                    parallel.reduce_expert_grads(run.exp_params, run.edp_group, world)
                norm = parallel.clip_grad_norm(
                    run.dense_params,
                    run.exp_params,
                    t.max_norm,
                    max(1, world // run.pd.ep),
                    distributed,
                    loss=ce,
                )
                lr = scheduler.get_last_lr()[0]  # the rate this step used (scheduler.step() moves on)
                if not math.isfinite(norm):  # the same on every rank: all stop here, nothing is saved
                    raise _diverged(run, step, ce, aux, norm, lr)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                model.update_router_bias(world_group)
                prof_step()
                loss_sum += torch.stack([ce.detach().float(), aux.detach().float()])

                last = step == t.steps
                val_step = validate is not None and (step % cfg.validation.freq == 0 or last)
                every = cfg.checkpoint.interval
                at_end = last and cfg.checkpoint.last_save
                save_now = ckpt is not None and ((every and step % every == 0) or at_end)
                record_now = step % cfg.metrics.log_freq == 0 or last or val_step
                if record_now or save_now:  # the same on every rank (the bias counts are summed over all)
                    bias_finite_at = _check_router_bias(run, step, bias_finite_at)
                if record_now:
                    log_record(step, lr, norm, val_step)
                if bar is not None:
                    bar.update(1)
                stop.finished = step  # the step's work is done: SIGTERM's grace does not time its saves
                if save_now:
                    save(step)
                    saved_at = step
                if _stop_requested(run, stop):
                    # the losses of the steps since the last record: recorded, as the run stops here
                    record_left = last_step != step
                    save_left = ckpt is not None and saved_at != step and not last  # a finished run: none
                    if record_left or save_left:
                        bias_finite_at = _check_router_bias(run, step, bias_finite_at)
                    if record_left:
                        log_record(step, lr, norm, val_step=False)
                    if save_left:
                        save(step)
                        saved_at = step
                    log.warning(
                        "%s: stopped after step %d%s",
                        stop.by,
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
            run.tokens_per_step * (step - start_step) / max(elapsed, 1e-9),
            record["loss"] if record else float("nan"),
            f", validation loss {val_loss:.4f}" if val_loss is not None else "",
            memory_gib(device),
            cfg.job.dump_folder,
            f"; checkpoint {ckpt.folder / f'step-{saved_at:08d}'}" if ckpt is not None and saved_at else "",
        )
    return 130 if stop.requested and stop.by == "Ctrl-C" else 0  # a shell's status after Ctrl-C


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


if __name__ == "__main__":
    sys.exit(main())
