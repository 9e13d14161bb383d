"""Loss and tokens/s of torchtitan trainer runs, from their logs (scripts/torchtitan_h200.sh).

`python scripts/torchtitan_summary.py OUT_DIR RUN [RUN ...]` reads OUT_DIR/RUN.log for each run
(torchtitan's step lines: "step: 10  loss:  7.1234  grad_norm: ... tps: 12,345 ..."), writes
OUT_DIR/RUN.csv (step, loss, grad_norm, tps) and OUT_DIR/summary.md, a table: steps logged, first
and last loss, mean loss of the last 5 logged steps and its difference from the first run's,
median tokens/s per GPU over the logged steps after the first (the first holds warm-up), and the
ratio to the first run's. A run that stopped early shows the steps it logged; one whose log says
"CUDA out of memory" (or "Failed to CUDA calloc") is no result (too many runs at once), and says
so. When the first run logged no step, no run has a ratio (not one to the next run's, under the
first run's name).

Runs named VARIANT_sSEED or VARIANT_sSEED_rR (scripts/torchtitan_h200.sh; R a repeat) are also
summarized per variant: the mean and standard deviation over its runs of the tail loss and of the
median tokens/s, and their ratios to the first variant's means; and the median over its runs of
the median tokens/s, with its ratio to the first variant's (the speed figure where runs repeat: one
slow run moves it least). Runs that did not reach the last step of the longest run are left out;
when no run of the first variant (the first run's) is left, no variant has a ratio.

Runs named VARIANT_sSEED (seeds, no repeats) that logged more steps than the smoothing window (50
steps; log every step with `--metrics.log_freq 1`) also get the loss study's comparison of
`mxmoe compare` (mxmoe.train.compare.targets): per run and per variant the step at which the
smoothed training loss (mean over the last 50 steps) first reaches targets along the first
variant's mean curve past its knee, and at the last step each variant's mean smoothed loss, whether
it differs from the first variant's by more than the seeds' spread, and whether it is within
max(0.5 %, one std of the first variant's seeds) of it. The data does not repeat within such runs
(torchtitan's text corpus is read once in order), so each step's loss is on unseen tokens.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

from mxmoe.train.compare import targets

SMOOTH_STEPS = 50

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NUM = r"([-+0-9.eE]+|nan|inf)"
OOM = re.compile(r"CUDA out of memory|Failed to CUDA calloc")  # torch's allocator, or NCCL's / cuBLAS's
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
    logged = {run: parse(out / f"{run}.log") if (out / f"{run}.log").exists() else [] for run in runs}
    for k, run in enumerate(runs):
        log = out / f"{run}.log"
        rows = logged[run]
        with open(out / f"{run}.csv", "w") as f:
            f.write("step,loss,grad_norm,tps\n")
            f.writelines(f"{s},{loss},{g},{t}\n" for s, loss, g, t in rows)
        oom = log.exists() and OOM.search(log.read_text(errors="replace")) is not None
        if not rows or oom:  # a run that died of memory is no result, whatever steps it logged
            why = "out of GPU memory: fewer runs at once (PARALLEL)" if oom else f"see {run}.log"
            lines.append(f"| {run} | {rows[-1][0] if rows else 0} ({why}) | | | | | | |")
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
    lines += time_to_target({run: parse(out / f"{run}.log") for run in done}, first[1] if first else None)
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


def time_to_target(logged: dict[str, list[tuple[int, float, float, int]]], first: str | None) -> list[str]:
    """The time-to-target and horizon tables (module docstring) of the runs named VARIANT_sSEED that
    reached the last step of the longest; none when fewer than two such runs or no run of `first`."""
    runs = []
    last = max((rows[-1][0] for rows in logged.values() if rows), default=0)
    for run, rows in logged.items():
        m = SEEDED.match(run)
        if m and m[3] is None and rows and rows[-1][0] == last:
            records = [{"step": s, "loss": loss} for s, loss, _, _ in rows]
            runs.append(SimpleNamespace(variant=m[1], seed=int(m[2]), records=records, setup={}))
    if first is None or len(runs) < 2 or not any(r.variant == first for r in runs):
        return []
    tt = targets.time_to_target(runs, first, smooth_steps=SMOOTH_STEPS)
    if "skipped" in tt:
        return ["", f"Time to target: not computed ({tt['skipped']})."]
    tg = tt["targets"]["train"]
    out = [
        "",
        f"Time to target: the step at which a run's training loss, mean over the last {SMOOTH_STEPS} "
        f"steps, first reaches {first}'s mean curve at steps "
        f"{', '.join(f'{s:.0f}' for s in tt['target_steps'])} (past its knee at step {tt['knee_step']}); "
        "mean ± std over the seeds that reach it (reached / runs).",
        "",
        "| variant | " + " | ".join(f"loss ≤ {t:.4f}" for t in tg) + " |",
        "| --- " * (len(tg) + 1) + "|",
    ]
    for v, ve in tt["variants"].items():
        cells = []
        for c in ve["train"]:
            cell = "not reached" if c["mean"] is None else f"{c['mean']:.0f}"
            cell += f" ± {c['std']:.0f}" if c["std"] is not None else ""
            cells.append(f"{cell} ({c['n']}/{c['runs']})")
        out.append(f"| {v} | {' | '.join(cells)} |")
    out += ["", "| run | steps to each target |", "| --- | --- |"]
    for e in tt["runs"]:
        steps = ", ".join("–" if s is None else f"{s:.0f}" for s in e["train_steps"])
        out.append(f"| {e['variant']}_s{e['seed']} | {steps} |")
    base = tt["variants"][first]["final_train"]
    tol = max(targets.LOSS_TOLERANCE_PCT / 100 * base["mean"], base["std"] or 0.0)
    out += [
        "",
        f"At step {last}: training loss, mean over the last {SMOOTH_STEPS} steps, mean ± std over the "
        f"seeds; differs: by more than the larger std of the variant's and {first}'s seeds (unknown "
        f"below 2 seeds each); within target: at most max({targets.LOSS_TOLERANCE_PCT} %, one std of "
        f"{first}'s seeds) = {tol:.4f} above {first}'s mean.",
        "",
        "| variant | seeds | smoothed loss | vs first variant | differs | within target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v, ve in tt["variants"].items():
        f = ve["final_train"]
        sd = f" ± {f['std']:.4f}" if f["std"] is not None else ""
        if v == first:
            differs = within = "(baseline)"
        else:
            sds = (f["std"], base["std"])
            differs = ("unknown" if None in sds else
                       ("**yes**" if abs(f["mean"] - base["mean"]) > max(sds) else "no"))
            within = "yes" if f["mean"] - base["mean"] <= tol else "**no**"
        out.append(
            f"| {v} | {','.join(map(str, ve['seeds']))} | {f['mean']:.4f}{sd} | "
            f"{100 * (f['mean'] / base['mean'] - 1):+.2f} % | {differs} | {within} |"
        )
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
