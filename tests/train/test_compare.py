"""`mxmoe compare`: the statistics on hand-made metrics files, the reading mode's files and errors,
and (CPU) a real compare of 2 variants x 2 seeds of the tiny debug config."""

import json
import statistics
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main as cli_main
from mxmoe.train import compare

REPO = Path(__file__).parents[2]


def _write_run(folder: Path, seed: int, records: list[dict], **recorded) -> Path:
    """A run folder: config.json (the seed, and what `recorded` adds, e.g. the corpus and epochs the
    trainer records) and metrics.jsonl."""
    folder.mkdir(parents=True)
    config = {**recorded, "training": {"seed": seed, **recorded.get("training", {})}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def _records(tail: list[float], val: float, tps: list[float]) -> list[dict]:
    """Steps 10..100 logged every 10 (loss_steps 10), except that the last two records split the
    last 10 steps into 5 + 5; the last four training losses are `tail` (the first three of 10, 10
    and 5 steps, then 5), the earlier ones 3.0; validation `val` at step 100 (and 9.0 at 50)."""
    recs = [{"step": s, "loss": 3.0, "loss_steps": 10} for s in range(10, 80, 10)]
    recs += [
        {"step": 80, "loss": tail[0], "loss_steps": 10},
        {"step": 90, "loss": tail[1], "loss_steps": 10},
        {"step": 95, "loss": tail[2], "loss_steps": 5},
        {"step": 100, "loss": tail[3], "loss_steps": 5, "val_loss": val},
    ]
    recs[4]["val_loss"] = 9.0
    for r, t in zip(recs, tps, strict=False):
        r["tokens_per_s"] = t
    return recs


# per (variant, seed): the last four training losses and the final validation loss
DATA = {
    ("bf16", 0): ([2.0, 1.5, 1.2, 1.0], 1.6),
    ("bf16", 1): ([2.2, 1.7, 1.3, 1.1], 1.7),
    ("bf16", 2): ([2.0, 1.6, 1.4, 1.2], 1.8),
    ("mx", 0): ([2.1, 1.6, 1.26, 1.04], 1.632),
    ("mx", 1): ([2.2, 1.7, 1.3, 1.1], 1.7),
    ("mx", 2): ([2.0, 1.6, 1.4, 1.2], 1.782),
    ("mx", 3): ([2.0, 1.6, 1.4, 1.2], 1.9),  # no bf16 run of seed 3: unpaired
}


@pytest.fixture
def runs_root(tmp_path) -> Path:
    root = tmp_path / "runs"
    for (v, s), (tail, val) in DATA.items():
        _write_run(root / v / f"seed{s}", s, _records(tail, val, [10.0 * (s + 1)] * 11))
    return root


def test_run_summary_weights_records_by_their_steps(runs_root):
    r = compare.run_summary("bf16", 0, runs_root / "bf16" / "seed0", tail_steps=20)
    # the last 20 steps: records 90 (10 steps), 95 (5), 100 (5)
    assert r.train_loss == pytest.approx((1.5 * 10 + 1.2 * 5 + 1.0 * 5) / 20)
    assert r.train_steps == (80, 100)
    assert (r.val_loss, r.val_step, r.last_step) == (1.6, 100, 100)
    assert r.tokens_per_s == 10.0
    # default window: the last 10 % of the 100 steps = records 95 and 100
    d = compare.run_summary("bf16", 0, runs_root / "bf16" / "seed0")
    assert d.train_loss == pytest.approx((1.2 + 1.0) / 2) and d.train_steps == (90, 100)
    # a window shorter than the last record's interval still takes the last record whole
    one = compare.run_summary("bf16", 0, runs_root / "bf16" / "seed0", tail_steps=1)
    assert one.train_loss == 1.0 and one.train_steps == (95, 100)


def test_paired_differences_by_hand(runs_root):
    runs = compare.read_runs(runs_root, tail_steps=10)
    assert [(r.variant, r.seed) for r in runs] == sorted(DATA)
    stats = compare.paired_differences(runs, "bf16")
    # by hand: train = mean of the last two losses (5 steps each); val as given
    train = {k: (t[2] + t[3]) / 2 for k, (t, _) in DATA.items()}
    val = {k: v for k, (_, v) in DATA.items()}
    mx_val = stats["mx"]["val"]["diff_pct"]
    assert mx_val["per_seed"] == pytest.approx({0: 2.0, 1: 0.0, 2: -1.0})  # 1.632/1.6, 1.7/1.7, 1.782/1.8
    assert mx_val["unpaired"] == [3]
    assert mx_val["n"] == 3
    assert mx_val["mean"] == pytest.approx(1.0 / 3)
    assert mx_val["std"] == pytest.approx(statistics.stdev([2.0, 0.0, -1.0]))
    assert (mx_val["min"], mx_val["max"]) == (pytest.approx(-1.0), pytest.approx(2.0))
    mx_train = stats["mx"]["train"]["diff_pct"]
    want = {s: (train[("mx", s)] - train[("bf16", s)]) / train[("bf16", s)] * 100 for s in (0, 1, 2)}
    assert want[0] == pytest.approx(4.5454545) and want[1] == want[2] == 0.0
    assert mx_train["per_seed"] == pytest.approx(want)
    assert mx_train["mean"] == pytest.approx(sum(want.values()) / 3)
    # identical runs differ by exactly zero
    assert mx_train["per_seed"][1] == 0.0 and mx_val["per_seed"][1] == 0.0
    assert stats["bf16"]["val"]["mean_loss"] == pytest.approx((1.6 + 1.7 + 1.8) / 3)
    assert "diff_pct" not in stats["bf16"]["val"]
    assert stats["mx"]["seeds"] == [0, 1, 2, 3]
    assert stats["mx"]["val"]["mean_loss"] == pytest.approx(sum(val[("mx", s)] for s in range(4)) / 4)
    with pytest.raises(ValueError, match="baseline='fp8'"):
        compare.paired_differences(runs, "fp8")


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"step": 100, "loss": "abc"}', "(step 100): loss='abc': expected a finite number or null"),
        ('{"step": "20", "loss": 1.0}', "step='20': expected an int >= 0"),
        ('{"step": 100, "loss": 1.0, "loss_steps": 0}', "(step 100): loss_steps=0: expected an int >= 1"),
        ('{"step": 100, "loss": NaN}', "NaN is not a number metrics.jsonl holds"),
        ('{"step": 100, "val_loss": true}', "(step 100): val_loss=True: expected a finite number or null"),
        ('[1, 2]', "a record must be a JSON object, got list"),
    ],
)
def test_bad_records_are_named(runs_root, tmp_path, capsys, bad, message):
    # once a TypeError, a ZeroDivisionError or a "+nan" in the table
    metrics = runs_root / "mx" / "seed1" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + bad + "\n")
    assert compare.main(["--runs", str(runs_root), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"mxmoe compare: error: {metrics}:12" in err and message in err, err
    assert not (tmp_path / "o" / "compare.md").exists()


def test_a_failed_compare_sets_the_previous_tables_aside(runs_root, tmp_path, capsys):
    """A compare that fails leaves no table of an earlier compare in --out looking current: they
    are renamed *.stale and the error says so."""
    out = tmp_path / "o"
    assert compare.main(["--runs", str(runs_root), "--out", str(out)]) == 0
    before = (out / "compare.md").read_text()
    metrics = runs_root / "mx" / "seed1" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": "x"}\n')
    capsys.readouterr()
    assert compare.main(["--runs", str(runs_root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not any((out / name).exists() for name in compare.TABLES), sorted(out.iterdir())
    assert (out / "compare.md.stale").read_text() == before and (out / "compare.json.stale").is_file()
    assert f"the tables of a previous compare in {out} (compare.md, compare.json" in err, err


def test_a_baseline_loss_of_zero_is_an_error_naming_the_run(runs_root, tmp_path, capsys):
    metrics = runs_root / "bf16" / "seed2" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"val_loss": 1.8', '"val_loss": 0.0'))
    assert compare.main(["--runs", str(runs_root), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"baseline run {str(runs_root / 'bf16' / 'seed2')!r}: final val loss 0: a difference in %" in err


def test_a_last_validation_that_was_not_finite_is_not_replaced_by_an_earlier_one(runs_root):
    """A run whose last validation was not finite (written null, listed under "nonfinite") took an
    earlier step's validation as its final one: paired with the baseline's step-100 loss and averaged
    at the horizon as if of the same step. Now it has none there, and the tables say over how many
    runs their means are."""
    from mxmoe.train.compare import targets as tt

    metrics = runs_root / "mx" / "seed0" / "metrics.jsonl"
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    recs[-1].update(val_loss=None, nonfinite=["val_loss"])
    metrics.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = compare.run_summary("mx", 0, metrics.parent)
    assert (run.val_loss, run.val_step) == (None, 100)  # not step 50's 9.0
    runs = compare.read_runs(runs_root, ["bf16", "mx"])
    diff = compare.paired_differences(runs, "bf16")["mx"]["val"]["diff_pct"]
    assert diff["unpaired"] == [0, 3] and sorted(diff["per_seed"]) == [1, 2]
    rep = tt.time_to_target(runs, "bf16", smooth_steps=10, train_targets=[2.0], val_targets=[2.0])
    assert next(e for e in rep["runs"] if (e["variant"], e["seed"]) == ("mx", 0))["final_val"] is None
    final = rep["variants"]["mx"]["final_val"]
    assert final["n"] == 3 and final["mean"] == pytest.approx(statistics.fmean([1.7, 1.782, 1.9]))
    assert "| mx | 0,1,2,3 | 1.7940 ± 0.1005 (3 of 4 runs) |" in tt.markdown(rep, "bf16")
    md = compare.markdown(runs, compare.paired_differences(runs, "bf16"), "bf16", 0, None)
    assert f"| mx | 0,1,2,3 | {statistics.fmean([1.7, 1.782, 1.9]):.4f} (3 of 4 runs) |" in md


SETUP = {"training": {"steps": 100, "seq_len": 1024}, "epochs": {"global_batch": 16, "epochs": 0.5},
         "corpus": {"sha256": "a" * 64, "source": "python-env"}}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"corpus": {"sha256": "b" * 64}}, f"corpus {'b' * 64!r} vs {'a' * 64!r}"),
        ({"training": {"steps": 200}}, "training.steps 200 vs 100"),
        ({"training": {"seq_len": 512}}, "training.seq_len 512 vs 1024"),
        ({"epochs": {"global_batch": 8}}, "global_batch 8 vs 16"),
        ({"last_step": 90}, "last logged step 90 vs 100"),
    ],
)
def test_runs_of_different_setups_are_not_paired(tmp_path, capsys, change, message):
    root = tmp_path / "runs"
    for v in ("bf16", "mx"):
        for seed in (0, 1):
            recorded = json.loads(json.dumps(SETUP))
            recs = _records(*DATA[(v, seed)], [1.0] * 11)
            if (v, seed) == ("mx", 1):
                for k, d in change.items():
                    if k == "last_step":  # a run of 90 steps (one of 100 that stopped is left out)
                        recs = recs[:-2]
                        recorded["training"]["steps"] = 90
                    else:
                        recorded[k].update(d)
                steps = recorded["training"]["steps"]  # a run of more steps runs them all
                recs += [{"step": s, "loss": 1.0, "loss_steps": 10} for s in range(110, steps + 1, 10)]
            _write_run(root / v / f"seed{seed}", seed, recs, **recorded)
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    pair = f"{root / 'mx' / 'seed1'} vs its baseline {root / 'bf16' / 'seed1'}"
    want = f"runs of different setups cannot be paired: {pair}"
    assert want in err and message in err, err
    assert str(root / "mx" / "seed0") not in err  # the pairs that match are not named


def test_a_run_that_stopped_before_its_steps_is_left_out(tmp_path, capsys):
    """A run folder without command.json whose records end before its training.steps (a run killed or
    stopped outside `mxmoe compare`) was read as finished: with no baseline run of its seed it was
    paired with nothing and checked against nothing, and its loss at step 90 went into its variant's
    means at the horizon of 100."""
    root = tmp_path / "runs"
    for v, seeds in (("bf16", (0, 1)), ("mx", (0, 1, 3))):
        for seed in seeds:
            recs = _records(*DATA[(v, seed)], [1.0] * 11)
            _write_run(root / v / f"seed{seed}", seed, recs[:-2] if seed == 3 else recs, **SETUP)
    runs = compare.read_runs(root)
    assert [(r.variant, r.seed) for r in runs] == [("bf16", 0), ("bf16", 1), ("mx", 0), ("mx", 1)]
    err = capsys.readouterr().err
    assert f"{root / 'mx' / 'seed3'} did not finish (its last logged step is 90 of training.steps=100)" in err


def test_the_runs_table_shows_epochs_and_flags_runs_that_repeat_data(tmp_path, capsys):
    root = tmp_path / "runs"
    for v, epochs in (("bf16", 1.64), ("mx", 1.64)):
        recorded = json.loads(json.dumps(SETUP))
        recorded["epochs"]["epochs"] = epochs
        _write_run(root / v / "seed0", 0, _records(*DATA[(v, 0)], [1.0] * 11), **recorded)
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "compare.md").read_text()
    assert "**Data repeats**: 2 of 2 runs read their training data more than once (up to 1.64 epochs)" in md
    assert "| bf16 | 0 | 100 | 1.64 (repeats) |" in md
    report = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert report["repeats_data"] == [str(root / "bf16" / "seed0"), str(root / "mx" / "seed0")]
    assert [r["epochs"] for r in report["runs"]] == [1.64, 1.64]
    assert "2 run(s) read their training data more than once" in capsys.readouterr().err
    # within one epoch: the column, no flag
    for v in ("bf16", "mx"):
        cfg = root / v / "seed0" / "config.json"
        cfg.write_text(cfg.read_text().replace("1.64", "0.5"))
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "p")]) == 0
    md = (tmp_path / "p" / "compare.md").read_text()
    assert "Data repeats" not in md and "| bf16 | 0 | 100 | 0.50 |" in md


def test_each_run_gets_its_own_checkpoint_folder(tmp_path):
    # once every variant resumed the previous variant's checkpoint and trained nothing
    folder = tmp_path / "out" / "runs" / "mx" / "seed1"
    for vargs, extra in ((["--checkpoint.folder=ck"], []), ([], ["--checkpoint.folder", "ck"])):
        argv = compare.launcher.trainer_argv("c.toml", 10, True, vargs, extra, 1, folder)
        assert argv[-1] == f"--checkpoint.folder={Path('ck') / 'mx' / 'seed1'}"  # the last one counts
    off = ["--checkpoint.folder=ck", "--checkpoint.folder="]
    argv = compare.launcher.trainer_argv("c.toml", 10, True, [], off, 1, folder)
    assert not any(a.startswith("--checkpoint.folder=ck") for a in argv[-2:])  # no checkpoints asked for
    assert argv.count("--checkpoint.folder=") == 1  # a config's own folder is never shared either
    argv = compare.launcher.trainer_argv("c.toml", 10, True, [], [], 1, folder)
    assert "--checkpoint.folder=" in argv[:3]


def test_spread_of_one_value_has_no_std():
    assert compare.spread([1.5]) == {"n": 1, "mean": 1.5, "std": None, "min": 1.5, "max": 1.5}
    assert compare.spread([])["mean"] is None


def test_compare_reads_runs_and_writes_table_json_and_png(runs_root, tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = compare.main(["--runs", str(runs_root), "--variant", "bf16", "--variant", "mx", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["baseline"] == "bf16" and len(report["runs"]) == 7
    assert report["variants"]["mx"]["val"]["diff_pct"]["per_seed"] == pytest.approx(
        {"0": 2.0, "1": 0.0, "2": -1.0}
    )
    md = (out / "compare.md").read_text()
    assert "| mx | 3 | +0.33 | 1.53 | -1.00 | +2.00 |" in md  # val: mean, std, min, max
    assert "s0 +2.00, s1 +0.00, s2 -1.00" in md
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "# mxmoe compare" in capsys.readouterr().out
    # a run that compare saw fail is left out, with a warning
    (runs_root / "mx" / "seed3" / "command.json").write_text(json.dumps({"argv": [], "returncode": 1}))
    assert compare.main(["--runs", str(runs_root), "--out", str(out / "c")]) == 0
    assert len(json.loads((out / "c" / "compare.json").read_text())["runs"]) == 6
    assert "seed3 did not finish" in capsys.readouterr().err
    # another baseline, through the `mxmoe` command
    assert cli_main(["compare", "--runs", str(runs_root), "--baseline", "mx", "--out", str(out / "b")]) == 0
    assert json.loads((out / "b" / "compare.json").read_text())["baseline"] == "mx"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "{tmp}/nope"], "not a folder"),
        (["--runs", "{root}", "--variant", "fp8"], "no folder for variant(s) ['fp8']"),
        (["--runs", "{root}", "--baseline", "fp8"], "baseline='fp8'"),
        (["--runs", "{root}", "--tail-steps", "-1"], "--tail_steps=-1"),
        (["--runs", "{root}", "--", "--optimizer.lr=1"], "need --config"),
        (["--config", "debug_moe", "--variant", "a"], "expected at least 2"),
        (["--config", "debug_moe", "--variant", "a", "--variant", "a=--x.y=1"], "given twice"),
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--seeds", "1,1"],
            "a seed is given twice",
        ),
        (["--config", "{tmp}/none.toml", "--variant", "a", "--variant", "b"], "file not found"),
        (  # refused before any run (it was found after every run had trained)
            ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--baseline", "c"],
            "--baseline='c': not a --variant; expected one of ['a', 'b']",
        ),
        # refused before any run (they once ran the baseline, then failed in the variant's own runs)
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--seeds", "0,-1"],
            "--seeds: -1 is not a seed; expected 0 <= seed < 2**32",
        ),
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b=--training.stpes=3"],
            "--variant b: `mxmoe train` refuses its options",
        ),
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b=--optimizer.lr=-1"],
            "--variant b: optimizer.lr=-1.0: expected a finite number > 0",
        ),
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--", "--training.steps=0"],
            "arguments after `--`: training.steps=0: expected >= 1",
        ),
        (
            ["--config", "debug_moe", "--variant", "a", "--variant", "b=--debug.seed=3"],
            "'--debug.seed=3' is set by mxmoe compare",
        ),
        (  # the parallel degrees against --nproc: refused before any run (b failed after a's run)
            ["--config", "debug_moe", "--nproc", "2", "--variant", "a",
             "--variant", "b=--parallelism.expert_parallel_degree=4"],
            "--variant b: parallelism.expert_parallel_degree=4 must be >= 1 and divide the world size 2",
        ),
        (
            ["--config", "debug_moe", "--variant", "a",
             "--variant", "b=--parallelism.expert_parallel_degree=2"],
            "--variant b: parallelism.expert_parallel_degree=2 must be >= 1 and divide the world size 1",
        ),
        (
            ["--config", "debug_moe", "--nproc", "2", "--variant", "a", "--variant", "b", "--",
             "--parallelism.expert_parallel_degree=2", "--model.num_experts=3"],
            "arguments after `--`: parallelism.expert_parallel_degree=2 must divide model num_experts=3",
        ),
        (
            [
                "--config",
                "debug_moe",
                "--variant",
                "a",
                "--variant",
                "b",
                "--",
                "--job.dump_folder=x",
            ],
            "'--job.dump_folder=x' is set by mxmoe compare",
        ),
    ],
)
def test_errors_name_the_argument(runs_root, tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(REPO)
    argv = [a.format(tmp=tmp_path, root=runs_root) for a in argv]
    assert compare.main(["--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "runs").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_devices_without_a_gpu_are_refused(tmp_path, capsys):
    """--devices set CUDA_VISIBLE_DEVICES of GPUs that are not there: every run trained on the CPU."""
    argv = ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--devices", "0,1"]
    assert compare.main(["--out", str(tmp_path / "o"), *argv]) == 2
    assert "--devices=0,1: no CUDA GPU is available here" in capsys.readouterr().err
    assert not (tmp_path / "o" / "runs").exists()


@pytest.mark.parametrize(
    "devices, message",
    [
        ("0,2", "--devices=0,2: no GPU 2 here; this machine has 2 (0..1)"),
        ("1,1", "--devices=1,1: a device is named twice"),
    ],
)
def test_devices_not_on_this_machine_are_refused(tmp_path, capsys, monkeypatch, devices, message):
    """On a GPU host an index past its GPUs gave that run no GPU (it trained on the CPU), and a
    device named twice put two groups of runs on one GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    argv = ["--config", "debug_moe", "--variant", "a", "--variant", "b", "--devices", devices]
    assert compare.main(["--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "runs").exists()


def test_bad_variant_spelling_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(["--config", "c.toml", "--variant", "a b=--x", "--out", "o"])
    assert e.value.code == 2
    assert "expected NAME=ARGS" in capsys.readouterr().err
    assert compare.parse_variant("mx=--model.converters=mx --mx.filter_fqns='output,router'") == (
        "mx",
        ["--model.converters=mx", "--mx.filter_fqns=output,router"],
    )
    assert compare.parse_variant("bf16") == compare.parse_variant("bf16=") == ("bf16", [])


TINY = [
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_layers=1",
    "--model.num_experts=4",
    "--model.moe_hidden_dim=32",
    "--training.seq_len=32",
    "--training.local_batch_size=2",
    "--lr_scheduler.warmup_steps=1",
    "--validation.freq=3",
    "--validation.steps=1",
    "--data.max_files=6",
    "--metrics.log_freq=1",
    "--training.device=cpu",
]


def test_compare_runs_two_variants_by_two_seeds_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "cmp"
    argv = ["--config", "debug_moe", "--steps", "3", "--seeds", "0,1", "--out", str(out)]
    argv += [
        "--variant",
        "hp=--model.converters=",
        "--variant",
        "mx=--model.converters=mx --mx.filter_fqns=output",
    ]
    argv += ["--parallel", "2", "--", *TINY]
    assert compare.main(argv) == 0
    report = json.loads((out / "compare.json").read_text())
    order = [(r["variant"], r["seed"]) for r in report["runs"]]
    assert order == [("hp", 0), ("mx", 0), ("hp", 1), ("mx", 1)]  # seed-major
    for r in report["runs"]:
        folder = out / "runs" / r["variant"] / f"seed{r['seed']}"
        recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["debug"]["seed"] == r["seed"] and cfg["debug"]["deterministic"] is True
        assert cfg["training"]["steps"] == 3 and cfg["checkpoint"]["folder"] == ""
        assert cfg["model"]["converters"] == ([] if r["variant"] == "hp" else ["mx"])
        if r["variant"] == "mx":
            assert cfg["mx"]["filter_fqns"] == ["output"]
        assert r["final_train_loss"] == recs[-1]["loss"] and r["final_val_loss"] == recs[-1]["val_loss"]
        assert json.loads((folder / "command.json").read_text())["returncode"] == 0
    d = report["variants"]["mx"]["val"]["diff_pct"]["per_seed"]
    runs = {(r["variant"], r["seed"]): r for r in report["runs"]}
    for s in (0, 1):
        hp, mx = runs[("hp", s)]["final_val_loss"], runs[("mx", s)]["final_val_loss"]
        assert d[str(s)] == pytest.approx((mx - hp) / hp * 100)
    assert (out / "compare.png").is_file()
    capsys.readouterr()
    # the same command again: every run is found done, the report is the same
    assert compare.main(argv) == 0
    assert capsys.readouterr().out.count("done before") == 4
    again = json.loads((out / "compare.json").read_text())
    assert again["variants"] == report["variants"]


def test_launch_runs_an_expert_parallel_job_under_torch_distributed_run(tmp_path, monkeypatch):
    """--nproc 2: one run as 2 gloo ranks (ep = 2) under torch.distributed.run; done once."""
    monkeypatch.chdir(REPO)
    folder = tmp_path / "ep2" / "seed0"
    argv = compare.launcher.trainer_argv(
        "debug_moe", 2, True, ["--parallelism.expert_parallel_degree=2"], TINY, 0, folder
    )
    job = ("ep2", 0, argv, folder)
    assert compare.launch([job], parallel=1, devices=None, nproc=2) == {("ep2", 0): compare.DONE}
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["parallelism"]["expert_parallel_degree"] == 2
    assert "world 2 (ep 2)" in (folder / "train.log").read_text()
    assert [json.loads(x)["step"] for x in (folder / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((folder / "command.json").read_text())["nproc"] == 2
    before = (folder / "metrics.jsonl").stat().st_mtime_ns
    assert compare.launch([job], parallel=1, devices=None, nproc=2) == {("ep2", 0): compare.DONE}
    assert (folder / "metrics.jsonl").stat().st_mtime_ns == before  # not run again


def test_time_limit_stops_the_running_run_and_starts_no_other(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    jobs = []
    for v in ("long", "next"):
        folder = tmp_path / v / "seed0"
        argv = compare.launcher.trainer_argv("debug_moe", 100_000, False, [], TINY, 0, folder)
        jobs.append((v, 0, argv, folder))
    # a limit that ends the first run in its start-up or its first steps: either way it is stopped
    status = compare.launch(jobs, parallel=1, devices=None, time_limit_s=3)
    assert status == {("long", 0): "stopped at the time limit", ("next", 0): "not started (time limit)"}
    rec = json.loads((tmp_path / "long" / "seed0" / "command.json").read_text())
    assert rec["stopped"] is True and rec["seconds"] < 3 + 130
    assert not (tmp_path / "next").exists()
    assert compare.report.run_failed(tmp_path / "long" / "seed0")


def test_a_done_run_whose_metrics_are_gone_runs_again(tmp_path, monkeypatch, capsys):
    """A run recorded as done whose metrics.jsonl was removed since is run again (it was skipped as
    done, and the tables then failed on the missing file)."""
    monkeypatch.chdir(REPO)
    folder = tmp_path / "a" / "seed0"
    job = ("a", 0, compare.launcher.trainer_argv("debug_moe", 1, False, [], TINY, 0, folder), folder)
    assert compare.launch([job], parallel=1, devices=None) == {("a", 0): compare.DONE}
    (folder / "metrics.jsonl").unlink()
    capsys.readouterr()
    assert compare.launch([job], parallel=1, devices=None) == {("a", 0): compare.DONE}
    assert "done before, but its metrics.jsonl is gone" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (folder / "metrics.jsonl").read_text().splitlines()] == [1]


def test_tokens_per_s_leaves_out_the_first_record_of_each_start(tmp_path):
    """A resumed run (a run_id of its own from step 60): its first record after the resume holds start-up
    and compilation like the run's first, and the median leaves both out (it took the resume's in)."""
    recs = _records([2.0, 1.5, 1.2, 1.0], 1.6, [1.0, 10, 10, 10, 10, 1.0, 200, 200, 200, 200, 200])
    for r in recs:
        r["run_id"] = "a" if r["step"] <= 50 else "b"
    _write_run(tmp_path / "bf16" / "seed0", 0, recs)
    r = compare.run_summary("bf16", 0, tmp_path / "bf16" / "seed0")
    # left out: step 10 (a's first) and step 60 (b's first): 10 x 4 and 200 x 5 (with step 60's 1.0
    # the median was 105)
    assert r.tokens_per_s == 200
