"""scripts/torchtitan_ep.py's bookkeeping (no GPU, no torchtitan): which runs count as failed and
which files stand for this call's results."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import torchtitan_ep  # noqa: E402


def test_an_a2a_bench_that_stops_or_fails_leaves_no_a2a_json(tmp_path, monkeypatch):
    """An earlier call's a2a.json stood for this call's when the bench timed out (exit 124, which
    counted as done) or failed before writing it."""
    for rc in (124, 1):
        (tmp_path / "a2a.json").write_text(json.dumps({"rows": [{"speedup": 9.9}]}))
        monkeypatch.setattr(torchtitan_ep, "run", lambda cmd, log, timeout, rc=rc: rc)
        argv = [str(tmp_path), "2", "--runs", "a2a", "--data", str(tmp_path), "--tokenizer", str(tmp_path)]
        assert torchtitan_ep.main(argv) == 1, rc
        assert not (tmp_path / "a2a.json").exists(), rc


def test_a_bench_that_writes_its_json_is_done(tmp_path, monkeypatch):
    def run(cmd, log, timeout):
        Path(cmd[cmd.index("--json") + 1]).write_text("{}")
        return 0

    monkeypatch.setattr(torchtitan_ep, "run", run)
    argv = [str(tmp_path), "2", "--runs", "a2a", "--data", str(tmp_path), "--tokenizer", str(tmp_path)]
    assert torchtitan_ep.main(argv) == 0
    assert (tmp_path / "a2a.json").read_text() == "{}"
