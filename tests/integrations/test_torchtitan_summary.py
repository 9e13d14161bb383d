"""scripts/torchtitan_summary.py: per-run and per-variant (mean ± std over seeds) tables from logs."""

import importlib.util
import statistics
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "scripts" / "torchtitan_summary.py"


def _load():
    spec = importlib.util.spec_from_file_location("torchtitan_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _log(path: Path, losses: list[float], tps: list[int]) -> None:
    path.write_text(
        "".join(
            f"\x1b[31m[titan] step: {10 * (i + 1)}  loss: {loss:.4f}  grad_norm: 1.0  tps: {t:,}\x1b[39m\n"
            for i, (loss, t) in enumerate(zip(losses, tps, strict=True))
        )
    )


def test_per_variant_mean_and_spread_over_seeds(tmp_path):
    tails = {("bf16", 0): 4.0, ("bf16", 1): 4.2, ("mx", 0): 4.1, ("mx", 1): 4.3}
    for (v, s), tail in tails.items():
        _log(tmp_path / f"{v}_s{s}.log", [5.0] + [tail] * 5, [1, 100, 100, 300, 100 + s, 100])
    _log(tmp_path / "mx_s2.log", [5.0, 3.0], [1, 100])  # stopped early: left out of the means
    runs = ["bf16_s0", "mx_s0", "bf16_s1", "mx_s1", "mx_s2"]
    _load().main([str(tmp_path), *runs])
    text = (tmp_path / "summary.md").read_text()
    sd = statistics.stdev([4.0, 4.2])
    assert f"| bf16 | 2 | 4.1000 ± {sd:.4f} | +0.00 % | 100 ± 0 | 1.000x | 100 | 1.000x |" in text
    assert f"| mx | 2 | 4.2000 ± {sd:.4f} | +2.44 % | 100 ± 0 | 1.000x | 100 | 1.000x |" in text
    assert "runs that reached step 60" in text
    assert (tmp_path / "mx_s2.csv").read_text().splitlines()[1:] == ["10,5.0,1.0,1", "20,3.0,1.0,100"]


def test_runs_without_seeds_get_no_per_variant_table(tmp_path):
    _log(tmp_path / "bf16.log", [5.0, 4.0], [1, 100])
    _load().main([str(tmp_path), "bf16"])
    assert "Per variant" not in (tmp_path / "summary.md").read_text()


def test_repeats_are_grouped_per_variant_with_the_median_over_runs(tmp_path):
    """VARIANT_sSEED_rR runs (REPEATS=N) group by variant; the median over runs shrugs off one slow run."""
    tps = {("bf16", 1): 200, ("bf16", 2): 210, ("bf16", 3): 120, ("mxmoe", 1): 190, ("mxmoe", 2): 195,
           ("mxmoe", 3): 197}
    runs = []
    for r in (1, 2, 3):
        for v in ("bf16", "mxmoe"):
            name = f"{v}_s0_r{r}"
            _log(tmp_path / f"{name}.log", [4.0, 4.0, 4.0], [1, tps[v, r], tps[v, r]])
            runs.append(name)
    _load().main([str(tmp_path), *runs])
    text = (tmp_path / "summary.md").read_text()
    bf16_mean = statistics.fmean([200, 210, 120])
    mx_mean = statistics.fmean([190, 195, 197])
    assert f"| bf16 | 3 | 4.0000 ± 0.0000 | +0.00 % | {bf16_mean:,.0f} ± " in text
    assert "| 1.000x | 200 | 1.000x |" in text
    assert f"| mxmoe | 3 | 4.0000 ± 0.0000 | +0.00 % | {mx_mean:,.0f} ± " in text
    assert f"| {mx_mean / bf16_mean:.3f}x | 195 | 0.975x |" in text


def test_no_ratios_when_the_first_run_or_variant_has_no_result(tmp_path):
    """The ratios are to the first run (variant): when it logged nothing (or no run of it reached the
    last step) the next one was taken as the baseline, and mxmoe read 1.000x "vs first run"."""
    (tmp_path / "bf16_s0.log").write_text("Traceback: CUDA out of memory\n")  # no step logged
    _log(tmp_path / "bf16_s1.log", [5.0, 4.0], [1, 100])  # stopped at step 20
    _log(tmp_path / "mxmoe_s0.log", [5.0, 4.0, 3.0], [1, 90, 90])
    _load().main([str(tmp_path), "bf16_s0", "mxmoe_s0", "bf16_s1"])
    text = (tmp_path / "summary.md").read_text()
    assert "| mxmoe_s0 | 30 | 5.0000 | 3.0000 | 4.0000 |  | 90 |  |" in text
    assert "The first run, bf16_s0, logged no step: no ratios." in text
    assert "| mxmoe | 1 | 4.0000 ± 0.0000 |  | 90 ± 0 |  | 90 |  |" in text
    assert "No run of the first variant, bf16, reached step 30: no ratios." in text


def test_the_first_variant_is_the_baseline_wherever_its_runs_are(tmp_path):
    _log(tmp_path / "bf16_s0.log", [5.0], [1])  # logged, but not to the last step
    _log(tmp_path / "mxmoe_s0.log", [5.0, 4.0], [1, 90])
    _log(tmp_path / "bf16_s1.log", [5.0, 4.0], [1, 100])
    _load().main([str(tmp_path), "bf16_s0", "mxmoe_s0", "bf16_s1"])
    text = (tmp_path / "summary.md").read_text()
    assert "| mxmoe | 1 | 4.5000 ± 0.0000 | +0.00 % | 90 ± 0 | 0.900x | 90 | 0.900x |" in text
    assert "| bf16 | 1 | 4.5000 ± 0.0000 | +0.00 % | 100 ± 0 | 1.000x | 100 | 1.000x |" in text


def _curve_log(path: Path, losses: list[float]) -> None:
    """A log of every step (`--metrics.log_freq 1`)."""
    path.write_text("".join(
        f"[titan] step: {i + 1}  loss: {loss:.4f}  grad_norm: 1.0  tps: 1,000\n"
        for i, loss in enumerate(losses)
    ))


def test_seeded_runs_get_time_to_target_and_the_horizon_check(tmp_path):
    """bf16 falls from 5 to 3 over 200 steps, then by 0.002 a step; mx drops 20 steps sooner. The
    targets lie on bf16's mean smoothed curve past its knee, so mx reaches each ~20 steps sooner and
    ends 0.04 lower, more than the seeds' spread (0.02) and inside the loss target."""
    def curve(drop_end: int, offset: float) -> list[float]:
        return [(5.0 - 2.0 * s / drop_end if s < drop_end else 3.0 - 0.002 * (s - drop_end)) + offset
                for s in range(1, 401)]

    runs = []
    for seed, off in ((0, 0.0), (1, 0.02), (2, -0.02)):
        _curve_log(tmp_path / f"bf16_s{seed}.log", curve(200, off))
        _curve_log(tmp_path / f"mx_s{seed}.log", curve(180, off + 0.001))
        runs += [f"bf16_s{seed}", f"mx_s{seed}"]
    mod = _load()
    mod.main([str(tmp_path), *runs])
    text = (tmp_path / "summary.md").read_text()
    assert "Time to target" in text and "past its knee at step" in text
    # per run: mx reaches every target before bf16 of the same seed
    steps = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 2 and parts[0] in runs:
            steps[parts[0]] = [float(x) for x in parts[1].split(", ")]
    assert set(steps) == set(runs)
    for seed in (0, 1, 2):
        assert all(m < b for m, b in zip(steps[f"mx_s{seed}"], steps[f"bf16_s{seed}"], strict=True))
    # smoothed over steps 351-400: bf16 3 - 0.002 * 175.5, mx 0.039 below
    bf16 = 3.0 - 0.002 * 175.5
    assert f"| bf16 | 0,1,2 | {bf16:.4f} ± 0.0200 | +0.00 % | (baseline) | (baseline) |" in text
    mx = f"| mx | 0,1,2 | {bf16 - 0.039:.4f} ± 0.0200 | {100 * -0.039 / bf16:+.2f} % | **yes** | yes |"
    assert mx in text


def test_time_to_target_left_out_for_repeats_and_short_logs(tmp_path):
    """Repeats (VARIANT_sSEED_rR) are speed runs, and logs every 10 steps hold too few points."""
    for name in ("bf16_s0_r1", "mx_s0_r1"):
        _curve_log(tmp_path / f"{name}.log", [5.0 - 0.01 * s for s in range(100)])
    _load().main([str(tmp_path), "bf16_s0_r1", "mx_s0_r1"])
    assert "Time to target" not in (tmp_path / "summary.md").read_text()
    for name in ("bf16_s0", "mx_s0"):
        _log(tmp_path / f"{name}.log", [5.0, 4.0, 3.0], [1, 100, 100])
    _load().main([str(tmp_path), "bf16_s0", "mx_s0"])
    assert "Time to target: not computed" in (tmp_path / "summary.md").read_text()


def test_a_run_out_of_gpu_memory_is_no_result(tmp_path):
    """Nine runs at once on an H100: some died at step 1 with "CUDA out of memory", and one of them
    read +253 % against the first run."""
    _log(tmp_path / "bf16_s0.log", [5.0, 4.0, 3.0], [1, 100, 100])
    _log(tmp_path / "mxmoe_s0.log", [8.0], [1])
    with open(tmp_path / "mxmoe_s0.log", "a") as f:
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    _load().main([str(tmp_path), "bf16_s0", "mxmoe_s0"])
    text = (tmp_path / "summary.md").read_text()
    assert "| mxmoe_s0 | 10 (out of GPU memory: fewer runs at once (PARALLEL)) | | | | | | |" in text
    assert "| mxmoe |" not in text
