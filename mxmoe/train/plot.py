"""`mxmoe plot`: loss curves of several runs (e.g. bf16 vs MXFP8) from their metrics.jsonl, to a PNG.

    mxmoe plot runs/bf16 runs/mxfp8 runs/mxfp8_rceil --out runs/loss.png [--labels a,b,c] [--smooth 0.9]

Each RUN is a metrics folder (holding metrics.jsonl) or a .jsonl file. Training loss (solid) and,
where logged, validation loss (markers) are drawn against the step. With two or more runs a second
panel shows each run's loss minus the first run's at common steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

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


def read_metrics(run: str) -> list[dict]:
    """The records of a run folder's metrics.jsonl (or of a .jsonl file), each checked
    (`check_record`): ValueError naming the file, line and field of the first bad one."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"run {run!r}: no metrics file at {str(path)!r}")
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
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


def curve(recs: list[dict], key: str = "loss") -> dict[int, float]:
    """{step: value} of `key` over a run's records; a non-finite value, written as null (see
    mxmoe.train.metrics), is left out."""
    return {r["step"]: r[key] for r in recs if r.get(key) is not None}


def loss_panel(ax, data: list[list[dict]], labels: list[str], smooth: float = 0.0, styles=None) -> None:
    """Each run's training loss (a line, EMA-smoothed by `smooth`) and validation loss (markers, same
    color) against the step. styles: per run a dict of line keyword arguments (color, linestyle)."""
    for i, (recs, label) in enumerate(zip(data, labels, strict=True)):
        tr, va = curve(recs, "loss"), curve(recs, "val_loss")
        loss = list(tr.values())
        kw = styles[i] if styles else {}
        (line,) = ax.plot(list(tr), ema(loss, smooth) if smooth else loss, label=f"{label} train", **kw)
        if va:
            ax.plot(list(va), list(va.values()), "o--", color=line.get_color(), ms=4, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def difference_panel(
    ax,
    pairs: list[tuple[dict[int, float], dict[int, float], str]],
    title: str,
    relative: bool = False,
    styles=None,
    fmt: str = "",
) -> None:
    """For each (base, other, label): other - base at their common steps (in % of base when
    `relative`), drawn with `fmt` and the pair's entry of `styles`; a zero line."""
    for i, (base, other, label) in enumerate(pairs):
        common = sorted(set(base) & set(other))
        diff = [(other[s] - base[s]) / base[s] * 100 if relative else other[s] - base[s] for s in common]
        fmt_arg = (fmt,) if fmt else ()  # no format string: the styles' linestyle decides
        ax.plot(common, diff, *fmt_arg, label=label, **(styles[i] if styles else {}))
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss difference" + (" (% of baseline)" if relative else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def save_figure(fig, out: str | Path) -> Path:
    """Write `fig` to the PNG `out` (parent folders created) and close it; returns the path."""
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    fig.clf()
    pyplot().close(fig)
    return out_path


def plot_runs(runs: list[str], out: str, labels: list[str] | None = None, smooth: float = 0.0) -> Path:
    """Draw the runs' loss curves into the PNG `out`; returns its path."""
    plt = pyplot()
    if not runs:
        raise ValueError("runs is empty: give at least one run folder or metrics.jsonl")
    labels = labels or [Path(r).name if Path(r).is_dir() else Path(r).stem for r in runs]
    if len(labels) != len(runs):
        raise ValueError(f"labels has {len(labels)} names for {len(runs)} runs")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth!r}: expected 0 <= smooth < 1 (EMA factor)")
    data = [read_metrics(r) for r in runs]
    ncols = 2 if len(runs) > 1 else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.5), squeeze=False)
    loss_panel(axes[0][0], data, labels, smooth)
    if ncols == 2:
        base = curve(data[0])
        pairs = [
            (base, curve(d), f"{label} − {labels[0]}") for d, label in zip(data[1:], labels[1:], strict=True)
        ]
        difference_panel(axes[0][1], pairs, f"train loss minus {labels[0]}")
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mxmoe plot", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="metrics folders (with metrics.jsonl) or .jsonl files")
    ap.add_argument("--out", default="loss.png", help="output PNG path (default loss.png)")
    ap.add_argument("--labels", default="", help="comma-separated legend names, one per run")
    ap.add_argument("--smooth", type=float, default=0.0, help="EMA smoothing of the train loss, 0..1")
    args = ap.parse_args(argv)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        path = plot_runs(args.runs, args.out, labels, args.smooth)
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as e:
        print(f"mxmoe plot: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
