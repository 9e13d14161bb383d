"""Loss and tokens/s of torchtitan trainer runs, from their logs (scripts/torchtitan_h200.sh).

`python scripts/torchtitan_summary.py OUT_DIR RUN [RUN ...]` reads OUT_DIR/RUN.log for each run
(torchtitan's step lines: "step: 10  loss:  7.1234  grad_norm: ... tps: 12,345 ..."), writes
OUT_DIR/RUN.csv (step, loss, grad_norm, tps) and OUT_DIR/summary.md, a table: steps logged, first
and last loss, mean loss of the last 5 logged steps and its difference from the first run's,
median tokens/s per GPU over the logged steps after the first (the first holds warm-up), and the
ratio to the first run's. A run that stopped early shows the steps it logged. When the first run
logged no step, no run has a ratio (not one to the next run's, under the first run's name).

Runs named VARIANT_sSEED or VARIANT_sSEED_rR (scripts/torchtitan_h200.sh; R a repeat) are also
summarized per variant: the mean and standard deviation over its runs of the tail loss and of the
median tokens/s, and their ratios to the first variant's means; and the median over its runs of
the median tokens/s, with its ratio to the first variant's (the speed figure where runs repeat: one
slow run moves it least). Runs that did not reach the last step of the longest run are left out;
when no run of the first variant (the first run's) is left, no variant has a ratio.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NUM = r"([-+0-9.eE]+|nan|inf)"
STEP = re.compile(rf"step:\s*(\d+)\s+loss:\s*{NUM}\s+grad_norm:\s*{NUM}.*?tps:\s*([\d,]+)")


def parse(log: Path) -> list[tuple[int, float, float, int]]:
    """(step, loss, grad_norm, tps) of every step line of `log` (empty when there is none)."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        m = STEP.search(ANSI.sub("", line))
        if m:
            rows.append((int(m[1]), float(m[2]), float(m[3]), int(m[4].replace(",", ""))))
    return rows


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(f"usage: {Path(__file__).name} OUT_DIR RUN [RUN ...]")
    out, runs = Path(argv[0]), argv[1:]
    lines = [
        "| run | steps logged | first loss | last loss | mean loss, last 5 logs | vs first run | "
        "median tokens/s | vs first run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_loss = base_tps = None
    done: dict[str, tuple[int, float, float]] = {}  # run -> (last step, tail loss, tps)
    for k, run in enumerate(runs):
        log = out / f"{run}.log"
        rows = parse(log) if log.exists() else []
        with open(out / f"{run}.csv", "w") as f:
            f.write("step,loss,grad_norm,tps\n")
            f.writelines(f"{s},{loss},{g},{t}\n" for s, loss, g, t in rows)
        if not rows:
            lines.append(f"| {run} | 0 (see {run}.log) | | | | | | |")
            continue
        tail = statistics.fmean(r[1] for r in rows[-5:])
        tps = statistics.median(r[3] for r in rows[1:]) if len(rows) > 1 else rows[0][3]
        done[run] = (rows[-1][0], tail, tps)
        if k == 0:  # the first run named is the baseline, or there is none
            base_loss, base_tps = tail, tps
        vs_loss = "" if base_loss is None else f"{100 * (tail / base_loss - 1):+.2f} %"
        vs_tps = "" if base_tps is None else f"{tps / base_tps:.3f}x"
        lines.append(
            f"| {run} | {rows[-1][0]} | {rows[0][1]:.4f} | {rows[-1][1]:.4f} | {tail:.4f} | "
            f"{vs_loss} | {tps:,.0f} | {vs_tps} |"
        )
    if base_loss is None and done:
        lines += ["", f"The first run, {runs[0]}, logged no step: no ratios."]
    first = SEEDED.match(runs[0])
    lines += per_variant(done, first[1] if first else None)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


SEEDED = re.compile(r"^(.+)_s(\d+)(?:_r(\d+))?$")


def per_variant(done: dict[str, tuple[int, float, float]], first: str | None = None) -> list[str]:
    """The per-variant table's lines (none when no run is named VARIANT_sSEED); the ratios are to
    variant `first`'s means (default: the first variant in `done`), none when it has no run here."""
    if not done:
        return []
    last = max(step for step, _, _ in done.values())
    groups: dict[str, list[tuple[float, float]]] = {}
    for run, (step, tail, tps) in done.items():
        m = SEEDED.match(run)
        if m and step == last:
            groups.setdefault(m[1], []).append((tail, tps))
    if not groups:
        return []

    def mean_std(xs: list[float]) -> tuple[float, float]:
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    out = [
        "",
        f"Per variant, runs that reached step {last}: mean ± standard deviation over the runs, and the "
        "median over the runs.",
        "",
        "| variant | runs | mean loss, last 5 logs | vs first variant | median tokens/s "
        "| vs first variant | median over runs | vs first variant |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    first = next(iter(groups)) if first is None else first
    stats = {}
    for name, vals in groups.items():
        (loss, loss_sd), (tps, tps_sd) = mean_std([v[0] for v in vals]), mean_std([v[1] for v in vals])
        stats[name] = (len(vals), loss, loss_sd, tps, tps_sd, statistics.median(v[1] for v in vals))
    base = stats.get(first)
    for name, (n, loss, loss_sd, tps, tps_sd, med) in stats.items():
        vs = ("", "", "")
        if base is not None:
            vs = (f"{100 * (loss / base[1] - 1):+.2f} %", f"{tps / base[3]:.3f}x", f"{med / base[5]:.3f}x")
        out.append(
            f"| {name} | {n} | {loss:.4f} ± {loss_sd:.4f} | {vs[0]} | "
            f"{tps:,.0f} ± {tps_sd:,.0f} | {vs[1]} | {med:,.0f} | {vs[2]} |"
        )
    if first not in groups:
        out += ["", f"No run of the first variant, {first}, reached step {last}: no ratios."]
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
