"""What `mxmoe compare` and `mxmoe plot` read and write, refused or named when wrong: each run's own
recorded config (not the folder's first run's), a run folder without metrics, an empty or non-UTF-8
metrics file, an --out that is a device, a file or read-only, an edited --config run again; and the
trainer's metrics folder errors naming the file at fault."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from mxmoe.train import compare, plot
from mxmoe.train.metrics import MetricsError, MetricsWriter


def _records(n: int, run_id: str | None, loss: float = 2.0) -> list[dict]:
    recs = [{"step": s, "loss": loss + 1 / s, "loss_steps": 1, "val_loss": loss} for s in range(1, n + 1)]
    return [{**r, "run_id": run_id} if run_id else r for r in recs]


def _write(folder: Path, records: list[dict], **configs: dict) -> Path:
    """A run folder: metrics.jsonl of `records` and each config file name -> its content."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name, cfg in configs.items():
        (folder / name.replace("_", ".")).write_text(json.dumps(cfg))
    return folder


def _config(run_id: str, seed: int, corpus: str) -> dict:
    return {
        "run_id": run_id,
        "debug": {"seed": seed},
        "training": {"steps": 4, "seq_len": 32},
        "corpus": {"sha256": corpus, "source": "/data"},
        "epochs": {"global_batch": 2, "epochs": 0.5},
    }


def test_a_retrained_run_is_read_with_its_own_config(tmp_path, capsys):
    """A second run in a folder writes config.<run_id>.json beside the first run's config.json; its
    records are the metrics. compare and plot read that run's seed and corpus: the old seed once
    paired it with the wrong baseline and the old corpus passed the check of like data."""
    root = tmp_path / "runs"
    _write(root / "base" / "a", _records(4, "b0"), config_json=_config("b0", 1, "c" * 64))
    _write(
        root / "mx" / "a",
        _records(4, "new"),
        config_json=_config("old", 0, "c" * 64),
        **{"config_new_json": _config("new", 1, "d" * 64)},
    )
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "runs of different setups cannot be paired" in err and "corpus 'dddd" in err, err
    mx = compare.report.read_runs(root, ["mx"])[0]
    assert mx.seed == 1 and mx.setup["corpus"] == "d" * 64
    assert plot.read_config(str(root / "mx" / "a"), mx.records)["run_id"] == "new"


def test_records_of_a_run_whose_config_is_missing_are_refused(tmp_path, capsys):
    run = _write(tmp_path / "r", _records(3, "new"), config_json=_config("old", 0, "c" * 64))
    assert plot.main([str(run), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "its records were written by run new, but" in err and "config.new.json" in err, err
    # records without a run_id (an earlier mxmoe) keep reading config.json
    old = _write(tmp_path / "o", _records(3, None), config_json=_config("old", 5, "c" * 64))
    assert plot.read_config(str(old), plot.read_metrics(str(old)))["debug"]["seed"] == 5


def test_a_run_folder_without_metrics_is_an_error(tmp_path, capsys):
    root = tmp_path / "runs"
    for v in ("base", "mx"):
        _write(root / v / "seed0", _records(4, "x"), config_json=_config("x", 0, "c" * 64))
    (root / "mx" / "seed1").mkdir()  # a run that never wrote its metrics
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"run folder {str(root / 'mx' / 'seed1')!r} has no metrics.jsonl" in err, err
    # a run compare saw fail is still left out with a warning
    (root / "mx" / "seed1" / "command.json").write_text(json.dumps({"returncode": 1}))
    assert compare.main(["--runs", str(root), "--out", str(tmp_path / "out")]) == 0
    assert "did not finish (command.json): left out" in capsys.readouterr().err


def test_plotting_an_empty_metrics_file_is_an_error(tmp_path, capsys):
    run = _write(tmp_path / "r", [])
    assert plot.main([str(run), "--out", str(tmp_path / "p.png")]) == 2
    assert "its metrics file has no records: nothing to plot" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
    # records without a loss (other files' records, or every loss not finite): no empty figure
    run = _write(tmp_path / "s", [{"step": 1}, {"step": 2, "loss": None, "grad_norm": None}])
    assert plot.main([str(run), "--out", str(tmp_path / "p.png")]) == 2
    assert "none of its 2 records has a loss or val_loss" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_a_metrics_file_not_utf8_names_file_and_line(tmp_path, capsys):
    run = _write(tmp_path / "r", _records(2, None))
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 3, "loss": 1.0, "note": "caf\xe9"}\n')
    assert plot.main([str(run), "--out", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}:3: not UTF-8 text" in err and "Traceback" not in err, err
    # the trainer resuming into that folder: the same, as its error
    with pytest.raises(MetricsError, match=r"metrics.jsonl:3 is not UTF-8 text"):
        MetricsWriter(str(run), True, False, {}, "rid", start_step=1)


def _unwritable(tmp_path: Path) -> list[tuple[str, str]]:
    """(--out value, what the error says) for a device, a path under a file and (not as root) a
    read-only folder."""
    (tmp_path / "a_file").write_text("")
    cases = [("/dev/null", "is a character device"), (str(tmp_path / "a_file" / "out"), "is a file")]
    if os.geteuid() != 0:  # root writes in a read-only folder
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        cases.append((str(ro / "out"), "cannot write in"))
    return cases


def test_compare_out_is_checked_before_reading_or_running(tmp_path, capsys):
    root = tmp_path / "runs"
    for v in ("base", "mx"):
        _write(root / v / "seed0", _records(4, "x"), config_json=_config("x", 0, "c" * 64))
    for out, what in _unwritable(tmp_path) + [(str(tmp_path / "a_file"), "is a file, expected a folder")]:
        assert compare.main(["--runs", str(root), "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"mxmoe compare: error: --out {out!r}: " in err and what in err and "Traceback" not in err, err


def test_plot_out_is_checked_before_plotting(tmp_path, capsys):
    run = _write(tmp_path / "r", _records(3, None))
    for out, what in _unwritable(tmp_path) + [(str(tmp_path), "is a folder, expected a file path")]:
        assert plot.main([str(run), "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"mxmoe plot: error: --out {out!r}: " in err and what in err and "Traceback" not in err, err


def test_a_dropped_records_file_that_is_a_folder_is_named(tmp_path):
    run = _write(tmp_path / "r", _records(3, "x"))
    (run / "metrics.dropped.jsonl").mkdir()
    with pytest.raises(MetricsError) as e:
        MetricsWriter(str(run), True, False, {}, "rid", start_step=1)
    msg = str(e.value)
    assert "cannot write metrics.dropped.jsonl" in msg
    assert "metrics.dropped.jsonl is a folder: move it aside" in msg
    assert "free space" not in msg


class _FakeTrainer:
    """Stands in for `python -m mxmoe train`: writes a run's config and one record, exits 0."""

    started: list = []

    def __init__(self, cmd, stdout=None, stderr=None, env=None):
        argv = cmd[cmd.index("train") + 1 :]
        folder = Path(next(a for a in argv if a.startswith("--job.dump_folder=")).split("=", 1)[1])
        seed = int(next(a for a in argv if a.startswith("--debug.seed=")).split("=", 1)[1])
        (folder / "config.json").write_text(json.dumps({"run_id": "r", "debug": {"seed": seed}}))
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "run_id": "r"}) + "\n")
        self.returncode = 0
        _FakeTrainer.started.append(folder)

    def wait(self, timeout=None):
        return 0


def test_compare_runs_an_edited_config_again(tmp_path, monkeypatch, capsys):
    """`mxmoe compare --config my.toml` after editing my.toml: its runs run again (once they were
    "done before", their old tables shown)."""
    monkeypatch.setattr(subprocess, "Popen", _FakeTrainer)
    cfg = tmp_path / "my.toml"
    cfg.write_text("[training]\nsteps = 3\n")
    argv = ["--config", str(cfg), "--variant", "a", "--variant", "b", "--out", str(tmp_path / "out")]
    _FakeTrainer.started = []
    assert compare.main(argv) == 0 and len(_FakeTrainer.started) == 2
    assert compare.main(argv) == 0 and len(_FakeTrainer.started) == 2  # unchanged: done before
    assert capsys.readouterr().out.count("done before") == 2
    cfg.write_text("[training]\nsteps = 4\n")
    assert compare.main(argv) == 0 and len(_FakeTrainer.started) == 4
    out = capsys.readouterr().out
    assert "done before" not in out and out.count("config changed since it ran") == 2, out
