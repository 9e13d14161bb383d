"""Time-to-target for `mxmoe compare`: when each run's loss first reaches given losses (as MLPerf
measures training), the final validation loss at the horizon, and whether the variants' curves
still differ at the end by more than the seeds' spread.

Curves. Training: the smoothed training loss at each logged step s, the mean training loss per
step over the steps (s - W, s] (`smooth_steps` W; only records wholly inside the window count,
weighted by their `loss_steps`), from the first step >= W. Validation: the logged validation losses
(each already a mean over `validation.steps` batches), not smoothed further.

Time to a target: the step at which the piecewise-linear curve through a run's points first
reaches the target (the first point at or below it, the crossing interpolated between it and the
point before; the first point itself when it is already below); tokens = that step x global batch x
seq_len. A run that never reaches it has none ("not reached").

Default targets, along the baseline's curve past its knee: the knee is the step of the baseline's
mean smoothed training curve (the mean over its seeds at the steps they share) farthest below the
straight line from its first to its last point, both axes scaled to [0, 1] (the "Kneedle" rule);
the target steps are knee + q (last - knee) for q in `KNEE_FRACTIONS`; the training targets are the
baseline's mean smoothed training loss there, the validation targets its mean validation loss
there (each interpolated between logged points). So the baseline's mean curve reaches target k at
about target step k, and a variant that drops earlier reaches it sooner.

Not converged at this horizon: a variant whose mean final validation loss or mean final smoothed
training loss differs from the baseline's by more than the seeds' spread (the larger sample
standard deviation of the two variants); unknown below 2 seeds each.

Within the loss target: mean final validation loss at most max(0.5 %, one standard deviation of
the baseline's seeds) above the baseline's (or below it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

KNEE_FRACTIONS = (0.5, 0.75, 0.9)
"""Where the default targets lie between the baseline's knee (0) and its last step (1)."""

LOSS_TOLERANCE_PCT = 0.5
"""The final-loss target: within max(this %, one std of the baseline's seeds) of the baseline."""

Curve = list[tuple[int, float]]


def smoothed_train(records: Sequence[dict], window: int) -> Curve:
    """(step, mean training loss per step over (step - window, step]) at each logged step >= window
    (see the module docstring); records without a finite loss are left out."""
    if window < 1:
        raise ValueError(f"smooth_steps={window}: expected >= 1")
    recs = [r for r in records if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    out = []
    for r in recs:
        s = r["step"]
        if s < window:
            continue
        inside = [x for x in recs if s - window <= x["step"] - x.get("loss_steps", 1) and x["step"] <= s]
        n = sum(x.get("loss_steps", 1) for x in inside)
        if n:
            out.append((s, sum(x["loss"] * x.get("loss_steps", 1) for x in inside) / n))
    return out


def val_curve(records: Sequence[dict]) -> Curve:
    """(step, validation loss) of every record that ran validation; one whose loss was not finite
    (written as null, listed under "nonfinite") is a point at inf, so that no crossing is interpolated
    across it."""
    return [(r["step"], r["val_loss"] if r.get("val_loss") is not None else math.inf)
            for r in records if r.get("val_loss") is not None or "val_loss" in (r.get("nonfinite") or ())]


def crossing(curve: Curve, target: float) -> float | None:
    """The step at which `curve` first reaches `target` (module docstring), or None. From a point at
    inf (a loss that was not finite) the next point that reaches it is the crossing, not interpolated."""
    for i, (s, v) in enumerate(curve):
        if v <= target:
            if i == 0:
                return float(s)
            s0, v0 = curve[i - 1]
            if not math.isfinite(v0):
                return float(s)
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
    return None


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def value_at(curve: Curve, step: float) -> float | None:
    """`curve` linearly interpolated at `step` (None outside its steps, and between or at points at
    inf: a loss that was not finite gives no target)."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:], strict=False):
        if s0 <= step <= s1:
            if step == s0 or step == s1:
                return _finite(v0 if step == s0 else v1)
            if not (math.isfinite(v0) and math.isfinite(v1)):
                return None
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    if curve and curve[-1][0] == step:
        return _finite(curve[-1][1])
    return None


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The mean of `curves` at the steps all of them have."""
    if not curves:
        return []
    steps = set.intersection(*(set(s for s, _ in c) for c in curves))
    by = [dict(c) for c in curves]
    return [(s, statistics.fmean(d[s] for d in by)) for s in sorted(steps)]


def knee_step(curve: Curve) -> int:
    """The step of `curve` farthest below the line from its first to its last point, both axes
    scaled to [0, 1] (the Kneedle rule for a falling, flattening curve); the first step if none is
    below the line."""
    if len(curve) < 3:
        return curve[0][0]
    (s0, v0), (s1, v1) = curve[0], curve[-1]
    if s1 == s0 or v1 == v0:
        return s0
    best, knee = 0.0, s0
    for s, v in curve:
        x, y = (s - s0) / (s1 - s0), (v - v1) / (v0 - v1)  # y: 1 at the start, 0 at the end
        below = (1.0 - x) - y  # the line from (0, 1) to (1, 0), minus the curve
        if below > best:
            best, knee = below, s
    return knee


def default_targets(base_train: Curve, base_val: Curve) -> dict:
    """The default targets from the baseline's mean curves (module docstring): {"knee", "steps",
    "train", "val"}; a validation target is None where the validation curve does not reach its step."""
    if len(base_train) < 2:
        raise ValueError(
            f"time-to-target: the baseline's smoothed training curve has {len(base_train)} point(s), "
            "expected >= 2 (more logged steps than --smooth_steps)"
        )
    knee, last = knee_step(base_train), base_train[-1][0]
    steps = [knee + q * (last - knee) for q in KNEE_FRACTIONS]
    # both interpolated at the target step (between logged points), so both refer to that step
    return {
        "knee": knee,
        "steps": steps,
        "train": [value_at(base_train, st) for st in steps],
        "val": [value_at(base_val, st) for st in steps],
    }


def _spread(values: Sequence[float]) -> dict:
    v = list(values)
    return {
        "n": len(v),
        "mean": statistics.fmean(v) if v else None,
        "std": statistics.stdev(v) if len(v) > 1 else None,
    }


def time_to_target(
    runs: Sequence,
    baseline: str,
    smooth_steps: int = 50,
    train_targets: Sequence[float] | None = None,
    val_targets: Sequence[float] | None = None,
) -> dict:
    """Per run and per variant: the steps (and tokens) to each target, the final validation loss,
    the convergence flag and the loss-target check (module docstring). `runs`: `report.Run`s
    (variant, seed, records, setup). Targets not given are the defaults (`default_targets`)."""
    variants = list(dict.fromkeys(r.variant for r in runs))
    if baseline not in variants:
        raise ValueError(f"baseline={baseline!r}: no run of that variant; variants: {variants}")
    curves = {
        (r.variant, r.seed): (smoothed_train(r.records, smooth_steps), val_curve(r.records)) for r in runs
    }
    base = [curves[(r.variant, r.seed)] for r in runs if r.variant == baseline]
    defaults = None
    if train_targets is None or val_targets is None:
        try:
            defaults = default_targets(mean_curve([t for t, _ in base]), mean_curve([v for _, v in base]))
        except ValueError as e:  # runs too short for the window: the other tables stand without it
            return {"smooth_steps": smooth_steps, "skipped": str(e)}
    targets = {
        "train": list(train_targets) if train_targets is not None else defaults["train"],
        "val": list(val_targets) if val_targets is not None else defaults["val"],
    }
    per_run = []
    for r in runs:
        tr, va = curves[(r.variant, r.seed)]
        g, sl = r.setup.get("global_batch"), r.setup.get("seq_len")
        tokens = g * sl if isinstance(g, int) and isinstance(sl, int) else None
        entry = {"variant": r.variant, "seed": r.seed, "tokens_per_step": tokens}
        for metric, curve in (("train", tr), ("val", va)):
            steps = [None if t is None else crossing(curve, t) for t in targets[metric]]
            entry[f"{metric}_steps"] = steps
            entry[f"{metric}_tokens"] = [None if s is None or tokens is None else s * tokens for s in steps]
        entry["final_train"] = tr[-1][1] if tr else None
        # the last validation's loss, None where it was not finite (null): not an earlier one's
        vals = [x for x in r.records if "val_loss" in x]
        entry["final_val"] = vals[-1]["val_loss"] if vals else None
        entry["last_step"] = r.records[-1]["step"] if r.records else None
        per_run.append(entry)
    out_variants: dict = {}
    for v in variants:
        own = [e for e in per_run if e["variant"] == v]
        ve: dict = {"seeds": [e["seed"] for e in own]}
        for metric in ("train", "val"):
            ve[metric] = [
                {**_spread([e[f"{metric}_steps"][k] for e in own if e[f"{metric}_steps"][k] is not None]),
                 "runs": len(own)}
                for k in range(len(targets[metric]))
            ]
        for key in ("final_train", "final_val"):
            ve[key] = _spread([e[key] for e in own if e[key] is not None])
        out_variants[v] = ve
    b = out_variants[baseline]
    for v, ve in out_variants.items():
        if v == baseline:
            continue
        differs, unknown = [], False
        for key in ("final_val", "final_train"):
            m, mb, s, sb = ve[key]["mean"], b[key]["mean"], ve[key]["std"], b[key]["std"]
            if m is None or mb is None or s is None or sb is None:
                unknown = True
            elif abs(m - mb) > max(s, sb):
                differs.append(key)
        ve["not_converged"] = None if unknown and not differs else bool(differs)
        ve["differs_in"] = differs
        m, mb, sb = ve["final_val"]["mean"], b["final_val"]["mean"], b["final_val"]["std"]
        if m is None or mb is None:
            ve["within_loss_target"] = None
        else:
            tol = max(LOSS_TOLERANCE_PCT / 100 * mb, sb or 0.0)
            ve["within_loss_target"] = m - mb <= tol
            ve["loss_tolerance"] = tol
    return {
        "smooth_steps": smooth_steps,
        "knee_step": defaults["knee"] if defaults else None,
        "target_steps": defaults["steps"] if defaults else None,
        "targets": targets,
        "targets_given": {"train": train_targets is not None, "val": val_targets is not None},
        "runs": per_run,
        "variants": out_variants,
    }


def _f(x: float | None, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(tt: dict, baseline: str) -> str:
    """compare.md's time-to-target section."""
    w = tt["smooth_steps"]
    lines = ["", "## Time to target", ""]
    if "skipped" in tt:
        return "\n".join([*lines, f"Not computed: {tt['skipped']}.", ""])
    lines.append(
        f"Step at which a run's loss first reaches each target (training: the mean loss per step over "
        f"the last {w} steps; validation: the logged validation loss; crossings interpolated between "
        "logged points). Tokens = step × global batch × seq_len. Mean ± std over the seeds that reach "
        "the target (reached / runs)."
    )
    if tt["knee_step"] is not None:
        steps = ", ".join(f"{s:.0f}" for s in tt["target_steps"])
        lines.append(
            f"Default targets: {baseline}'s mean curves at steps {steps} (past its knee at step "
            f"{tt['knee_step']}: knee + {', '.join(str(q) for q in KNEE_FRACTIONS)} × (last step − knee))."
        )
    lines.append("")
    for metric, name in (("train", "training"), ("val", "validation")):
        tg = tt["targets"][metric]
        head = " | ".join(f"{name} ≤ {_f(t, '.4f')}" for t in tg)
        lines += [f"| variant | {head} |", "|---" * (len(tg) + 1) + "|"]
        for v, ve in tt["variants"].items():
            cells = []
            for k in range(len(tg)):
                c = ve[metric][k]
                if tg[k] is None:
                    cells.append("–")
                    continue
                ms = f"{c['mean']:.0f}" if c["mean"] is not None else "not reached"
                if c["std"] is not None:
                    ms += f" ± {c['std']:.0f}"
                cells.append(f"{ms} ({c['n']}/{c['runs']})")
            lines.append(f"| {v}{' (baseline)' if v == baseline else ''} | {' | '.join(cells)} |")
        lines.append("")
    lines += [
        "Per run (steps to each target, training then validation):",
        "",
        "| variant | seed | training | validation | tokens/step |",
        "|---|---|---|---|---|",
    ]
    for e in tt["runs"]:
        tr = ", ".join(_f(s, ".0f") if s is not None else "–" for s in e["train_steps"])
        va = ", ".join(_f(s, ".0f") if s is not None else "–" for s in e["val_steps"])
        lines.append(f"| {e['variant']} | {e['seed']} | {tr} | {va} | {_f(e['tokens_per_step'], 'd')} |")
    lines += [
        "",
        "## At the horizon",
        "",
        f"Final validation loss (the last logged) and final smoothed training loss (last {w} steps), mean "
        "± sample std over seeds. Not converged at this horizon: the mean differs from the baseline's by "
        "more than the larger std of the two (unknown below 2 seeds each). Within target: mean final "
        f"validation loss at most max({LOSS_TOLERANCE_PCT} %, one std of {baseline}'s seeds) above "
        f"{baseline}'s.",
        "",
        "| variant | seeds | final val loss | final train loss (smoothed) | not converged at this horizon "
        "| within target |",
        "|---|---|---|---|---|---|",
    ]

    def ms(s: dict, runs: int) -> str:  # over fewer runs than the seeds column: says how many
        out = _f(s["mean"], ".4f") + (f" ± {s['std']:.4f}" if s["std"] is not None else "")
        return out + (f" ({s['n']} of {runs} runs)" if s["n"] < runs else "")

    for v, ve in tt["variants"].items():
        if v == baseline:
            flag = within = "(baseline)"
        else:
            nc = ve["not_converged"]
            flag = "unknown (< 2 seeds)" if nc is None else (
                f"**yes** ({', '.join(ve['differs_in'])})" if nc else "no"
            )
            wt = ve["within_loss_target"]
            within = "–" if wt is None else ("yes" if wt else "**no**")
        seeds = ",".join(map(str, ve["seeds"]))
        lines.append(
            f"| {v} | {seeds} | {ms(ve['final_val'], len(ve['seeds']))} | "
            f"{ms(ve['final_train'], len(ve['seeds']))} | {flag} | {within} |"
        )
    return "\n".join(lines) + "\n"
