"""`mxmoe plot` writes a PNG of several runs' loss curves."""

import json

from mxmoe.train.plot import main, read_metrics


def _run(folder, offset):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as fh:
        for s in range(1, 21):
            rec = {"step": s, "loss": 5.0 / s + offset, "tokens_per_s": 1.0, "memory_gib": 0.1}
            if s % 10 == 0:
                rec["val_loss"] = rec["loss"] + 0.1
            fh.write(json.dumps(rec) + "\n")
    return folder


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


def test_plot_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    a = _run(tmp_path / "a", 0.0)
    assert main([str(a), "--labels", "x,y", "--out", str(tmp_path / "x.png")]) == 2


def test_resumed_run_records_are_deduplicated(tmp_path):
    """A resumed run appends steps it had already logged: the later record of a step wins."""
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": v} for s, v in [(1, 3.0), (2, 2.5), (2, 2.4), (3, 2.0)]]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in got] == [(1, 3.0), (2, 2.4), (3, 2.0)]
