"""`mxmoe plot --labels a,a` over two runs of the same seed: the error told the user to "give
--labels", which they had; it names the labels given and asks for different ones."""

import json

import pytest

from mxmoe.train.plot import main

pytest.importorskip("matplotlib")


def _run(folder, seed):
    folder.mkdir(parents=True)
    recs = [{"step": s, "loss": 5.0 / s, "tokens_per_s": 1.0, "memory_gib": 0.1} for s in range(1, 6)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    config = {"run_id": "x", "model": {"name": "debug_moe", "converters": []}, "debug": {"seed": seed}}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_the_same_label_for_runs_of_one_seed_asks_for_different_labels(tmp_path, capsys):
    a, b = _run(tmp_path / "a", 0), _run(tmp_path / "b", 0)
    out = tmp_path / "x.png"
    assert main([a, b, "--labels", "v,v", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "both variant 'v', seed 0: --labels=v,v names both 'v': give them different labels" in err, err
    assert not out.exists()
    assert main([a, b, "--labels", "v,w", "--out", str(out)]) == 0
    assert out.is_file()


def test_one_label_for_two_seeds_is_one_variant(tmp_path):
    a, b = _run(tmp_path / "a", 0), _run(tmp_path / "b", 1)
    out = tmp_path / "y.png"
    assert main([a, b, "--labels", "v,v", "--out", str(out)]) == 0  # variant v, seeds 0 and 1
    assert out.is_file()
