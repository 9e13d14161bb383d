"""scripts/fsdp_mx_gather.py (issue 58's 2/4/8-GPU comparison) end to end on CPU with 2 gloo ranks,
and its GPU command lines for 2, 4 and 8 GPUs."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import fsdp_mx_gather  # noqa: E402


def test_gpu_commands_for_2_4_8_gpus(tmp_path):
    for n in (2, 4, 8):
        cmds = fsdp_mx_gather.commands(tmp_path, n, steps=30, device="cuda", config="moe_1b")
        assert sorted(cmds) == sorted([*fsdp_mx_gather.MXMOE, *fsdp_mx_gather.TITAN])
        for name, cmd in cmds.items():
            assert cmd[cmd.index("--nproc_per_node") + 1] == str(n)
            assert ("--compile.enable=true" if name in fsdp_mx_gather.MXMOE else "--compile.enable") in cmd
        assert "--mx.fsdp_mxfp8_all_gather=true" in cmds["mxmoe_mx_gather"]
        assert "--mx.fsdp_mxfp8_all_gather" in cmds["titan_mx_gather"]
        assert not any("fsdp_mxfp8" in a for a in cmds["mxmoe_mx"] + cmds["titan_mx"])


@pytest.mark.slow
def test_script_runs_end_to_end_on_cpu_with_gloo(tmp_path):
    rows = fsdp_mx_gather.main([str(tmp_path), "--ngpu", "2", "--device", "cpu", "--steps", "2"])
    assert sorted(rows) == sorted(fsdp_mx_gather.MXMOE)
    for name, r in rows.items():
        assert r["rc"] == 0 and r["tokens_per_s"] > 0 and r["all_gather_ms"] > 0, (name, r)
    assert "weights gather MXFP8" in (tmp_path / "mxmoe_mx_gather.log").read_text()
    assert "| mxmoe_mx_gather | 0 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_cast_bench_runs_on_cpu():
    """scripts/fsdp_mx_gather_cast.py (issue 58, item 4) end to end on CPU: at N=2 every MX weight of
    debug_moe gathers MXFP8 with (1 + 1/32) / 2 of bf16's bytes (and a one-byte layout tag per
    weight and gather); at N=8 half of them stay bf16."""
    import fsdp_mx_gather_cast

    r = fsdp_mx_gather_cast.main(["--config", "debug_moe", "--world", "2", "--device", "cpu", "--iters", "1"])
    assert r["mx_weights_mxfp8_gather"] == 12 and r["mx_weights_high_precision_gather"] == 0
    assert (r["gather_bytes_mxfp8"] - 12 * 2) * 64 == r["gather_bytes_bf16"] * 33
    assert r["today_ms"] > 0 and r["option_shard_casts_ms"] > 0 and r["option_gathered_use_ms"] > 0
    r = fsdp_mx_gather_cast.main(["--config", "debug_moe", "--world", "8", "--device", "cpu", "--iters", "1"])
    assert r["mx_weights_mxfp8_gather"] == 6 and r["mx_weights_high_precision_gather"] == 6
    assert r["option_other_weights_ms"] > 0


def _trace(path: Path, ms: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": [
        {"name": "ncclDevKernel_AllGather_RING_LL", "cat": "kernel", "dur": ms * 1e3}]}))


def test_an_earlier_calls_trace_and_metrics_are_not_this_runs(tmp_path):
    """A run's folder keeps an earlier call's files: its trace of a later step (--steps 30, now 4) was
    the one read, and a run that wrote no metrics got the earlier call's tokens/s."""
    old = time.time() - 3600
    _trace(tmp_path / "profile_traces" / "rank0_step00000030.json", 9.0)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tokens_per_s": 5.0}\n')
    for f in (tmp_path / "profile_traces" / "rank0_step00000030.json", tmp_path / "metrics.jsonl"):
        os.utime(f, (old, old))
    t0 = time.time()
    assert fsdp_mx_gather.all_gather_ms(tmp_path, t0) is None
    assert fsdp_mx_gather.tokens_per_s("mxmoe_mx", tmp_path, "", t0) is None
    _trace(tmp_path / "profile_traces" / "rank0_step00000004.json", 2.0)
    assert fsdp_mx_gather.all_gather_ms(tmp_path, t0) == 2.0
