"""What a person reads: plain progress lines when output is redirected, a bar only on a terminal,
the converter's report, an end-of-run summary, warnings naming the extra for missing packages."""

import json
import sys

import pytest
from test_trainer import MX, TINY, losses

from mxmoe.train import plot, trainer


def _run(tmp_path, *extra):
    return trainer.main(TINY + [f"--job.dump_folder={tmp_path / 'run'}", *extra])


def test_redirected_output_gets_plain_lines_a_summary_and_the_convert_report(tmp_path, capsys):
    args = MX + ["--training.steps=4", "--metrics.log_freq=2", "--metrics.progress_bar=true"]
    assert _run(tmp_path, *args, "--validation.freq=4", "--validation.steps=1") == 0
    out, err = capsys.readouterr()
    assert "\r" not in err and "train:" not in err  # no progress-bar frames when not on a terminal
    lines = out.splitlines()
    assert any("mxmoe.convert:" in x for x in lines), out
    step2 = next(x for x in lines if "step 2/4" in x)
    for field in ("loss", "lr", "grad_norm", "tokens/s", "memory", "GiB"):
        assert field in step2
    assert "val_loss" not in step2 and "val_loss" in next(x for x in lines if "step 4/4" in x)
    summary = lines[-1]
    assert "done: steps 1..4 of 4" in summary and "validation loss" in summary, summary
    assert "MXFP8 mxfp8_rceil in" in out


def test_progress_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _run(tmp_path, "--training.steps=2", "--metrics.progress_bar=true") == 0
    out, err = capsys.readouterr()
    assert "train:" in err and "2/2" in err  # the tqdm bar
    assert "step 1/2" not in out and "done: steps 1..2 of 2" in out  # the bar replaces the lines


def test_missing_tensorboard_is_a_warning_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    assert _run(tmp_path, "--training.steps=1", "--metrics.enable_tensorboard=true") == 0
    err = capsys.readouterr().err
    assert "tensorboard package is not installed" in err and "pip install 'mxmoe[tensorboard]'" in err
    assert sorted(losses(tmp_path / "run")) == [1]


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install 'mxmoe[plot]'" in err


def test_logged_training_loss_is_the_mean_over_the_interval(tmp_path):
    every = tmp_path / "every"
    assert trainer.main(TINY + ["--training.steps=4", f"--job.dump_folder={every}"]) == 0
    args = ["--training.steps=4", "--metrics.log_freq=2", f"--job.dump_folder={tmp_path}"]
    assert trainer.main(TINY + args) == 0
    per_step = losses(every)
    recs = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(recs) == [2, 4] and recs[4]["loss_steps"] == 2
    assert recs[2]["loss"] == pytest.approx((per_step[1] + per_step[2]) / 2, rel=1e-6)
    assert recs[4]["loss"] == pytest.approx((per_step[3] + per_step[4]) / 2, rel=1e-6)
