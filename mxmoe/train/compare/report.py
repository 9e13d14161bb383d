"""`mxmoe compare`'s numbers and tables: each run's final losses (`run_summary`), the paired
differences from the baseline (`paired_differences`), compare.md / compare.json / compare.png
(`analyse`), and finished runs read from their folders (`read_runs`)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mxmoe.train.compare import targets as ttt
from mxmoe.train.plot import Series, plot_series, read_config, read_metrics, recorded_seed


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
    setup: dict = field(default_factory=dict)  # `run_setup`: steps, seq_len, global batch, corpus, epochs

    @property
    def epochs(self) -> float | None:
        """How many times the run reads its train split (> 1: its data repeats); None if unrecorded."""
        return self.setup.get("epochs")


SETUP = ("steps", "seq_len", "global_batch", "corpus")
"""What paired runs must share (`check_setups`), as `run_setup` reads it."""


def run_setup(folder: str | Path, records: list[dict] | None = None) -> dict:
    """What a run was set up with, from its recorded config (`mxmoe.train.plot.read_config`: the
    config of the run that wrote `records`): training steps, seq_len, global batch, the corpus's
    identity (sha256 and source) and the epochs the run reads. What the record lacks (one written by
    an earlier mxmoe, or no config) is None; a value of the wrong type is a ValueError naming the
    folder and the key."""
    cfg = read_config(str(folder), records) or {}

    def section(name: str) -> dict:
        v = cfg.get(name) if isinstance(cfg, dict) else None
        return v if isinstance(v, dict) else {}

    t, e, c = section("training"), section("epochs"), section("corpus")
    setup = {
        "steps": t.get("steps"),
        "seq_len": t.get("seq_len"),
        "global_batch": e.get("global_batch"),
        "corpus": c.get("sha256"),
        "corpus_source": c.get("source"),
        "epochs": e.get("epochs"),
    }
    for key, types in (
        ("steps", (int,)),
        ("seq_len", (int,)),
        ("global_batch", (int,)),
        ("corpus", (str,)),
        ("corpus_source", (str,)),
        ("epochs", (int, float)),
    ):
        v = setup[key]
        if v is not None and (type(v) not in types or (key == "epochs" and not math.isfinite(v))):
            raise ValueError(
                f"run {str(folder)!r}: its recorded config has {key}={v!r}, not what the trainer records"
            )
    return setup


def run_summary(variant: str, seed: int, folder: str | Path, tail_steps: int = 0) -> Run:
    """A run's final numbers from its metrics.jsonl (see mxmoe.train.metrics).

    Final training loss: the mean per step of the training loss over the last `tail_steps` steps
    (0: the last 10 % of the logged steps, at least the last record): records carry the mean over
    their `loss_steps` steps, so they are weighted by it, and only records wholly inside the window
    count (the last one always does). Final validation loss: the last validation's (the last record
    with a val_loss; None where it was not finite, written null: never an earlier step's). Tokens/s:
    the median over the records, leaving out the first of the run and of each resume of it (a
    `run_id` of its own: their steps include start-up and compilation) when there are others."""
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
    vals = [r for r in recs if "val_loss" in r]  # a value that was not finite is null, its key kept
    tps_all = [r["tokens_per_s"] for r in recs if r.get("tokens_per_s") is not None]
    starts, tps = set(), []
    for r in recs:  # the first record of each start (its run_id) holds its compilation
        first = r.get("run_id") not in starts
        starts.add(r.get("run_id"))
        if r.get("tokens_per_s") is not None and not first:
            tps.append(r["tokens_per_s"])
    tps = tps or tps_all
    return Run(
        variant=variant,
        seed=seed,
        folder=str(folder),
        last_step=last,
        train_loss=train_loss,
        train_steps=train_steps,
        val_loss=vals[-1]["val_loss"] if vals else None,
        val_step=vals[-1]["step"] if vals else None,
        tokens_per_s=statistics.median(tps) if tps else None,
        records=recs,
        setup=run_setup(folder, recs),
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
                    elif y == 0:
                        raise ValueError(
                            f"baseline run {b.folder!r}: final {metric} loss 0: a difference in % of it is "
                            "undefined"
                        )
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


def check_setups(runs: list[Run], baseline: str) -> None:
    """ValueError naming each run and the baseline run of its seed when they differ in what a paired
    difference needs them to share: training steps, the last logged step, seq_len, global batch and
    corpus (runs on different data are never paired). A value one record lacks (an earlier mxmoe's
    config.json) is not compared; such runs are listed on stderr."""
    base = {r.seed: r for r in runs if r.variant == baseline}
    problems = []
    for r in runs:
        b = base.get(r.seed)
        if r.variant == baseline or b is None:
            continue
        pairs = [("last logged step", r.last_step, b.last_step)]
        pairs += [(f"training.{k}" if k in ("steps", "seq_len") else k, r.setup.get(k), b.setup.get(k))
                  for k in SETUP]
        diffs = [f"{k} {x!r} vs {y!r}" for k, x, y in pairs if x is not None and y is not None and x != y]
        if diffs:
            problems.append(f"{r.folder} vs its baseline {b.folder}: {', '.join(diffs)}")
    if problems:
        raise ValueError(
            f"runs of different setups cannot be paired: {'; '.join(problems)}. A paired difference needs "
            "runs of the same steps, sequence length, global batch and corpus"
        )
    unknown = [r.folder for r in runs if r.setup.get("corpus") is None]
    if unknown:
        print(
            f"mxmoe compare: warning: {len(unknown)} run(s) record no corpus (config.json of an earlier "
            f"mxmoe), their data cannot be checked: {', '.join(unknown)}",
            file=sys.stderr,
        )


def repeating(runs: list[Run]) -> list[Run]:
    """The runs that read their training data more than once (epochs > 1)."""
    return [r for r in runs if r.epochs is not None and r.epochs > 1]


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "–" if x is None or not math.isfinite(x) else format(x, spec)


def _pct(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:+.2f}"


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
    ]
    rep = repeating(runs)
    if rep:
        lines += [
            f"**Data repeats**: {len(rep)} of {len(runs)} runs read their training data more than once "
            f"(up to {max(r.epochs for r in rep):.2f} epochs): past the first epoch their losses measure "
            "memorization too. A larger corpus (`--data.path=python-env`, or a folder) keeps a run to one "
            "epoch.",
            "",
        ]
    lines += [
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
        own = [r for r in runs if r.variant == v]
        cells = []
        for metric, attr in (("val", "val_loss"), ("train", "train_loss")):
            n = sum(getattr(r, attr) is not None for r in own)  # fewer than the seeds: says how many
            fewer = f" ({n} of {len(own)} runs)" if n < len(own) else ""
            cells.append(_fmt(e[metric]["mean_loss"]) + fewer)
        lines.append(f"| {v}{mark} | {seeds} | {cells[0]} | {cells[1]} |")
    lines += [
        "",
        "## Runs",
        "",
        "| variant | seed | steps | epochs | final train loss | train window | final val loss | val step "
        "| tokens/s (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        window = f"{r.train_steps[0] + 1}..{r.train_steps[1]}" if r.train_steps else "–"
        epochs = _fmt(r.epochs, ".2f") + (" (repeats)" if any(r is x for x in rep) else "")
        lines.append(
            f"| {r.variant} | {r.seed} | {r.last_step} | {epochs} | {_fmt(r.train_loss)} | {window} "
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
    runs: list[Run],
    baseline: str,
    out: Path,
    tail_steps: int,
    command: str | None,
    smooth: float,
    smooth_steps: int = 50,
    train_targets: Sequence[float] | None = None,
    val_targets: Sequence[float] | None = None,
) -> dict:
    """Write compare.md, compare.json and compare.png into `out`; returns the JSON object.
    ValueError (nothing written) when paired runs differ in their setup (`check_setups`).
    smooth_steps, train_targets, val_targets: the time-to-target section (`targets.time_to_target`)."""
    check_setups(runs, baseline)
    stats = paired_differences(runs, baseline)
    tt = ttt.time_to_target(runs, baseline, smooth_steps, train_targets, val_targets)
    rep = repeating(runs)
    if rep:
        print(
            f"mxmoe compare: warning: {len(rep)} run(s) read their training data more than once (epochs > 1; "
            f"see compare.md): {', '.join(r.folder for r in rep)}",
            file=sys.stderr,
        )
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
                "epochs": r.epochs,
                "corpus": r.setup.get("corpus"),
            }
            for r in runs
        ],
        "repeats_data": [r.folder for r in rep],
        "variants": stats,
        "time_to_target": tt,
    }
    (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "compare.md").write_text(
        markdown(runs, stats, baseline, tail_steps, command) + ttt.markdown(tt, baseline)
    )
    try:
        plot(runs, baseline, out / "compare.png", smooth)
    except ModuleNotFoundError as e:  # the tables are the result; the picture needs an extra
        print(f"mxmoe compare: warning: no compare.png: {e}", file=sys.stderr)
    return report


def read_runs(root: str | Path, variants: Sequence[str] | None = None, tail_steps: int = 0) -> list[Run]:
    """The runs under root/VARIANT/RUN/ (metrics.jsonl, and config.json for the seed), in variant
    order (`variants`, else sorted names) and seed order. A run that did not finish (its command.json
    says so, or its records end before its recorded training.steps) is left out, with a warning."""
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
        for folder in sorted(p for p in (root / v).iterdir() if p.is_dir()):
            if run_failed(folder):
                print(
                    f"mxmoe compare: warning: {folder} did not finish (command.json): left out",
                    file=sys.stderr,
                )
                continue
            if not (folder / "metrics.jsonl").is_file():
                raise FileNotFoundError(
                    f"--runs {str(root)!r}: run folder {str(folder)!r} has no metrics.jsonl: expected "
                    "VARIANT/RUN/metrics.jsonl in every run folder (remove the folder, or name the variants "
                    "to read with --variant)"
                )
            recs = read_metrics(str(folder))
            cfg = read_config(str(folder), recs)
            try:
                if cfg is None:
                    raise ValueError("no config.json")
                seed = recorded_seed(cfg)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"run {str(folder)!r}: cannot read debug.seed from its recorded config: {e}"
                ) from None
            run = run_summary(v, seed, folder, tail_steps)
            steps = run.setup.get("steps")
            if steps is not None and run.last_step < steps:  # stopped, and no command.json says so
                print(
                    f"mxmoe compare: warning: {folder} did not finish (its last logged step is "
                    f"{run.last_step} of training.steps={steps}): left out",
                    file=sys.stderr,
                )
                continue
            runs.append(run)
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


def run_failed(folder: Path) -> bool:
    """Whether `folder` holds the command.json of a run that `mxmoe compare` saw fail or stopped."""
    try:
        rec = json.loads((folder / "command.json").read_text())
        return rec.get("returncode") != 0 or bool(rec.get("stopped"))
    except (OSError, ValueError, AttributeError):
        return False  # no record: a run made some other way
