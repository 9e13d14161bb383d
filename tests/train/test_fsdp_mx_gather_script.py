"""scripts/fsdp_mx_gather.py (issue 58's 2/4/8-GPU comparison) end to end on CPU with 2 gloo ranks,
and its GPU command lines for 2, 4 and 8 GPUs."""

import sys
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
