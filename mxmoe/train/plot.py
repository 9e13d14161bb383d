"""`mxmoe plot`: loss curves of several runs (e.g. bf16 vs MXFP8) from their metrics.jsonl, to a PNG.

    mxmoe plot runs/bf16 runs/mxfp8 runs/mxfp8_rceil --out runs/loss.png [--labels a,b,c] [--smooth 0.9]

Each RUN is a metrics folder (holding metrics.jsonl) or a .jsonl file. Training loss (solid) and,
where logged, validation loss (markers) are drawn against the step. With two or more runs a second
panel shows each run's loss minus the first run's at common steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run: str) -> list[dict]:
    """The records of a run folder's metrics.jsonl (or of a .jsonl file)."""
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
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    # A resumed run appends to the same file and logs some steps again: the last record of a step
    # (the one the surviving run wrote) wins, in step order.
    by_step = {r["step"]: r for r in out if "step" in r}
    return [by_step[k] for k in sorted(by_step)]


def _ema(values: list[float], beta: float) -> list[float]:
    out, m = [], None
    for v in values:
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def plot_runs(runs: list[str], out: str, labels: list[str] | None = None, smooth: float = 0.0) -> Path:
    """Draw the runs' loss curves into the PNG `out`; returns its path."""
    try:
        import matplotlib
    except ImportError:
        raise ModuleNotFoundError(
            "plotting needs matplotlib, which is not installed: `pip install 'mxmoe[plot]'`"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax = axes[0][0]
    curves = []
    for recs, label in zip(data, labels, strict=True):
        # a non-finite value is written as null (see mxmoe.train.metrics): not drawn
        tr = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
        va = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        steps, loss = [s for s, _ in tr], [v for _, v in tr]
        curves.append(dict(zip(steps, loss, strict=True)))
        (line,) = ax.plot(steps, _ema(loss, smooth) if smooth else loss, label=f"{label} train")
        if va:
            ax.plot(
                [s for s, _ in va],
                [v for _, v in va],
                "o--",
                color=line.get_color(),
                ms=4,
                label=f"{label} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if ncols == 2:
        ax2 = axes[0][1]
        base = curves[0]
        for curve, label in zip(curves[1:], labels[1:], strict=True):
            common = sorted(set(base) & set(curve))
            ax2.plot(common, [curve[s] - base[s] for s in common], label=f"{label} − {labels[0]}")
        ax2.axhline(0.0, color="k", lw=0.8)
        ax2.set_xlabel("step")
        ax2.set_ylabel("loss difference")
        ax2.set_title(f"train loss minus {labels[0]}")
        ax2.grid(alpha=0.3)
        ax2.legend()
    fig.tight_layout()
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


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
