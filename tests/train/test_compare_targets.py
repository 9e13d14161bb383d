"""`mxmoe compare`'s time-to-target, final loss at the horizon and not-converged flag, on synthetic
metrics records whose crossings are known in closed form, and on the real records of one moe_2b pair
(docs/data/2026-12-05)."""

import json
import statistics
from pathlib import Path

import pytest

from mxmoe.train import compare
from mxmoe.train.compare import targets as tt

REPO = Path(__file__).parents[2]
REAL = REPO / "docs/data/2026-12-05/numerics_moe_2b_seed0_python-env/runs"

STEPS, LOG, VAL = 1000, 10, 100
RAMP = 200  # steps over which the loss falls from 1.5 to 0.9


def loss_at(step: float, drop: int, floor: float = 0.9) -> float:
    """Per-step loss: 1.5 until `drop`, then linear down to `floor` over RAMP steps, then flat."""
    if step <= drop:
        return 1.5
    return max(floor, 1.5 - (1.5 - 0.9) * (step - drop) / RAMP)


def records(drop: int, val_offset: float, floor: float = 0.9) -> list[dict]:
    """Records every LOG steps: the mean per-step loss of (s - LOG, s]; validation every VAL steps."""
    out = []
    for s in range(LOG, STEPS + 1, LOG):
        mean = statistics.fmean(loss_at(x, drop, floor) for x in range(s - LOG + 1, s + 1))
        r = {"step": s, "loss": mean, "loss_steps": LOG, "tokens_per_s": 1000.0}
        if s % VAL == 0:
            r["val_loss"] = loss_at(s, drop, floor) + val_offset
        out.append(r)
    return out


def write_run(folder: Path, seed: int, recs: list[dict]) -> None:
    folder.mkdir(parents=True)
    cfg = {
        "debug": {"seed": seed},
        "training": {"steps": STEPS, "seq_len": 64},
        "epochs": {"global_batch": 4, "epochs": 0.5},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


# variant -> (drop step per seed 0..2, final floor)
VARIANTS = {"bf16": ([600, 610, 620], 0.9), "mx": ([400, 410, 420], 0.9), "late": ([760, 770, 780], 0.9)}


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    for v, (drops, floor) in VARIANTS.items():
        for seed, d in enumerate(drops):
            write_run(root / v / f"seed{seed}", seed, records(d, 0.001 * seed, floor))
    return compare.read_runs(root, list(VARIANTS))


def test_smoothed_training_loss_is_the_mean_per_step_over_the_window():
    recs = [
        {"step": 10, "loss": 4.0, "loss_steps": 10},
        {"step": 20, "loss": 2.0, "loss_steps": 10},
        {"step": 25, "loss": 1.0, "loss_steps": 5},
        {"step": 30, "loss": 3.0, "loss_steps": 5},
    ]
    want = [(20, 3.0), (25, (2.0 * 10 + 1.0 * 5) / 15), (30, (20 + 5 + 15) / 20)]
    assert tt.smoothed_train(recs, 20) == want
    with pytest.raises(ValueError, match="smooth_steps=0"):
        tt.smoothed_train(recs, 0)


def test_crossing_is_interpolated_between_logged_points():
    curve = [(10, 3.0), (20, 2.0), (30, 1.0)]
    assert tt.crossing(curve, 1.5) == 25.0
    assert tt.crossing(curve, 2.0) == 20.0
    assert tt.crossing(curve, 3.5) == 10.0  # already below at the first point
    assert tt.crossing(curve, 0.5) is None  # never reached


def test_knee_is_the_point_farthest_below_the_chord():
    # falls fast to step 20, then slowly: the knee is step 20
    curve = [(0, 10.0), (10, 4.0), (20, 2.0), (30, 1.8), (40, 1.6), (50, 1.5)]
    assert tt.knee_step(curve) == 20
    assert tt.knee_step([(0, 1.0), (10, 1.0), (20, 1.0)]) == 0  # flat: no knee


def test_default_targets_are_the_baseline_curves_at_the_target_steps():
    """The training target was the curve's value at the first logged step at or after the target step
    (here step 100, the last, for the target step 92), the validation target the value at that step:
    the baseline reached its own third training target 8 steps late, at another step than the one
    compare.md names. Both are interpolated at the target step now."""
    curve = [(0, 10.0), (10, 4.0)] + [(s, 2.0 - 0.02 * (s - 20)) for s in range(20, 101, 10)]
    d = tt.default_targets(curve, curve)
    assert d["knee"] == 20 and d["steps"] == pytest.approx([60, 80, 92])
    assert d["train"] == pytest.approx([1.2, 0.8, 0.56]) and d["val"] == pytest.approx(d["train"])
    assert [tt.crossing(curve, t) for t in d["train"]] == pytest.approx([60, 80, 92])


def test_time_to_given_targets_matches_the_closed_form(runs):
    """With smooth_steps = the log interval, the smoothed loss at step s is the mean of the linear ramp
    over (s - 10, s] = loss_at(s - 4.5): a target T is crossed at drop + (1.5 - T) / 0.6 * RAMP + 4.5."""
    targets = [1.2, 1.0]
    rep = tt.time_to_target(runs, "bf16", smooth_steps=LOG, train_targets=targets, val_targets=[1.2])
    for e in rep["runs"]:
        d = VARIANTS[e["variant"]][0][e["seed"]]
        want = [d + (1.5 - t) / 0.6 * RAMP + 4.5 for t in targets]
        assert e["train_steps"] == pytest.approx(want)
        assert e["train_tokens"] == pytest.approx([w * 4 * 64 for w in want])
        # validation every 100 steps, loss_at(s) + 0.001 seed: linear between validation points
        # inside the ramp, so the crossing is where that line meets 1.2
        v = 1.2 - 0.001 * e["seed"]
        assert e["val_steps"][0] == pytest.approx(d + (1.5 - v) / 0.6 * RAMP, abs=1e-6)
    for v, (drops, _) in VARIANTS.items():
        c = rep["variants"][v]["train"][0]
        assert c["n"] == c["runs"] == 3
        assert c["mean"] == pytest.approx(statistics.fmean(drops) + 100 + 4.5)
        assert c["std"] == pytest.approx(10.0)


def test_default_targets_lie_on_the_baseline_curve_past_its_knee(runs):
    rep = tt.time_to_target(runs, "bf16", smooth_steps=50)
    base = tt.mean_curve([tt.smoothed_train(r.records, 50) for r in runs if r.variant == "bf16"])
    knee = tt.knee_step(base)
    assert rep["knee_step"] == knee and 600 <= knee <= 900  # where the ramp flattens
    assert rep["target_steps"] == pytest.approx([knee + q * (1000 - knee) for q in tt.KNEE_FRACTIONS])
    for st, target in zip(rep["target_steps"], rep["targets"]["train"], strict=True):
        assert target == pytest.approx(tt.value_at(base, st))
    # the variant that drops 200 steps earlier reaches every target it can sooner
    for k in range(len(tt.KNEE_FRACTIONS)):
        mx, bf = rep["variants"]["mx"]["train"][k], rep["variants"]["bf16"]["train"][k]
        if bf["n"] and mx["n"]:
            assert mx["mean"] < bf["mean"]


def test_the_flag_marks_variants_still_apart_at_the_horizon(tmp_path):
    root = tmp_path / "runs"
    for seed in range(3):
        write_run(root / "bf16" / f"seed{seed}", seed, records(600, 0.001 * seed))
        write_run(root / "same" / f"seed{seed}", seed, records(400, 0.001 * seed))  # same floor
        write_run(root / "higher" / f"seed{seed}", seed, records(400, 0.001 * seed, floor=1.0))
    runs = compare.read_runs(root, ["bf16", "same", "higher"])
    rep = tt.time_to_target(runs, "bf16", smooth_steps=50)
    same, higher = rep["variants"]["same"], rep["variants"]["higher"]
    assert same["not_converged"] is False and same["within_loss_target"] is True
    assert higher["not_converged"] is True and set(higher["differs_in"]) == {"final_val", "final_train"}
    assert higher["within_loss_target"] is False  # 0.1 above: more than 0.5 % and more than one std
    assert higher["final_val"]["mean"] == pytest.approx(1.001)
    md = tt.markdown(rep, "bf16")
    assert "| higher | 0,1,2 |" in md and "**yes** (final_val, final_train)" in md
    # one seed: no spread to compare with
    one = tt.time_to_target([r for r in runs if r.seed == 0], "bf16", smooth_steps=50)
    assert one["variants"]["higher"]["not_converged"] is None
    assert "unknown (< 2 seeds)" in tt.markdown(one, "bf16")


def test_compare_writes_the_time_to_target_tables(runs, tmp_path, capsys):
    root = Path(runs[0].folder).parents[1]
    out = tmp_path / "out"
    argv = ["--runs", str(root), "--out", str(out), "--smooth-steps", "10", "--train-targets", "1.2,1.0"]
    assert compare.main(argv) == 0
    report = json.loads((out / "compare.json").read_text())["time_to_target"]
    assert report["targets"]["train"] == [1.2, 1.0] and report["targets_given"]["train"] is True
    md = (out / "compare.md").read_text()
    assert "## Time to target" in md and "training ≤ 1.2000" in md and "## At the horizon" in md
    # runs shorter than the window: the section says so, the other tables stand
    assert compare.main(["--runs", str(root), "--out", str(out), "--smooth-steps", "5000"]) == 0
    assert "Not computed:" in (out / "compare.md").read_text()
    capsys.readouterr()


def test_the_real_moe_2b_pair_reads_and_mx_reaches_each_target_first(tmp_path, capsys):
    """The records of docs/data/2026-12-05 (bf16 and MX, seed 0, 1000 steps): every default target is
    reached; the baseline reaches its own at the target step."""
    runs = compare.read_runs(REAL, ["bf16", "mx"])
    rep = tt.time_to_target(runs, "bf16")
    bf16, mx = (next(e for e in rep["runs"] if e["variant"] == v) for v in ("bf16", "mx"))
    assert all(s is not None for s in bf16["train_steps"] + mx["train_steps"] + mx["val_steps"])
    assert bf16["train_steps"] == pytest.approx(rep["target_steps"])
    assert bf16["tokens_per_step"] == 16 * 1024
    assert all(m < b for m, b in zip(mx["train_steps"], bf16["train_steps"], strict=True))
    argv = ["--runs", str(REAL), "--out", str(tmp_path), "--variant", "bf16", "--variant", "mx"]
    assert compare.main(argv) == 0
    assert "unknown (< 2 seeds)" in capsys.readouterr().out


def test_no_crossing_or_target_is_interpolated_across_a_validation_that_was_not_finite():
    """A validation at step 200 that was not finite (null, listed under "nonfinite") is a point at
    inf: the curve reaches 1.5 at step 300, where it is logged again (it was dropped and a crossing
    interpolated over the gap, at 200), and the value between 100 and 300 is no target."""
    records = [
        {"step": 100, "loss": 2.0, "val_loss": 2.0},
        {"step": 200, "loss": 1.8, "val_loss": None, "nonfinite": ["val_loss"]},
        {"step": 300, "loss": 1.0, "val_loss": 1.0},
        {"step": 400, "loss": 0.9},
    ]
    curve = tt.val_curve(records)
    assert curve == [(100, 2.0), (200, float("inf")), (300, 1.0)]
    assert tt.crossing(curve, 1.5) == 300.0
    assert tt.crossing(curve, 2.0) == 100.0
    assert tt.value_at(curve, 150) is None and tt.value_at(curve, 200) is None
    assert tt.value_at(curve, 100) == 2.0 and tt.value_at(curve, 300) == 1.0
    assert tt.value_at(curve, 250) is None


STUDY_1B = REPO / "docs/data/2026-12-07/numerics_moe_1b_python-env/runs"


def test_the_moe_1b_study_records_give_the_tables_of_numerics_md():
    """docs/numerics.md's moe_1b table (bf16 and MX x seeds 0-2, 800 steps) is what `mxmoe compare`
    computes from the records kept in docs/data/2026-12-07: knee, targets, reached counts, the
    horizon's verdicts and the per-seed paired difference."""
    runs = compare.read_runs(STUDY_1B, ["bf16", "mx"])
    rep = tt.time_to_target(runs, "bf16")
    assert rep["knee_step"] == 210 and rep["target_steps"] == [505.0, 652.5, 741.0]
    assert [round(t, 4) for t in rep["targets"]["train"]] == [1.2717, 1.1335, 1.0788]
    bf16, mx = rep["variants"]["bf16"], rep["variants"]["mx"]
    assert [(e["n"], round(e["mean"])) for e in bf16["train"]] == [(3, 513), (3, 685), (2, 695)]
    assert [(e["n"], round(e["mean"])) for e in mx["train"]] == [(3, 487), (2, 545), (2, 590)]
    assert round(bf16["final_val"]["mean"], 4) == 1.0471 and round(mx["final_val"]["mean"], 4) == 1.0055
    assert mx["within_loss_target"] and not mx["not_converged"]
    val = {(r.variant, r.seed): r.val_loss for r in runs}
    paired = [round(100 * (val["mx", s] - val["bf16", s]) / val["bf16", s], 2) for s in (0, 1, 2)]
    assert paired == [-15.03, 0.98, 2.6]
    per_run = {(e["variant"], e["seed"]): e for e in rep["runs"]}
    assert per_run[("mx", 1)]["train_steps"][1:] == [None, None]  # MX seed 1 never reaches targets 2, 3
    assert per_run[("bf16", 1)]["train_steps"][2] is None
