"""`mxmoe plot`: runs named by variant and seed from their recorded configs, one curve (mean, band)
per variant, a difference panel titled by what it subtracts."""

import json

import pytest

from mxmoe.train.plot import Series, figure, main, read_metrics, variant_names

pytest.importorskip("matplotlib")


def _run(folder, offset, config=None):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for s in range(1, 21):
            rec = {"step": s, "loss": 5.0 / s + offset, "tokens_per_s": 1.0, "memory_gib": 0.1}
            if s % 10 == 0:
                rec["val_loss"] = rec["loss"] + 0.1
            fh.write(json.dumps(rec) + "\n")
    if config is not None:
        (folder / "config.json").write_text(json.dumps({"run_id": "x", **config}))
    return folder


def _config(converters, seed, recipe="mxfp8_rceil", folder="runs/x"):
    return {
        "job": {"dump_folder": folder},
        "model": {"name": "debug_moe", "converters": converters},
        "mx": {"recipe_name": recipe},
        "training": {"mixed_precision": "bf16"},
        "debug": {"seed": seed},
    }


def test_plot_png(tmp_path, capsys):
    a, b = _run(tmp_path / "bf16", 0.0), _run(tmp_path / "mxfp8", 0.01)
    out = tmp_path / "out" / "loss.png"
    assert (
        main([str(a), str(b / "metrics.jsonl"), "--out", str(out), "--labels", "bf16,mx", "--smooth", "0.5"])
        == 0
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert len(read_metrics(str(a))) == 20


def test_variant_and_seed_come_from_the_recorded_configs(tmp_path, capsys):
    """Two runs in folders both named seed0 (issue 48: both were labelled "seed0"): the variants are
    what their configs set apart, the seeds are debug.seed (training.seed in older records)."""
    bf16 = _run(tmp_path / "bf16" / "seed0", 0.0, _config([], 0, folder="a"))
    old = _config(["mx"], 0, folder="b")
    old["training"]["seed"] = old.pop("debug")["seed"]  # recorded before debug.seed
    mx = _run(tmp_path / "mx" / "seed0", 0.01, old)
    assert main([str(bf16), str(mx), "--out", str(tmp_path / "p.png")]) == 0
    configs = [json.loads((f / "config.json").read_text()) for f in (bf16, mx)]
    assert variant_names(configs, ["seed0", "seed0"]) == ["bf16", "mx"]
    floor = _config(["mx"], 0, recipe="mxfp8")
    names = variant_names([configs[1], floor], ["a", "b"])
    assert names == ["recipe_name=mxfp8_rceil", "recipe_name=mxfp8"]
    assert variant_names([configs[0], floor], ["a", "b"]) == ["bf16", "mx recipe_name=mxfp8"]
    assert variant_names([None], ["seed0"]) == ["seed0"]
    # what the trainer records beside the config (corpus, epochs) follows from it: not a name
    longer = _config(["mx"], 0, recipe="mxfp8")
    floor["training"]["steps"], longer["training"]["steps"] = 100, 200
    for c, steps in ((floor, 100), (longer, 200)):
        c["corpus"] = {"sha256": "a" * 64, "files": 3, "skipped": {}}
        c["epochs"] = {"steps": steps, "run_tokens": steps * 64, "epochs": steps / 100}
    assert variant_names([floor, longer], ["a", "b"]) == ["steps=100", "steps=200"]


def test_one_curve_per_variant_and_a_titled_difference_panel():
    """2 variants x 3 seeds: 2 training curves (the mean) with bands, not 6 lines and a 12-entry
    legend; the difference panel says what is subtracted."""
    def records(v, s):
        return [{"step": k, "loss": 3.0 / k + 0.01 * s + (0.02 if v == "mx" else 0.0)} for k in range(1, 11)]

    fig = figure([Series(v, s, records(v, s)) for v in ("bf16", "mx") for s in range(3)])
    loss_ax, diff_ax = fig.axes
    labels = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert labels == ["bf16: train, mean of 3 seeds (0,1,2)", "mx: train, mean of 3 seeds (0,1,2)"]
    assert len(loss_ax.collections) == 2  # the bands
    assert diff_ax.get_title() == "mx − bf16, per seed (thin) and their mean (thick)"
    legend = [t.get_text() for t in diff_ax.get_legend().get_texts()]
    assert legend == ["mx − bf16: train, mean of 3 seeds (0,1,2)"]
    mean = diff_ax.get_lines()[3]  # 3 per-seed lines, then their mean: (mx - bf16) / bf16 in %
    expected = [sum(0.02 / (3.0 / k + 0.01 * s) * 100 for s in range(3)) / 3 for k in range(1, 11)]
    assert list(mean.get_xdata()) == list(range(1, 11))
    assert max(abs(a - b) for a, b in zip(mean.get_ydata(), expected, strict=True)) < 1e-9


def test_plot_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    a = _run(tmp_path / "a", 0.0)
    assert main([str(a), "--labels", "x,y", "--out", str(tmp_path / "x.png")]) == 2
    assert main([str(a), "--baseline", "nope", "--out", str(tmp_path / "x.png")]) == 2
    assert "baseline='nope': no run of that variant" in capsys.readouterr().err
    b = _run(tmp_path / "b" / "seed0", 0.0, _config([], 0))
    c = _run(tmp_path / "c" / "seed0", 0.0, _config([], 0))
    assert main([str(b), str(c), "--out", str(tmp_path / "x.png")]) == 2
    assert "both variant 'bf16', seed 0: give --labels" in capsys.readouterr().err
    assert main([str(b), str(c), "--labels", "x,", "--out", str(tmp_path / "x.png")]) == 2
    assert "labels='x,': name 2 is empty; give every run a name" in capsys.readouterr().err
    # an --out matplotlib cannot write: named (it was matplotlib's "Format 'txt' is not supported")
    assert main([str(a), "--out", str(tmp_path / "x.txt")]) == 2
    err = capsys.readouterr().err
    assert f"--out '{tmp_path / 'x.txt'}': expected a file name ending in an image format, one of [" in err
    assert "'png'" in err and not (tmp_path / "x.txt").exists()


def test_an_out_without_a_suffix_is_the_png_written(tmp_path, capsys):
    # matplotlib appended ".png" while the command printed (and checked) the name given
    a = _run(tmp_path / "a", 0.0)
    out = tmp_path / "curves"
    assert main([str(a), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "curves.png").exists()


def test_resumed_run_records_are_deduplicated(tmp_path):
    """A resumed run appends steps it had already logged: the later record of a step wins."""
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": v} for s, v in [(1, 3.0), (2, 2.5), (2, 2.4), (3, 2.0)]]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in got] == [(1, 3.0), (2, 2.4), (3, 2.0)]


def test_metrics_files_without_configs_are_named_by_their_folders(tmp_path):
    """Two runs' metrics.jsonl files, no config.json: named bf16 and mx by their folders (seedN folders
    by their parents), not both "metrics", which drew them as two seeds of one variant."""
    from mxmoe.train.plot import _fallback_name

    a, b = _run(tmp_path / "bf16", 0.0), _run(tmp_path / "mx" / "seed3", 0.01)
    assert _fallback_name(str(a / "metrics.jsonl")) == "bf16"
    assert _fallback_name(str(b / "metrics.jsonl")) == "mx"
    other = tmp_path / "loss_curve.jsonl"
    other.write_text((a / "metrics.jsonl").read_text())
    assert _fallback_name(str(other)) == "loss_curve"
