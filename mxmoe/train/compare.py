"""`mxmoe compare`: variants x seeds of one training config, as a table and a plot in one folder.

    mxmoe compare --config moe_2b --steps 300 --seeds 0,1,2 --out runs/cmp \\
        --variant bf16 --variant "mx=--model.converters=mx" --parallel 3 \\
        -- --validation.freq=300 --validation.steps=40
    mxmoe compare --runs runs/cmp/runs --baseline bf16 --out runs/cmp2     # read finished runs

Running: one `python -m mxmoe train` subprocess per (variant, seed), `--parallel K` at a time
(several small runs share one GPU; `--devices 0,1` spreads them over GPUs by CUDA_VISIBLE_DEVICES;
`--nproc N` runs each under `torch.distributed.run` on N GPUs, e.g. for expert parallelism),
each with `--config`, then `--checkpoint.folder=` (no checkpoints: a config's checkpoint folder would
make every run resume the same one), `--debug.deterministic=true` (unless --no-deterministic),
`--training.steps`, the variant's arguments, the arguments after `--` (every run), and last the
seed and `--job.dump_folder=OUT/runs/VARIANT/seedS`. A variant is `NAME=ARGS`, ARGS the trainer
options as one shell-quoted string, or just NAME for none (repeat --variant per variant: trainer
values hold commas, as `--mx.filter_fqns=output,router`); the first is the baseline unless
--baseline names another. Each run's console goes to its folder's train.log; a run that finished
(its command.json records the same command and status 0) is not run again, so an interrupted
compare continues where it stopped; `--time-limit-s` stops the running runs (SIGTERM) and starts no
more after that many seconds, then writes the tables of the finished ones.

Reading (`--runs DIR`): DIR/VARIANT/RUN/metrics.jsonl, the seed read from RUN/config.json (the
layout the running mode writes under OUT/runs; a run whose command.json records a failure or a
stop at the time limit is left out).

Written into OUT: compare.md and compare.json (per run: final training loss = the mean training loss
per step over the last `--tail-steps` steps (default: the last 10 % of the run), final validation
loss = the last logged `val_loss`, median tokens/s; per variant: the paired difference from the
baseline, seed by seed, in % of the baseline's loss, with its mean, sample standard deviation, min
and max over the seeds) and compare.png (each variant's loss curves, mean and spread over seeds;
the differences variant - baseline per seed, in %).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from mxmoe import configs
from mxmoe.cli import comma_list, positive_int
from mxmoe.train.plot import Series, plot_series, read_metrics, recorded_seed

# trainer options compare sets itself for every run: a variant or the extra arguments may not
_OWN = ("--debug.seed", "--job.dump_folder")


@dataclass
class Run:
    """One finished run's numbers (see the module docstring for their definitions)."""

    variant: str
    seed: int
    folder: str
    last_step: int
    train_loss: float | None
    train_steps: tuple[int, int] | None  # the window (first, last] the training loss averages
    val_loss: float | None
    val_step: int | None
    tokens_per_s: float | None
    records: list[dict] = field(default_factory=list, repr=False)


def run_summary(variant: str, seed: int, folder: str | Path, tail_steps: int = 0) -> Run:
    """A run's final numbers from its metrics.jsonl (see mxmoe.train.metrics).

    Final training loss: the mean per step of the training loss over the last `tail_steps` steps
    (0: the last 10 % of the logged steps, at least the last record): records carry the mean over
    their `loss_steps` steps, so they are weighted by it, and only records wholly inside the window
    count (the last one always does). Final validation loss: the last record's with a val_loss.
    Tokens/s: the median over the records (the first, which includes compilation, left out when
    there are others)."""
    recs = read_metrics(str(folder))
    if not recs:
        raise ValueError(f"run {str(folder)!r}: metrics.jsonl has no records")
    last = recs[-1]["step"]
    window = tail_steps if tail_steps > 0 else max(1, round(last * 0.1))
    lo = last - window
    train = [r for r in recs if r.get("loss") is not None and r["step"] - r.get("loss_steps", 1) >= lo]
    if not train and recs[-1].get("loss") is not None:
        train = [recs[-1]]
    if train:
        n = sum(r.get("loss_steps", 1) for r in train)
        train_loss = sum(r["loss"] * r.get("loss_steps", 1) for r in train) / n
        first = min(r["step"] - r.get("loss_steps", 1) for r in train)
        train_steps = (first, last)
    else:  # the last record's loss was not finite
        train_loss = train_steps = None
    vals = [r for r in recs if r.get("val_loss") is not None]
    tps = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s") is not None]
    return Run(
        variant=variant,
        seed=seed,
        folder=str(folder),
        last_step=last,
        train_loss=train_loss,
        train_steps=train_steps,
        val_loss=vals[-1]["val_loss"] if vals else None,
        val_step=vals[-1]["step"] if vals else None,
        tokens_per_s=statistics.median(tps[1:] if len(tps) > 1 else tps) if tps else None,
        records=recs,
    )


def spread(values: Sequence[float]) -> dict:
    """mean, sample standard deviation (None below 2 values), min, max and n of `values`."""
    v = list(values)
    if not v:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {
        "n": len(v),
        "mean": statistics.fmean(v),
        "std": statistics.stdev(v) if len(v) > 1 else None,
        "min": min(v),
        "max": max(v),
    }


def paired_differences(runs: list[Run], baseline: str) -> dict:
    """Per variant but the baseline, per metric ("train", "val"): the difference from the baseline run
    of the same seed in % of the baseline's loss, per seed ({seed: %}), and `spread` of those; plus
    the seeds that had no baseline run (or no value) to pair with. Also each variant's mean loss."""
    by = {(r.variant, r.seed): r for r in runs}
    variants = list(dict.fromkeys(r.variant for r in runs))
    if baseline not in variants:
        raise ValueError(f"baseline={baseline!r}: no run of that variant; variants: {variants}")
    out: dict = {}
    for v in variants:
        seeds = sorted(s for (vv, s) in by if vv == v)
        entry: dict = {"seeds": seeds}
        for metric, attr in (("train", "train_loss"), ("val", "val_loss")):
            own = [getattr(by[(v, s)], attr) for s in seeds]
            m: dict = {"mean_loss": spread([x for x in own if x is not None])["mean"]}
            if v != baseline:
                per_seed, unpaired = {}, []
                for s in seeds:
                    b = by.get((baseline, s))
                    x, y = getattr(by[(v, s)], attr), getattr(b, attr) if b is not None else None
                    if x is None or y is None:
                        unpaired.append(s)
                    else:
                        per_seed[s] = (x - y) / y * 100.0
                m["diff_pct"] = {
                    "per_seed": per_seed,
                    **spread(list(per_seed.values())),
                    "unpaired": unpaired,
                }
            entry[metric] = m
        out[v] = entry
    return out


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "–" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.2f}"


def markdown(runs: list[Run], stats: dict, baseline: str, tail_steps: int, command: str | None) -> str:
    """The tables of compare.md."""
    tail = f"the last {tail_steps} steps" if tail_steps > 0 else "the last 10 % of the steps"
    lines = ["# mxmoe compare", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [
        f"Final train loss: mean training loss per step over {tail} (the window is given per run). "
        "Final validation loss: the last logged validation loss (its step is given). Differences: "
        f"(variant − {baseline}) / {baseline} of the same seed, in %; std is the sample standard "
        "deviation over seeds.",
        "",
        "## Paired difference from the baseline",
        "",
        "| variant | seeds | val Δ% mean | std | min | max | train Δ% mean | std | min | max "
        "| val Δ% per seed | train Δ% per seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, e in stats.items():
        if v == baseline:
            continue
        t, va = e["train"]["diff_pct"], e["val"]["diff_pct"]

        def per_seed(d):
            return ", ".join(f"s{s} {_pct(x)}" for s, x in d["per_seed"].items()) or "–"

        lines.append(
            f"| {v} | {va['n']} | {_pct(va['mean'])} | {_fmt(va['std'], '.2f')} | {_pct(va['min'])} | "
            f"{_pct(va['max'])} | {_pct(t['mean'])} | {_fmt(t['std'], '.2f')} | {_pct(t['min'])} | "
            f"{_pct(t['max'])} | {per_seed(va)} | {per_seed(t)} |"
        )
    lines += [
        "",
        "## Mean loss per variant",
        "",
        "| variant | seeds | final val loss (mean) | final train loss (mean) |",
        "|---|---|---|---|",
    ]
    for v, e in stats.items():
        seeds = ",".join(map(str, e["seeds"]))
        mark = " (baseline)" if v == baseline else ""
        lines.append(
            f"| {v}{mark} | {seeds} | {_fmt(e['val']['mean_loss'])} | {_fmt(e['train']['mean_loss'])} |"
        )
    lines += [
        "",
        "## Runs",
        "",
        "| variant | seed | steps | final train loss | train window | final val loss | val step "
        "| tokens/s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        window = f"{r.train_steps[0] + 1}..{r.train_steps[1]}" if r.train_steps else "–"
        lines.append(
            f"| {r.variant} | {r.seed} | {r.last_step} | {_fmt(r.train_loss)} | {window} "
            f"| {_fmt(r.val_loss)} | {r.val_step if r.val_step is not None else '–'} "
            f"| {_fmt(r.tokens_per_s, '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], baseline: str, out: Path, smooth: float = 0.0) -> Path:
    """compare.png: per variant the loss curves (mean over seeds, a band from the lowest to the
    highest seed) and the training and validation loss minus the baseline's of the same seed, in %
    (`mxmoe.train.plot.plot_series`)."""
    return plot_series([Series(r.variant, r.seed, r.records) for r in runs], out, baseline, smooth)


def analyse(
    runs: list[Run], baseline: str, out: Path, tail_steps: int, command: str | None, smooth: float
) -> dict:
    """Write compare.md, compare.json and compare.png into `out`; returns the JSON object."""
    stats = paired_differences(runs, baseline)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": command,
        "baseline": baseline,
        "train_loss": "mean training loss per step over the last "
        + (f"{tail_steps} steps" if tail_steps > 0 else "10 % of the steps"),
        "val_loss": "the last logged validation loss",
        "diff": "(variant - baseline) / baseline of the same seed, in %; std: sample standard deviation",
        "runs": [
            {
                "variant": r.variant,
                "seed": r.seed,
                "folder": r.folder,
                "last_step": r.last_step,
                "final_train_loss": r.train_loss,
                "train_window": list(r.train_steps) if r.train_steps else None,
                "final_val_loss": r.val_loss,
                "val_step": r.val_step,
                "tokens_per_s_median": r.tokens_per_s,
            }
            for r in runs
        ],
        "variants": stats,
    }
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "compare.md").write_text(markdown(runs, stats, baseline, tail_steps, command))
    try:
        plot(runs, baseline, out / "compare.png", smooth)
    except ModuleNotFoundError as e:  # the tables are the result; the picture needs an extra
        print(f"mxmoe compare: warning: no compare.png: {e}", file=sys.stderr)
    return report


def read_runs(root: str | Path, variants: Sequence[str] | None = None, tail_steps: int = 0) -> list[Run]:
    """The runs under root/VARIANT/RUN/ (metrics.jsonl, and config.json for the seed), in variant
    order (`variants`, else sorted names) and seed order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--runs {str(root)!r}: not a folder")
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    names = list(variants) if variants else found
    missing = [v for v in names if v not in found]
    if missing:
        raise FileNotFoundError(f"--runs {str(root)!r}: no folder for variant(s) {missing}; found {found}")
    runs = []
    for v in names:
        for folder in sorted(p for p in (root / v).iterdir() if (p / "metrics.jsonl").is_file()):
            if _failed(folder):
                print(
                    f"mxmoe compare: warning: {folder} did not finish (command.json): left out",
                    file=sys.stderr,
                )
                continue
            cfg = folder / "config.json"
            try:
                seed = recorded_seed(json.loads(cfg.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"run {str(folder)!r}: cannot read debug.seed from {cfg}: {e}") from None
            runs.append(run_summary(v, seed, folder, tail_steps))
    if not runs:
        raise FileNotFoundError(f"--runs {str(root)!r}: no VARIANT/RUN/metrics.jsonl under it")
    seen: dict = {}
    for r in runs:
        if (r.variant, r.seed) in seen:
            raise ValueError(
                f"variant {r.variant!r} has two runs of seed {r.seed}: "
                f"{seen[(r.variant, r.seed)]} and {r.folder}"
            )
        seen[(r.variant, r.seed)] = r.folder
    return sorted(runs, key=lambda r: (names.index(r.variant), r.seed))


def _failed(folder: Path) -> bool:
    """Whether `folder` holds the command.json of a run that `mxmoe compare` saw fail or stopped."""
    try:
        rec = json.loads((folder / "command.json").read_text())
        return rec.get("returncode") != 0 or bool(rec.get("stopped"))
    except (OSError, ValueError, AttributeError):
        return False  # no record: a run made some other way


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'NAME=ARGS' (or 'NAME': no options) -> (NAME, shlex-split ARGS); an argparse `type`."""
    name, _, args = text.partition("=")
    name = name.strip()
    if not name or name.startswith(".") or not all(c.isalnum() or c in "_-." for c in name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=ARGS, NAME of letters, digits, '_', '-', '.' (a folder name), ARGS the "
            "trainer options of the variant as one string (none: 'bf16' or 'bf16=')"
        )
    try:
        parts = shlex.split(args)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return name, parts


def _check_own(where: str, args: list[str]) -> None:
    for a in args:
        if a.split("=", 1)[0] in _OWN:
            raise ValueError(f"{where}: {a!r} is set by mxmoe compare itself (per run); remove it")


def _run_argv(cfg: str, steps: int | None, deterministic: bool, vargs, extra, seed: int, folder: Path):
    argv = [f"--config={cfg}", "--checkpoint.folder=", "--metrics.progress_bar=false"]
    if deterministic:
        argv.append("--debug.deterministic=true")
    if steps is not None:
        argv.append(f"--training.steps={steps}")
    return argv + list(vargs) + list(extra) + [f"--debug.seed={seed}", f"--job.dump_folder={folder}"]


DONE = "done"


def launch(
    jobs: list[tuple[str, int, list[str], Path]],
    parallel: int,
    devices: list[str] | None,
    nproc: int = 1,
    time_limit_s: float | None = None,
) -> dict:
    """Run `python -m mxmoe train ARGV` per job (variant, seed, argv, folder), `parallel` at a time
    (per group of `nproc` devices when `devices` are given; with nproc > 1 under
    `torch.distributed.run --standalone`); a job whose folder's command.json records the same argv
    and status 0 is skipped. After `time_limit_s` no run starts and running ones get SIGTERM (the
    trainer stops after its step; the run counts as unfinished). Returns {(variant, seed): DONE or
    what else happened}."""
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    status: dict = {}
    lock = threading.Lock()
    free = None  # device slots: CUDA_VISIBLE_DEVICES values, each `parallel` times
    if devices:
        groups = [",".join(devices[i : i + nproc]) for i in range(0, len(devices) - nproc + 1, nproc)]
        free = [g for g in groups for _ in range(parallel)]
    if nproc > 1:
        # --standalone: a free rendezvous port per run, so concurrent runs do not collide
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd += ["-m", "mxmoe", "train"]
    else:
        cmd = [sys.executable, "-m", "mxmoe", "train"]
    todo = []
    for variant, seed, argv, folder in jobs:
        done = folder / "command.json"
        try:
            prev = json.loads(done.read_text())
        except (OSError, ValueError):
            prev = None
        key = ("argv", "nproc", "returncode", "stopped")
        if prev and tuple(prev.get(k) for k in key) == (argv, nproc, 0, False):
            print(f"{variant} seed {seed}: done before ({folder}), not run again", flush=True)
            status[(variant, seed)] = DONE
        else:
            todo.append((variant, seed, argv, folder))

    def one(job) -> None:
        variant, seed, argv, folder = job
        if deadline is not None and time.monotonic() >= deadline:
            with lock:
                status[(variant, seed)] = "not started (time limit)"
            return
        env = dict(os.environ)
        device = None
        if free is not None:
            with lock:
                device = free.pop(0)
            env["CUDA_VISIBLE_DEVICES"] = device
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "command.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        stopped = False
        with open(folder / "train.log", "w") as log:
            proc = subprocess.Popen([*cmd, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = True
                proc.terminate()  # SIGTERM: the trainer finishes its step, closes its metrics, exits
                try:
                    proc.wait(120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        rc = proc.returncode
        if free is not None:
            with lock:
                free.append(device)
        secs = time.monotonic() - t0
        record = {
            "argv": argv,
            "nproc": nproc,
            "returncode": rc,
            "stopped": stopped,
            "seconds": round(secs, 1),
        }
        record["device"] = device
        (folder / "command.json").write_text(json.dumps(record, indent=2) + "\n")
        with lock:
            if stopped:
                what = "stopped at the time limit"
            else:
                what = DONE if rc == 0 else f"FAILED (exit status {rc}; see {folder / 'train.log'})"
            status[(variant, seed)] = what
            print(f"{variant} seed {seed}: {what} after {secs:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=len(free) if free else parallel) as pool:
        list(pool.map(one, todo))
    return status


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mxmoe compare",
        description=__doc__.split("\n")[0],
        epilog="Arguments after `--` go to every run's `mxmoe train`. "
        "See docs/training.md, Comparing variants.",
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
        "--time-limit-s",
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
        "--tail-steps",
        type=int,
        default=0,
        help="final train loss = mean over this many last steps (default 0: the last 10%% of the run)",
    )
    ap.add_argument(
        "--smooth", type=float, default=0.0, help="EMA smoothing of the plotted train curves, 0..1"
    )
    return ap


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
        if args.time_limit_s is not None and not args.time_limit_s > 0:
            raise ValueError(f"--time-limit-s={args.time_limit_s}: expected a number of seconds > 0")
        if args.tail_steps < 0:
            raise ValueError(f"--tail-steps={args.tail_steps}: expected >= 0 (0: the last 10 % of the run)")
        if not 0.0 <= args.smooth < 1.0:
            raise ValueError(f"--smooth={args.smooth!r}: expected 0 <= smooth < 1 (EMA factor)")
        names = [n for n, _ in args.variant]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"--variant: name(s) {dup} given twice")
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
            if args.devices and len(args.devices) < args.nproc:
                raise ValueError(
                    f"--devices={','.join(args.devices)}: {len(args.devices)} device(s), fewer than "
                    f"--nproc={args.nproc} per run"
                )
            if not configs.resolve(args.config, kind="trainer").is_file():
                raise ValueError(f"--config {args.config!r}: file not found{configs.hint(args.config)}")
            _check_own("arguments after `--`", extra)
            for name, vargs in args.variant:
                _check_own(f"--variant {name}", vargs)
            # seed-major: a compare stopped early (time limit) leaves whole seeds, every variant paired
            jobs = []
            for seed in args.seeds:
                for name, vargs in args.variant:
                    folder = out / "runs" / name / f"seed{seed}"
                    run_argv = _run_argv(
                        args.config, args.steps, args.deterministic, vargs, extra, seed, folder
                    )
                    jobs.append((name, seed, run_argv, folder))
            print(
                f"mxmoe compare: {len(jobs)} runs ({len(names)} variants x {len(args.seeds)} seeds) in {out}"
            )
            status = launch(jobs, args.parallel, args.devices, args.nproc, args.time_limit_s)
            failed = [f"{v} seed {s}: {what}" for (v, s), what in sorted(status.items()) if what != DONE]
            runs = [run_summary(n, s, f, args.tail_steps) for n, s, _, f in jobs if status[(n, s)] == DONE]
            if not runs:
                raise RuntimeError(f"no run finished: {'; '.join(failed)}")
        baseline = args.baseline or (names[0] if names else runs[0].variant)
        analyse(runs, baseline, out, args.tail_steps, command, args.smooth)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"mxmoe compare: error: {e}", file=sys.stderr)
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
