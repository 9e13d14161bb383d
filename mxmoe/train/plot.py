"""`mxmoe plot`: loss curves of runs (e.g. bf16 vs MXFP8, several seeds) from their metrics, to a PNG.

    mxmoe plot runs/bf16/seed0 runs/mx/seed0 --out loss.png
    mxmoe plot runs/*/seed* --out loss.png --baseline bf16 [--smooth 0.9]

Each RUN is a run folder (job.dump_folder: metrics.jsonl, config.json) or a .jsonl file. Each run
is named by its variant and seed, read from its config.json: the variant is what its config sets
apart from the other runs' (e.g. "mx" and "bf16" for runs that differ in model.converters, or
"recipe_name=mxfp8"), the seed is debug.seed; `--labels` names the variants instead. Runs of one
variant are drawn as one curve, their mean over seeds, with a band from the lowest to the highest
seed. With two or more variants, a second panel shows each variant's training loss minus the
baseline's (the first variant unless `--baseline`) in % of the baseline's, seed by seed (thin) and
their mean (thick), and the same for the validation loss (markers).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from mxmoe.cli import ArgumentParser

NUMBERS = ("loss", "aux_loss", "val_loss", "tokens_per_s", "memory_gib", "lr", "grad_norm")
"""Record fields that are a finite number or null (a value that was not finite: see mxmoe.train.metrics)."""
COUNTS = ("loss_steps", "val_tokens")
"""Record fields that are, when present, an int >= 1."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number metrics.jsonl holds (a value that is not finite is null)")


def check_record(rec, where: str) -> None:
    """ValueError naming `where` (file:line), the field and its value unless `rec` is a record as
    the trainer writes it: an object with an int step >= 0, NUMBERS finite or null, COUNTS ints >= 1."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    step = rec.get("step")
    if type(step) is not int or step < 0:
        raise ValueError(f"{where}: step={step!r}: expected an int >= 0")
    for k in NUMBERS:
        v = rec.get(k)
        if v is not None and (type(v) not in (int, float) or not math.isfinite(v)):
            raise ValueError(f"{where} (step {step}): {k}={v!r}: expected a finite number or null")
    for k in COUNTS:
        v = rec.get(k, 1)
        if type(v) is not int or v < 1:
            raise ValueError(f"{where} (step {step}): {k}={v!r}: expected an int >= 1")


# per-run keys a comparison never varies by: where a run writes, which seed it has, how it logs
_NOT_A_VARIANT = {
    "job.dump_folder",
    "metrics.folder",
    "debug.seed",
    "training.seed",
    "checkpoint.folder",
    "metrics.progress_bar",
    "metrics.log_freq",
}
# what the trainer records beside the config (the corpus's identity, the data the run reads): it
# follows from the config's keys (data.*, training.steps, ...), which name the variant instead
_RECORDED = {"corpus", "epochs"}


@dataclass
class Series:
    """One run in a figure: its variant's name, its seed (None: unknown) and its metrics records."""

    variant: str
    seed: int | None
    records: list[dict]


def read_metrics(run: str) -> list[dict]:
    """The records of a run folder's metrics.jsonl (or of a .jsonl file), each checked
    (`check_record`): ValueError naming the file, line and field of the first bad one."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"run {run!r}: no metrics file at {str(path)!r}")
    out = []
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start}); expected the trainer's "
                    "JSON records, one a line"
                ) from None
            if line.strip():
                try:
                    rec = json.loads(line, parse_constant=_no_constant)
                except ValueError as e:  # JSONDecodeError, or NaN / Infinity
                    raise ValueError(f"{path}:{n}: not a metrics record: {e}") from None
                check_record(rec, f"{path}:{n}")
                out.append(rec)
    # A resumed run appends to the same file and logs some steps again: the last record of a step
    # (the one the surviving run wrote) wins, in step order.
    by_step = {r["step"]: r for r in out if "step" in r}
    return [by_step[k] for k in sorted(by_step)]


def _load_config(path: Path) -> dict | None:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def read_config(run: str, records: list[dict] | None = None) -> dict | None:
    """A run's recorded config, beside its metrics: the config of the run that wrote the last of
    `records` (its run_id: config.json when it is that run's, else config.<run_id>.json, which a
    later run in the folder writes), config.json for records without a run_id; None if there is
    no config. ValueError naming the files when the folder holds configs but none of that run (a
    retrained run would otherwise be paired and named by another run's seed and data)."""
    path = Path(run)
    folder = path if path.is_dir() else path.parent
    first = _load_config(folder / "config.json")
    run_id = records[-1].get("run_id") if records else None
    if not isinstance(run_id, str):
        return first
    own = _load_config(folder / f"config.{run_id}.json")
    if own is not None:
        return own
    if first is None or first.get("run_id") in (run_id, None):
        return first
    raise ValueError(
        f"run {run!r}: its records were written by run {run_id}, but {folder / 'config.json'} is run "
        f"{first.get('run_id')}'s and there is no {folder / f'config.{run_id}.json'}: the run's config "
        "is missing"
    )


def recorded_seed(config: dict) -> int:
    """The seed of a run from its recorded config.json (runs recorded before debug.seed hold it as
    training.seed); ValueError naming the key unless it is an int."""
    name = "debug" if "debug" in config else "training"
    seed = config[name]["seed"]
    if type(seed) is not int:
        raise ValueError(f"{name}.seed={seed!r}, expected an int")
    return seed


def _flat(config: dict) -> dict[str, str]:
    return {
        f"{sec}.{k}": json.dumps(v, sort_keys=True)
        for sec, body in config.items()
        if isinstance(body, dict) and sec not in _RECORDED
        for k, v in body.items()
    }


def _precision(config: dict) -> str:
    """"mx" for a run with the mx converter, else its compute dtype (bf16, fp32 or tf32)."""
    if any(c in ("mx", "mxmoe") for c in config.get("model", {}).get("converters", [])):
        return "mx"
    return str(config.get("training", {}).get("mixed_precision", "bf16"))


def variant_names(configs: list[dict | None], fallback: list[str]) -> list[str]:
    """Each run's variant name from its recorded config: "mx" or the compute dtype where the runs
    differ in that, then `key=value` of every other key they differ in (seeds, folders, logging, and
    [mx] for a run without the converter aside); runs whose configs differ in nothing else share a
    name. A run without a config is
    named by `fallback`."""
    known = [c for c in configs if c is not None]
    flats = [_flat(c) for c in known]
    keys = sorted(k for k in set().union(*flats) if len({f.get(k) for f in flats}) > 1) if flats else []
    keys = [k for k in keys if k not in _NOT_A_VARIANT]
    split_by_precision = len({_precision(c) for c in known}) > 1
    names = []
    for config, name in zip(configs, fallback, strict=True):
        if config is None:
            names.append(name)
            continue
        parts = [_precision(config)] if split_by_precision or not keys else []
        flat = _flat(config)
        for k in keys:
            if k in ("model.converters", "training.mixed_precision") and split_by_precision:
                continue
            if k.startswith("mx.") and _precision(config) != "mx":  # options of a converter not used
                continue
            value = json.loads(flat[k]) if k in flat else None
            value = ",".join(map(str, value)) if isinstance(value, list) else value
            parts.append(f"{k.rpartition('.')[2]}={value}")
        names.append(" ".join(parts))
    return names


def ema(values: list[float], beta: float) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def pyplot():
    """matplotlib.pyplot on the Agg (file-only) backend; ModuleNotFoundError naming the extra if
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise ModuleNotFoundError(
            "plotting needs matplotlib, which is not installed: `pip install 'mxmoe[plot]'`"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curve(recs: list[dict], key: str = "loss", smooth: float = 0.0) -> dict[int, float]:
    """{step: value} of `key` over a run's records, EMA-smoothed by `smooth`; a non-finite value,
    written as null (see mxmoe.train.metrics), is left out."""
    c = {r["step"]: r[key] for r in recs if r.get(key) is not None}
    return dict(zip(c, ema(list(c.values()), smooth), strict=True)) if smooth else c


def _band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the curves at the steps they all have."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    vals = [[c[s] for c in curves] for s in steps]
    return steps, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def _seeds(series: list[Series]) -> str:
    seeds = [s.seed for s in series if s.seed is not None]
    if len(series) == 1:
        return f"seed {seeds[0]}" if seeds else "1 run"
    return f"mean of {len(series)} seeds" + (f" ({','.join(map(str, seeds))})" if seeds else "")


def loss_panel(ax, groups: dict[str, list[Series]], colors: dict[str, str], smooth: float) -> None:
    """Per variant: the training loss (mean over its seeds, a band from min to max) and the
    validation loss (mean over seeds, markers)."""
    for variant, series in groups.items():
        steps, mean, lo, hi = _band([curve(s.records, smooth=smooth) for s in series])
        label = f"{variant}: train, {_seeds(series)}"
        ax.plot(steps, mean, color=colors[variant], lw=1.5, label=label)
        if len(series) > 1:
            ax.fill_between(steps, lo, hi, color=colors[variant], alpha=0.15, lw=0)
        vsteps, vmean, _, _ = _band([curve(s.records, "val_loss") for s in series])
        if vsteps:
            ax.plot(vsteps, vmean, "o", color=colors[variant], ms=5, mfc="white", label=f"{variant}: val")
    _zoom_past_warmup(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    band = "; band: lowest to highest seed" if any(len(s) > 1 for s in groups.values()) else ""
    ax.set_title(f"loss (y axis from 5 % of the steps{band})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _zoom_past_warmup(ax, skip: float = 0.05) -> None:
    """The y range of what the axes hold after the first `skip` of the steps: the first steps' loss,
    several times the final one, would squeeze the rest of the curves into a few pixels."""
    ys = []
    for line in ax.get_lines():
        x, y = line.get_xdata(), line.get_ydata()
        if len(x):
            cut = min(x) + skip * (max(x) - min(x))
            ys += [v for s, v in zip(x, y, strict=True) if s >= cut]
    for coll in ax.collections:  # the bands
        for path in coll.get_paths():
            verts = path.vertices
            if len(verts):
                cut = verts[:, 0].min() + skip * (verts[:, 0].max() - verts[:, 0].min())
                ys += list(verts[verts[:, 0] >= cut, 1])
    if ys:
        lo, hi = min(ys), max(ys)
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 1.0
        ax.set_ylim(lo - pad, hi + pad)


def _pairs(series: list[Series], base: list[Series]) -> tuple[list[tuple[Series, Series]], bool]:
    """(run, its baseline run) pairs: by seed; or, with one baseline run, every run against it.
    The flag says whether the pairs are by seed."""
    by_seed = {b.seed: b for b in base if b.seed is not None}
    paired = [(s, by_seed[s.seed]) for s in series if s.seed in by_seed]
    if paired:
        return paired, True
    return ([(s, base[0]) for s in series] if len(base) == 1 else []), False


def _relative(run: dict[int, float], base: dict[int, float]) -> dict[int, float]:
    return {k: (run[k] - base[k]) / base[k] * 100 for k in sorted(set(run) & set(base)) if base[k]}


def difference_panel(
    ax, groups: dict[str, list[Series]], baseline: str, colors: dict[str, str], smooth: float
) -> None:
    """Per variant but the baseline: its training loss minus the baseline's of the same seed, in %
    of the baseline's (thin: each seed; thick: their mean), and the validation loss's (markers)."""
    per_seed = True
    for variant, series in groups.items():
        if variant == baseline:
            continue
        pairs, by_seed = _pairs(series, groups[baseline])
        per_seed &= by_seed
        diffs = [
            _relative(curve(s.records, smooth=smooth), curve(b.records, smooth=smooth))
            for s, b in pairs
        ]
        if not diffs:
            continue
        if len(diffs) > 1:
            for d in diffs:
                ax.plot(list(d), list(d.values()), color=colors[variant], lw=0.7, alpha=0.45)
        steps, mean, _, _ = _band(diffs)
        what = _seeds([s for s, _ in pairs]) if len(diffs) > 1 else _seeds(pairs[0][:1])
        ax.plot(steps, mean, color=colors[variant], lw=2, label=f"{variant} − {baseline}: train, {what}")
        vdiffs = [_relative(curve(s.records, "val_loss"), curve(b.records, "val_loss")) for s, b in pairs]
        vsteps, vmean, _, _ = _band([d for d in vdiffs if d])
        if vsteps:
            label = f"{variant} − {baseline}: val"
            ax.plot(vsteps, vmean, "o", color=colors[variant], ms=6, mfc="white", label=label)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss difference, % of {baseline}")
    others = [v for v in groups if v != baseline]
    what = others[0] if len(others) == 1 else "variant"
    thin = any(len(s) > 1 for v, s in groups.items() if v != baseline)
    per = (", per seed" + (" (thin) and their mean (thick)" if thin else "")) if per_seed else ""
    ax.set_title(f"{what} − {baseline}{per}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def check_image_suffix(out: str, option: str = "--out") -> None:
    """ValueError naming `option` unless `out` ends in an image format matplotlib writes (none:
    its default, PNG), checked before any run is read."""
    suffix = Path(out).suffix.lower().lstrip(".")
    from matplotlib.figure import Figure

    formats = sorted(Figure().canvas.get_supported_filetypes())
    if suffix and suffix not in formats:
        raise ValueError(
            f"{option} {out!r}: expected a file name ending in an image format, one of {formats}"
        )


def save_figure(fig, out: str | Path) -> Path:
    """Write `fig` to the PNG `out` (parent folders created) and close it; returns the path. A name
    without a suffix is written as PNG under that very name (matplotlib would add ".png")."""
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120, format=None if out_path.suffix else "png")
    fig.clf()
    pyplot().close(fig)
    return out_path


def plot_series(
    series: list[Series], out: str | Path, baseline: str | None = None, smooth: float = 0.0
) -> Path:
    """`figure(series, baseline, smooth)` written to the PNG `out`; returns its path."""
    return save_figure(figure(series, baseline, smooth), out)


def figure(series: list[Series], baseline: str | None = None, smooth: float = 0.0):
    """A matplotlib Figure: the loss panel and, with two or more variants, the difference panel of
    `series`; `baseline`: the variant the others are compared with (default: the first)."""
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth!r}: expected 0 <= smooth < 1 (EMA factor)")
    groups: dict[str, list[Series]] = {}
    for s in series:
        groups.setdefault(s.variant, []).append(s)
    baseline = baseline if baseline is not None else series[0].variant
    if baseline not in groups:
        raise ValueError(f"baseline={baseline!r}: no run of that variant; variants: {list(groups)}")
    groups = {baseline: groups.pop(baseline), **groups}
    for g in groups.values():
        g.sort(key=lambda s: (s.seed is None, s.seed))
    colors = {v: f"C{i % 10}" for i, v in enumerate(groups)}
    plt = pyplot()
    ncols = 2 if len(groups) > 1 else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5), squeeze=False)
    loss_panel(axes[0][0], groups, colors, smooth)
    if ncols == 2:
        difference_panel(axes[0][1], groups, baseline, colors, smooth)
    return fig


def _fallback_name(run: str) -> str:
    """A run's name from its path: the folder's (its parent's for a seedN folder), or the file's stem
    (a run folder's own metrics.jsonl: the folder's name, as if the folder were given: every such file
    is called "metrics", and runs of one name are drawn as seeds of one variant)."""
    p = Path(run)
    if not p.is_dir():
        if p.name != "metrics.jsonl":
            return p.stem
        p = p.resolve().parent
    return p.resolve().parent.name if re.fullmatch(r"seed\d+", p.name) else p.name


def plot_runs(
    runs: list[str],
    out: str,
    labels: list[str] | None = None,
    smooth: float = 0.0,
    baseline: str | None = None,
) -> Path:
    """Draw the runs' loss curves into the PNG `out` (module docstring); returns its path."""
    if not runs:
        raise ValueError("runs is empty: give at least one run folder or metrics.jsonl")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"labels has {len(labels)} names for {len(runs)} runs")
    if labels is not None and "" in labels:
        where = labels.index("") + 1
        raise ValueError(f"labels={','.join(labels)!r}: name {where} is empty; give every run a name")
    data = [read_metrics(r) for r in runs]
    for run, recs in zip(runs, data, strict=True):
        if not recs:
            raise ValueError(f"run {run!r}: its metrics file has no records: nothing to plot")
        if all(r.get("loss") is None and r.get("val_loss") is None for r in recs):
            raise ValueError(
                f"run {run!r}: none of its {len(recs)} records has a loss or val_loss (a value that was "
                "not finite is null): nothing to plot"
            )
    configs = [read_config(r, d) for r, d in zip(runs, data, strict=True)]
    names = labels or variant_names(configs, [_fallback_name(r) for r in runs])
    seeds = [recorded_seed(c) if c is not None else None for c in configs]
    seen: dict = {}
    for run, name, seed in zip(runs, names, seeds, strict=True):
        if seed is not None and (name, seed) in seen:
            fix = (  # given labels name the variants: these two got the same one
                f"--labels={','.join(labels)} names both {name!r}: give them different labels"
                if labels
                else "give --labels to tell them apart"
            )
            raise ValueError(
                f"runs {seen[(name, seed)]!r} and {run!r} are both variant {name!r}, seed {seed}: {fix}"
            )
        seen[(name, seed)] = run
    series = [Series(n, s, d) for n, s, d in zip(names, seeds, data, strict=True)]
    return plot_series(series, out, baseline, smooth)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="mxmoe plot", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (metrics.jsonl, config.json) or .jsonl files")
    ap.add_argument("--out", default="loss.png", help="output PNG path (default loss.png)")
    ap.add_argument(
        "--labels", default="", help="comma-separated variant names, one per run (default: from the configs)"
    )
    ap.add_argument("--baseline", help="the variant the others are compared with (default: the first)")
    ap.add_argument("--smooth", type=float, default=0.0, help="EMA smoothing of the train loss, 0..1")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        from mxmoe.cli import check_out_file

        check_out_file(args.out)
        check_image_suffix(args.out)
        path = plot_runs(args.runs, args.out, labels, args.smooth, args.baseline)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:
        print(f"mxmoe plot: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
