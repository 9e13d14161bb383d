"""`mxmoe compare`: variants x seeds of one training config, as a table and a plot in one folder.

    mxmoe compare --config moe_2b --steps 300 --seeds 0,1,2 --out runs/cmp \\
        --variant bf16 --variant "mx=--model.converters=mx" --parallel 3 \\
        -- --validation.freq=300 --validation.steps=40
    mxmoe compare --runs runs/cmp/runs --baseline bf16 --out runs/cmp2     # read finished runs

Running: one `python -m mxmoe train` subprocess per (variant, seed), `--parallel K` at a time
(several small runs share one GPU; `--devices 0,1` spreads them over GPUs by CUDA_VISIBLE_DEVICES;
`--nproc N` runs each under `torch.distributed.run` on N GPUs, e.g. for expert parallelism),
each with `--config`, then `--checkpoint.folder=` (no checkpoints: a config's checkpoint folder would
make every run resume the same one), `--debug.deterministic=true` (unless --no_deterministic),
`--training.steps`, the variant's arguments, the arguments after `--` (every run), and last the
seed and `--job.dump_folder=OUT/runs/VARIANT/seedS`; a `--checkpoint.folder=X` among the arguments
becomes X/VARIANT/seedS, each run's own (a stopped run resumes its own checkpoint when the same
command runs again). A variant is `NAME=ARGS`, ARGS the trainer
options as one shell-quoted string, or just NAME for none (repeat --variant per variant: trainer
values hold commas, as `--mx.filter_fqns=output,router`); the first is the baseline unless
--baseline names another. Each run's console goes to its folder's train.log; a run that finished
(its command.json records the same command, the same --config file contents and status 0) is not
run again, so an interrupted
compare continues where it stopped; `--time_limit_s` bounds the call: `--grace_s` before it the running
runs get SIGTERM (each saves its checkpoint; the grace is raised to 1.5 x the longest save recorded in
their checkpoint manifests + 10 s; a run whose remaining steps fit before the limit at the rate it
logged them finishes instead) and no more start, at it they are killed, and the tables of the
finished ones are written; `--delete_finished_checkpoints` deletes a finished run's own checkpoints.

Reading (`--runs DIR`): DIR/VARIANT/RUN/metrics.jsonl, the seed read from the config of the run
that wrote the records (RUN/config.json, or config.<run_id>.json of a later run in the folder; the
layout the running mode writes under OUT/runs; a run whose command.json records a failure or a
stop at the time limit, or whose records end before its training.steps, is left out, a run folder
without metrics.jsonl is an error). --out is
checked to be a writable folder before anything runs. A malformed record is an error naming its
file, line and field.

Paired runs must share their setup (training steps, the last logged step, sequence length, global
batch and corpus, from each run's config.json): runs that differ are refused, naming them. Each
run's epochs (how often it reads its train split) are in the runs table; runs that read their data
more than once are flagged.

Written into OUT: compare.md and compare.json (per run: final training loss = the mean training loss
per step over the last `--tail_steps` steps (default: the last 10 % of the run), final validation
loss = the last logged `val_loss`, median tokens/s; per variant: the paired difference from the
baseline, seed by seed, in % of the baseline's loss, with its mean, sample standard deviation, min
and max over the seeds; time to target, final losses at the horizon and the not-converged flag,
`targets`) and compare.png (each variant's loss curves, mean and spread over seeds;
the differences variant - baseline per seed, in %).

The package: `report` (a run's numbers, the paired differences, compare.md / .json / .png, reading
finished runs), `launcher` (the trainer subprocesses of the variants x seeds), `targets` (time to target, the
final losses at the horizon); the command is here.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shlex
import sys
from pathlib import Path

from mxmoe import configs
from mxmoe.cli import ArgumentParser, check_out_folder, comma_list, positive_int
from mxmoe.train.compare.launcher import (
    DONE,
    check_own,
    check_paired_setup,
    check_trainer_args,
    grace_seconds,
    launch,
    parse_variant,
    trainer_argv,
)
from mxmoe.train.compare.report import (
    Run,
    analyse,
    markdown,
    paired_differences,
    plot,
    read_runs,
    run_summary,
    spread,
)
from mxmoe.train.compare.targets import time_to_target

__all__ = [
    "DONE",
    "Run",
    "analyse",
    "launch",
    "main",
    "markdown",
    "paired_differences",
    "parse_variant",
    "plot",
    "read_runs",
    "run_summary",
    "spread",
    "time_to_target",
]


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog="mxmoe compare",
        description=__doc__.split("\n")[0],
        epilog="Arguments after `--` go to every run's `mxmoe train`.",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--config", help="run the variants of this trainer config: a name (mxmoe config list) or a TOML file"
    )
    src.add_argument("--runs", help="read finished runs: a folder of VARIANT/RUN/metrics.jsonl")
    ap.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME=ARGS",
        help="a variant: its name and trainer options as one quoted string, e.g. 'mx=--model.converters=mx' "
        "or 'bf16' (no options); repeat per variant, the first is the baseline. With --runs: the "
        "variants to read, in this order (default: every folder, by name)",
    )
    ap.add_argument("--baseline", help="the variant the others are compared with (default: the first)")
    ap.add_argument(
        "--seeds", type=comma_list(int), default=[0], help="training seeds, e.g. 0,1,2 (default 0)"
    )
    ap.add_argument(
        "--steps", type=positive_int, help="--training.steps of every run (default: the config's)"
    )
    ap.add_argument(
        "--out", required=True, help="output folder: compare.md/.json/.png (and runs/ when running)"
    )
    ap.add_argument("--parallel", type=positive_int, default=1, help="runs at a time (default 1)")
    ap.add_argument(
        "--time_limit_s",
        type=float,
        help="after this many seconds start no run and stop (SIGTERM) the running ones, then write the "
        "tables of the finished runs; the same command again runs the rest",
    )
    ap.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="processes (GPUs) per run, under torch.distributed.run (for expert parallel variants; "
        "default 1)",
    )
    ap.add_argument(
        "--devices",
        type=comma_list(str),
        help="CUDA devices to spread the runs over (CUDA_VISIBLE_DEVICES of each run: --nproc of them; "
        "--parallel runs on each group "
        "per device), e.g. 0,1,2,3; default: every run sees what this process sees",
    )
    ap.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run with --debug.deterministic=true (default; bit-reproducible runs, slower)",
    )
    ap.add_argument(
        "--tail_steps",
        type=int,
        default=0,
        help="final train loss = mean over this many last steps (default 0: the last 10%% of the run)",
    )
    ap.add_argument(
        "--smooth", type=float, default=0.0, help="EMA smoothing of the plotted train curves, 0..1"
    )
    ap.add_argument(
        "--grace_s",
        type=float,
        help="with --time_limit_s: SIGTERM the runs this many seconds before the limit, SIGKILL at it, so "
        "that their checkpoints are saved in time; raised to 1.5 x the longest save recorded in the runs' "
        "checkpoint folders + 10 s (default with none recorded: 120 s; 30 s without checkpoints); a run "
        "whose remaining steps fit before the limit at its logged rate (x 1.1 + 15 s) finishes instead",
    )
    ap.add_argument(
        "--delete_finished_checkpoints",
        action="store_true",
        help="delete a run's own checkpoint folder when it finishes (frees the disk for the runs still "
        "going)",
    )
    ap.add_argument(
        "--smooth_steps",
        type=positive_int,
        default=50,
        help="time-to-target: the smoothed training loss at step s is the mean over (s - N, s] (default 50)",
    )
    ap.add_argument(
        "--train_targets",
        type=comma_list(float),
        help="time-to-target training losses, e.g. 1.2,1.0 (default: the baseline's mean curve past its "
        "knee)",
    )
    ap.add_argument(
        "--val_targets",
        type=comma_list(float),
        help="time-to-target validation losses (default: as training's)",
    )
    return ap


TABLES = ("compare.md", "compare.json", "compare.png")


def _set_aside_tables(out: Path) -> str:
    """After a failed compare: the tables a previous compare wrote in `out` renamed NAME.stale (they
    no longer answer the command just run, and looked current); what the error adds about them."""
    moved = []
    for name in TABLES:
        table = out / name
        if table.is_file():
            try:
                table.replace(out / f"{name}.stale")
            except OSError:
                continue
            moved.append(name)
    if not moved:
        return ""
    return f"; the tables of a previous compare in {out} ({', '.join(moved)}) renamed *.stale"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = build_parser()
    args = ap.parse_args(argv)
    failed: list = []
    command = shlex.join(["mxmoe", "compare", *argv, *(["--", *extra] if extra else [])])
    try:
        check_out_folder(args.out)  # before any run: not at the end, on a file or a read-only folder
        if args.time_limit_s is not None and not args.time_limit_s > 0:
            raise ValueError(f"--time_limit_s={args.time_limit_s}: expected a number of seconds > 0")
        for name in ("train_targets", "val_targets"):
            bad = [t for t in getattr(args, name) or [] if not math.isfinite(t)]
            if bad:
                raise ValueError(f"--{name}: {bad[0]!r} is not a finite loss")
        if args.grace_s is not None and (args.time_limit_s is None or not args.grace_s >= 0):
            raise ValueError(f"--grace_s={args.grace_s}: expected seconds >= 0, with --time_limit_s")
        if args.tail_steps < 0:
            raise ValueError(f"--tail_steps={args.tail_steps}: expected >= 0 (0: the last 10 % of the run)")
        if not 0.0 <= args.smooth < 1.0:
            raise ValueError(f"--smooth={args.smooth!r}: expected 0 <= smooth < 1 (EMA factor)")
        names = [n for n, _ in args.variant]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--variant: name(s) {dup} given twice")
        if args.baseline is not None and names and args.baseline not in names:  # before any run
            raise ValueError(f"--baseline={args.baseline!r}: not a --variant; expected one of {names}")
        out = Path(args.out)
        if args.runs is not None:
            if extra:
                raise ValueError(
                    f"trainer arguments after `--` ({shlex.join(extra)}) need --config, not --runs"
                )
            runs = read_runs(args.runs, names or None, args.tail_steps)
        else:
            if len(args.variant) < 2:
                raise ValueError(
                    f"--variant: given {len(args.variant)}, expected at least 2 (a baseline and one more)"
                )
            if len(set(args.seeds)) != len(args.seeds):
                raise ValueError(f"--seeds={','.join(map(str, args.seeds))}: a seed is given twice")
            bad = [s for s in args.seeds if not 0 <= s < 2**32]
            if bad:
                raise ValueError(f"--seeds: {bad[0]} is not a seed; expected 0 <= seed < 2**32 (debug.seed)")
            if args.devices:  # CUDA_VISIBLE_DEVICES of GPUs that are not there: the runs train on the CPU
                import torch

                if not torch.cuda.is_available():
                    raise ValueError(
                        f"--devices={','.join(args.devices)}: no CUDA GPU is available here; leave it out to "
                        "run on what this machine has"
                    )
                # an index past the GPUs there: a run that sees no GPU trains on the CPU; a device
                # named twice: two groups of runs share it. (CUDA_VISIBLE_DEVICES of this process
                # set: its children's indices are the machine's, not checked against it.)
                if len(set(args.devices)) != len(args.devices):
                    raise ValueError(f"--devices={','.join(args.devices)}: a device is named twice")
                if "CUDA_VISIBLE_DEVICES" not in os.environ:
                    n = torch.cuda.device_count()
                    bad = [d for d in args.devices if d.isdigit() and int(d) >= n]
                    if bad:
                        raise ValueError(
                            f"--devices={','.join(args.devices)}: no GPU {bad[0]} here; this machine has {n} "
                            f"(0..{n - 1})"
                        )
            if args.devices and len(args.devices) < args.nproc:
                raise ValueError(
                    f"--devices={','.join(args.devices)}: {len(args.devices)} device(s), fewer than "
                    f"--nproc={args.nproc} per run"
                )
            config_file = configs.resolve(args.config, kind="trainer")
            if not config_file.is_file():
                raise ValueError(f"--config {args.config!r}: file not found{configs.hint(args.config)}")
            config_sha256 = hashlib.sha256(config_file.read_bytes()).hexdigest()
            check_own("arguments after `--`", extra)
            for name, vargs in args.variant:
                check_own(f"--variant {name}", vargs)
            # seed-major: a compare stopped early (time limit) leaves whole seeds, every variant paired
            jobs = []
            for seed in args.seeds:
                for name, vargs in args.variant:
                    folder = out / "runs" / name / f"seed{seed}"
                    run_argv = trainer_argv(
                        args.config, args.steps, args.deterministic, vargs, extra, seed, folder
                    )
                    jobs.append((name, seed, run_argv, folder))
            if extra:  # the common options alone first: an error in them is not a variant's
                common = trainer_argv(
                    args.config, args.steps, args.deterministic, [], extra, args.seeds[0], out / "runs"
                )
                check_trainer_args("arguments after `--`", common, args.nproc)
            resolved = {  # each variant's options, once
                name: check_trainer_args(f"--variant {name}", run_argv, args.nproc)
                for name, _, run_argv, _ in jobs[: len(args.variant)]
            }
            check_paired_setup(resolved, args.baseline or names[0])  # not after every run has run
            grace = 0.0
            if args.time_limit_s is not None:
                grace = grace_seconds(jobs, args.grace_s)
                if grace >= args.time_limit_s:
                    raise ValueError(
                        f"--time_limit_s={args.time_limit_s}: expected more than the grace for the saves, "
                        f"{grace:.0f} s (--grace_s, or 1.5 x the longest save recorded + 10 s)"
                    )
            print(
                f"mxmoe compare: {len(jobs)} runs ({len(names)} variants x {len(args.seeds)} seeds) in {out}"
                + (f"; SIGTERM {grace:.0f} s before the time limit" if grace else "")
            )
            status = launch(
                jobs,
                args.parallel,
                args.devices,
                args.nproc,
                args.time_limit_s,
                grace,
                args.delete_finished_checkpoints,
                config_sha256,
            )
            failed = [f"{v} seed {s}: {what}" for (v, s), what in sorted(status.items()) if what != DONE]
            runs = [run_summary(n, s, f, args.tail_steps) for n, s, _, f in jobs if status[(n, s)] == DONE]
            if not runs:
                raise RuntimeError(f"no run finished: {'; '.join(failed)}")
        baseline = args.baseline or (names[0] if names else runs[0].variant)
        analyse(
            runs,
            baseline,
            out,
            args.tail_steps,
            command,
            args.smooth,
            args.smooth_steps,
            args.train_targets,
            args.val_targets,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"mxmoe compare: error: {e}{_set_aside_tables(Path(args.out))}", file=sys.stderr)
        return 2
    print((out / "compare.md").read_text())
    if failed:
        print(
            f"mxmoe compare: {len(failed)} run(s) did not finish ({'; '.join(failed)}); the tables leave "
            "them out (the same command again runs them)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
