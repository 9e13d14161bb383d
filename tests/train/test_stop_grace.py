"""SIGTERM during a step that does not reach its end (training.stop_grace_s): the process ends
promptly with exit status 143 and one line naming the step, the checkpoints saved before stay
loadable; a step that ends within the grace still saves and exits 0. Each test runs `mxmoe train`
(TINY, checkpoints every 2 steps) in a subprocess whose 4th step is made slow or stuck."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trainer import TINY

from mxmoe.train.checkpoint import Checkpointer

REPO = Path(__file__).parents[2]

# `mxmoe train ARGV` whose 4th step first writes MARKER, then, by HOW: `python` loops in Python
# (sleeps of 10 ms, as a step spinning in Python code), `c` sleeps with SIGTERM blocked in the main
# thread (the Python handler never runs, as in a collective waiting in C++ for a peer; the watchdog
# thread, started before, gets it), `slow=S` takes S seconds more, then runs. UNWIND: the seconds the
# watchdog leaves the main thread to unwind before it ends the process (trainer.UNWIND_S).
SLOW_STEP = """
import pathlib, signal, sys, time
from mxmoe.train import trainer

marker, how, unwind, argv = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
trainer.UNWIND_S = unwind
real, calls = trainer._TrainStep.__call__, []

def step(self, x, y):
    calls.append(None)
    if len(calls) == 4:
        pathlib.Path(marker).write_text("in step 4")
        if how == "python":
            while True:
                time.sleep(0.01)
        elif how == "c":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            time.sleep(600)
        else:
            time.sleep(float(how.removeprefix("slow=")))
    return real(self, x, y)

trainer._TrainStep.__call__ = step
sys.exit(trainer.main(argv))
"""


def signal_in_step_4(tmp: Path, how: str, grace: float, signals: int = 1, unwind: float = 5.0):
    """Runs SLOW_STEP under `tmp`, sends SIGTERM `signals` times (0.3 s apart) once step 4 has begun:
    (exit status, stderr, seconds from the first SIGTERM to the exit, the run's folder)."""
    run = tmp / "run"
    argv = TINY + [
        f"--job.dump_folder={run}",
        f"--checkpoint.folder={run}/ckpt",
        "--checkpoint.interval=2",
        "--training.steps=1000",
        f"--training.stop_grace_s={grace}",
    ]
    marker = tmp / "in-step-4"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-c", SLOW_STEP, str(marker), how, str(unwind), *argv]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run did not reach step 4 in 120 s"
            time.sleep(0.05)
        t0 = time.monotonic()
        for i in range(signals):
            if i:
                time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        return proc.returncode, err, time.monotonic() - t0, run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def assert_step_2_kept(run: Path, err: str) -> None:
    """The checkpoint of step 2 is the last one, whole (it verifies), named by the error; step 4
    left nothing under a checkpoint's name."""
    ck = Checkpointer(str(run / "ckpt"))
    assert ck.latest() == run / "ckpt" / "step-00000002", sorted(p.name for p in (run / "ckpt").iterdir())
    ck.verify(ck.latest())
    assert ck.resume_path() == run / "ckpt" / "step-00000002"
    last = run / "ckpt" / "step-00000002"
    assert f"the last checkpoint is {last}, as it was (steps 3..4 are not saved)" in err, err


def test_a_step_stuck_in_python_past_the_grace_ends_the_run(tmp_path):
    """It ignored SIGTERM until the step's end, which never came: now, 1 s (the grace) after
    SIGTERM, StepAbandoned ends it: exit 143, one error line naming the step and the grace, no
    traceback, the step-2 checkpoint as it was."""
    rc, err, secs, run = signal_in_step_4(tmp_path, "python", grace=1)
    assert rc == 143, err
    said = (
        "mxmoe train: error: SIGTERM came during step 4, which did not finish within "
        "training.stop_grace_s=1 s: stopped without finishing it; "
    )
    assert err.strip().splitlines()[-1].startswith(said), err
    assert "mxmoe WARNING: SIGTERM during step 4: finishing it (training.stop_grace_s=1 s)" in err, err
    assert "Traceback" not in err, err
    assert 1.0 <= secs < 20.0, secs  # not the step's 600 s (slack for a loaded CI machine)
    assert_step_2_kept(run, err)


def test_a_second_sigterm_ends_a_stuck_step_at_once(tmp_path):
    """A grace of 60 s, and a second SIGTERM 0.3 s after the first: the run ends within seconds."""
    rc, err, secs, run = signal_in_step_4(tmp_path, "python", grace=60, signals=2)
    assert rc == 143, err
    said = "mxmoe train: error: a second SIGTERM during step 4: stopped at once without finishing it; "
    assert err.strip().splitlines()[-1].startswith(said), err
    assert secs < 30.0, secs  # not the 60 s grace
    assert_step_2_kept(run, err)


@pytest.mark.parametrize(
    "grace, signals, why, least",
    [
        (1, 1, "SIGTERM came during step 4, which did not finish within training.stop_grace_s=1 s", 2.0),
        (60, 2, "a second SIGTERM during step 4", 1.3),
    ],
)
def test_a_step_blocked_where_no_handler_runs_is_ended_by_the_watchdog(tmp_path, grace, signals, why, least):
    """The main thread waits where no handler runs (as in a collective waiting in C++): the watchdog,
    UNWIND_S (here 1 s) after the grace or after a second SIGTERM, writes why and ends the process."""
    rc, err, secs, run = signal_in_step_4(tmp_path, "c", grace=grace, signals=signals, unwind=1.0)
    assert rc == 143, err
    said = (
        f"mxmoe train: error: {why}, and the process still ran 1 s later (its main thread is blocked "
        "where no signal handler runs, e.g. in a collective or a kernel): exiting now; "
    )
    assert err.strip().splitlines()[-1].startswith(said), err
    assert least <= secs < least + 20.0, secs  # not the grace of 60 s / the step's 600 s
    assert_step_2_kept(run, err)


def test_a_slow_step_that_ends_within_the_grace_saves_and_stops(tmp_path):
    """SIGTERM during a step that takes 1.5 s more: as before, the step finishes, is saved and the run
    exits 0; the watchdog does nothing."""
    rc, err, secs, run = signal_in_step_4(tmp_path, "slow=1.5", grace=10)
    assert rc == 0, err
    assert "SIGTERM: stopped after step 4" in err and "mxmoe train: error" not in err, err
    assert 1.5 <= secs < 60, secs
    ck = Checkpointer(str(run / "ckpt"))
    assert ck.latest() == run / "ckpt" / "step-00000004"
    ck.verify(ck.latest())


@pytest.mark.parametrize("grace", ["0", "-1", "nan"])
def test_a_grace_that_is_not_positive_is_refused(tmp_path, capsys, grace):
    from mxmoe.train import trainer

    assert trainer.main(TINY + [f"--training.stop_grace_s={grace}", f"--job.dump_folder={tmp_path}"]) == 2
    err = capsys.readouterr().err
    said = f"mxmoe train: error: training.stop_grace_s={float(grace)!r}: expected a finite number > 0"
    assert said in err, err
    assert not (tmp_path / "metrics.jsonl").exists()
