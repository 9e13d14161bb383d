"""The profile breakdowns: `mxmoe bench trace` sums a Chrome trace's GPU events by kernel category
per ProfilerStep; `cast_breakdown` sorts the MX cast operators by what they cast."""

from __future__ import annotations

import json

import pytest
import torch

from mxmoe.bench import trace
from mxmoe.train.profiling import cast_breakdown


def _trace(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#9", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#10", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#11", "ts": 200, "dur": 5},  # no launch
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 2},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150, "dur": 2},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "dur": 3000},
        {"ph": "X", "cat": "kernel", "name": "void (anonymous namespace)::qdq_dim1_kernel<0>", "dur": 400},
        {"ph": "X", "cat": "kernel", "name": "void (anonymous namespace)::qdq_dim0_kernel<0>", "dur": 200},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000},  # host time: not GPU time
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "dur": 40},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 70, "dur": 4},  # no wait
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 160, "dur": 2},
        {"ph": "i", "cat": "kernel", "name": "a marker", "dur": 7},  # not a complete event
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_breakdown_per_step_by_category(tmp_path, capsys):
    r = trace.breakdown(json.loads(_trace(tmp_path).read_text()))
    assert r["steps"] == 2
    assert r["ms_per_step"] == pytest.approx(
        {"gemm": 1.5, "mx cast / qdq": 0.3, "copy / index / pad": 0.05, "total": 1.85}
    )
    assert list(r["cast_kernels"].values()) == pytest.approx([0.2, 0.1])  # largest first
    # the host's side: the two counted steps' wall time (the empty third is not a step), operators,
    # launches (runtime and driver), every API call and its µs, the one call that waits for the GPU
    assert r["host_per_step"] == pytest.approx(
        {"wall_ms": 0.1, "operator_calls": 1.0, "kernel_launches": 1.5, "cuda_api_calls": 2.5,
         "cuda_api_us": 20.0, "gpu_waits": 0.5}
    )
    out = tmp_path / "b.json"
    assert trace.main([str(_trace(tmp_path)), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mx cast / qdq" in printed and "the host, per step" in printed and "gpu_waits" in printed
    assert json.loads(out.read_text())["traces"][str(_trace(tmp_path))]["steps"] == 2


def test_trace_that_is_not_a_trace_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="x.json.*Chrome trace"):
        trace.main([str(bad)])


def test_trace_without_gpu_events_is_refused_and_array_traces_are_read(tmp_path):
    for name, data in [("obj.json", {"traceEvents": []}), ("arr.json", []), ("num.json", 5)]:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(SystemExit, match=f"{name}' holds no GPU kernel, copy or memset"):
            trace.main([str(path)])
    # the JSON Array Format: the same events as the object's
    events = json.loads(_trace(tmp_path).read_text())["traceEvents"]
    assert trace.breakdown(events) == trace.breakdown({"traceEvents": events})
    assert trace.breakdown(events)["ms_per_step"]["total"] == pytest.approx(1.85)
    # no ProfilerStep range: GPU time over one step, and no wall time to give
    r = trace.breakdown([e for e in events if not e["name"].startswith("ProfilerStep")])
    assert r["steps"] == 1 and r["host_per_step"]["wall_ms"] is None


def test_cast_breakdown_sorts_casts_by_what_they_cast():
    """Weights by their shape, the forward's casts (its thread) as activations; on CPU the backward
    runs on the same thread, so a thread no event ran on makes every other cast a gradient."""
    from torch.profiler import ProfilerActivity, profile

    from mxmoe.ops import mx_mm
    from mxmoe.recipe import MXRecipe

    r = MXRecipe(dim0_kernel="torch", dim1_kernel="torch")
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.profiler.record_function("steps"):
            mx_mm(x, w.t(), r).sum().backward()
    main = next(e.thread for e in prof.events() if e.name == "steps")
    roles = cast_breakdown(prof, {tuple(w.shape)}, main)
    assert {"weights", "activations"} <= set(roles) and "gradients" not in roles
    assert any(k.startswith("weights: mxmoe::qdq") for k in roles)
    roles = cast_breakdown(prof, {tuple(w.shape)}, -1)
    assert "gradients" in roles and "activations" not in roles


def test_profile_breakdown_script_shows_no_earlier_calls_files(tmp_path):
    """scripts/gpu/profile_breakdown.sh printed (and packed) every table in OUT/<config>/ and kept
    OUT/<config>.json: an earlier call's, where this call's bench wrote none, passed for its result."""
    import os
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    out = tmp_path / "out"
    (out / "no_such_config").mkdir(parents=True)
    (out / "no_such_config" / "mx_eager.txt").write_text("mx, eager\nEARLIER CALL\n")
    (out / "no_such_config.json").write_text('{"rows": [{"tokens_per_s": 1}]}')
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    script = Path(__file__).parents[2] / "scripts/gpu/profile_breakdown.sh"
    proc = subprocess.run(["bash", str(script), str(out), "no_such_config", "eager", "0"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert "rc=2" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]  # the bench refused the config
    assert "EARLIER CALL" not in proc.stdout
    assert not (out / "no_such_config.json").exists()
    assert not (out / "no_such_config" / "mx_eager.txt").exists()
    assert (out / "results.tar.gz").is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    with tarfile.open(out / "results.tar.gz") as tar:
        assert not {"./no_such_config.json", "./no_such_config/mx_eager.txt"} & set(tar.getnames())


@pytest.mark.parametrize(
    "i, name, field, value",
    [(1, "gemm_kernel", "dur", None), (0, "cudaLaunchKernel", "ts", "a"),
     (0, "cudaLaunchKernel", "dur", True)],
)
def test_trace_event_with_a_time_that_is_not_a_number_is_named(tmp_path, i, name, field, value):
    """A ts or dur that is not a number was a TypeError / ValueError traceback from float()."""
    events = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 2},
              {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "ts": 1, "dur": 3}]
    events[i][field] = value
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(SystemExit, match=rf"t.json' is not a torch.profiler Chrome trace: event "
                       rf"'{name}': {field}={value!r}, expected a number"):
        trace.main([str(path)])


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "usage: profile_breakdown.sh OUT"),
        (["OUT", "debug_moe", "eager", "yes"], {}, "TT=yes: expected 1 (profile torchtitan too) or 0"),
        (["OUT", "debug_moe", "eager", "0"], {"LIMIT": "5m"}, "LIMIT=5m: expected seconds per step >= 1"),
        (["/proc/pb", "debug_moe", "eager", "0"], {}, "OUT=/proc/pb: cannot create or write in the folder"),
    ],
)
def test_profile_breakdown_script_refuses_bad_arguments_first(tmp_path, args, env, message):
    """TT=yes skipped torchtitan silently, LIMIT=5m failed every step in `timeout`, an OUT that could
    not be created put the files under / (each with exit 0)."""
    import os
    import subprocess
    from pathlib import Path

    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    script = Path(__file__).parents[2] / "scripts/gpu/profile_breakdown.sh"
    proc = subprocess.run(["bash", str(script), *args], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()
