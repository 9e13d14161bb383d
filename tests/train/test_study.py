"""What the numerics study (scripts/gpu/numerics_study.sh) relies on, on CPU (one test on a GPU):
a run's bits are the same alone and beside other runs; no final checkpoint with
checkpoint.last_save=false; the save time recorded and the grace taken from it; a run stopped at a
deadline keeps a loadable checkpoint."""

import json
import sys
from pathlib import Path

import pytest

from mxmoe.train import compare, trainer
from mxmoe.train.checkpoint import MANIFEST, Checkpointer, save_seconds

REPO = Path(__file__).parents[2]
TINY = [
    "--model.dim=32",
    "--model.n_heads=2",
    "--model.n_layers=1",
    "--model.num_experts=4",
    "--model.top_k=2",
    "--model.moe_hidden_dim=32",
    "--training.seq_len=32",
    "--training.local_batch_size=2",
    "--lr_scheduler.warmup_steps=2",
    "--validation.freq=2",
    "--validation.steps=1",
    "--metrics.log_freq=1",
    "--data.max_files=6",
    "--training.cpu_threads=1",
    "--training.device=cpu",
]
BITS = ("step", "loss", "aux_loss", "grad_norm", "lr", "val_loss")


def bits(folder: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in BITS) for r in recs]


def test_a_run_has_the_same_bits_alone_and_beside_another(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)

    def job(variant, vargs, where, extra=()):
        folder = tmp_path / where / variant / "seed0"
        argv = compare.launcher.trainer_argv("debug_moe", 4, True, vargs, [*TINY, *extra], 0, folder)
        return (variant, 0, argv, folder)

    # alone, with checkpoints at steps 2 and 4 that the finished run deletes (--delete-finished-checkpoints)
    ck = tmp_path / "ckpt"
    (ck / "other").mkdir(parents=True)
    alone = job("bf16", [], "alone", [f"--checkpoint.folder={ck}", "--checkpoint.interval=2"])
    assert compare.launch([alone], 1, None, delete_checkpoints=True) == {("bf16", 0): compare.DONE}
    assert "saved in" in (alone[3] / "train.log").read_text()
    assert not (ck / "bf16" / "seed0").exists()
    assert (ck / "other").is_dir()  # only the finished run's own folder
    pair = [job("bf16", [], "pair"), job("mx", ["--model.converters=mx", "--mx.filter_fqns=output"], "pair")]
    done = {("bf16", 0): compare.DONE, ("mx", 0): compare.DONE}
    assert compare.launch(pair, parallel=2, devices=None) == done
    ref = bits(alone[3])
    assert [r[0] for r in ref] == [1, 2, 3, 4] and ref[1][-1] is not None  # validation at step 2
    assert bits(pair[0][3]) == ref  # every float equal: same bits, beside another run and without saves
    assert bits(pair[1][3]) != ref  # the other run is another variant, not a copy


def test_no_final_checkpoint_with_last_save_false_and_the_save_time_is_recorded(tmp_path, caplog):
    ck = tmp_path / "ckpt"
    argv = TINY + [f"--job.dump_folder={tmp_path}", f"--checkpoint.folder={ck}", "--training.steps=3"]
    assert trainer.main(argv + ["--checkpoint.interval=2", "--checkpoint.last_save=false"]) == 0
    assert [p.name for _, p in Checkpointer(str(ck)).complete()] == ["step-00000002"]  # no step 3
    manifest = json.loads((ck / "step-00000002" / MANIFEST).read_text())
    assert 0 <= manifest["save_s"] < 60
    assert save_seconds(ck) == manifest["save_s"]
    assert save_seconds(tmp_path / "none") is None
    # the default saves after the last step
    b = tmp_path / "b"
    argv = TINY + [f"--job.dump_folder={b}", f"--checkpoint.folder={b}/ckpt", "--training.steps=3"]
    assert trainer.main(argv) == 0
    assert Checkpointer(str(tmp_path / "b" / "ckpt")).latest().name == "step-00000003"


def test_grace_comes_from_the_longest_recorded_save(tmp_path):
    def job(ckpt):
        own = [f"--checkpoint.folder={ckpt}"] if ckpt else []
        return ("v", 0, ["--config=x", "--checkpoint.folder=", *own], None)

    assert compare.grace_seconds([job(None)], None) == 30.0  # no checkpoints: only the step to finish
    assert compare.grace_seconds([job(tmp_path / "a")], None) == 120.0  # none recorded yet
    assert compare.grace_seconds([job(tmp_path / "a")], 75.0) == 75.0  # a save time known from elsewhere
    for name, secs in (("a", 40.0), ("b", 60.0)):
        step = tmp_path / name / "step-00000010"
        step.mkdir(parents=True)
        (step / MANIFEST).write_text(json.dumps({"save_s": secs}))
    jobs = [job(tmp_path / "a"), job(tmp_path / "b")]
    assert compare.grace_seconds(jobs, None) == 1.5 * 60.0 + 10.0
    assert compare.grace_seconds(jobs, 200.0) == 200.0  # --grace-s: a longer one wins
    assert compare.grace_seconds(jobs, 5.0) == 100.0  # never shorter than the measured rule


def test_a_run_that_logged_its_last_step_counts_as_finished(tmp_path):
    """A SIGTERM during the last step: the trainer finishes it and exits 0; the launcher counts the run
    finished (not to be run again from an older checkpoint)."""
    argv = ["--config=x", "--training.steps=5", "--training.steps", "3"]  # the last one holds
    assert not compare.launcher.reached_last_step(argv, tmp_path)  # no metrics
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n")
    assert not compare.launcher.reached_last_step(argv, tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2}) + "\n" + json.dumps({"step": 3}) + "\n")
    assert compare.launcher.reached_last_step(argv, tmp_path)
    assert not compare.launcher.reached_last_step(["--config=x"], tmp_path)  # steps unknown: stopped


def test_a_run_stopped_at_the_deadline_keeps_a_loadable_checkpoint(tmp_path, monkeypatch):
    """launch with a time limit and a grace: SIGTERM `grace` seconds before the limit, the trainer saves
    and exits before the SIGKILL at the limit; the checkpoint is the last logged step's and resumes."""
    monkeypatch.chdir(REPO)
    folder, ck = tmp_path / "runs" / "long" / "seed0", tmp_path / "ckpt"
    extra = TINY + ["--validation.freq=0", f"--checkpoint.folder={ck}", "--checkpoint.last_save=false"]
    argv = compare.launcher.trainer_argv("debug_moe", 100_000, True, [], extra, 0, folder)
    own = ck / "long" / "seed0"
    assert argv[-1] == f"--checkpoint.folder={own}"
    # the run is past its start-up (a few seconds) when the SIGTERM comes 30 s in
    status = compare.launch([("long", 0, argv, folder)], 1, None, time_limit_s=45, grace_s=15)
    assert status == {("long", 0): "stopped at the time limit"}
    rec = json.loads((folder / "command.json").read_text())
    assert rec["returncode"] == 0 and rec["stopped"] is True and rec["seconds"] < 45
    log = (folder / "train.log").read_text()
    assert "SIGTERM: stopped after step" in log and "saved in" in log
    last = bits(folder)[-1][0]
    assert Checkpointer(str(own)).latest() == own / f"step-{last:08d}"
    assert save_seconds(own) is not None
    resumed = tmp_path / "resumed"
    argv = ["--config=debug_moe", *TINY, "--validation.freq=0", "--debug.deterministic=true"]
    argv += [f"--job.dump_folder={resumed}", f"--checkpoint.folder={own}", f"--training.steps={last + 1}"]
    assert trainer.main(argv) == 0
    assert [r[0] for r in bits(resumed)] == [last + 1]


# a stand-in trainer for the launcher: --training.steps=N steps of --step_s=S seconds, a metrics
# record per step (step, time, run_id); on SIGTERM it writes SIGTERM into its folder and exits 0
FAKE_TRAINER = """
import json, signal, sys, time, uuid
from pathlib import Path
opts = dict(a[2:].split("=", 1) for a in sys.argv[1:])
folder, steps, step_s = Path(opts["job.dump_folder"]), int(opts["training.steps"]), float(opts["step_s"])
folder.mkdir(parents=True, exist_ok=True)
def stop(*_):
    (folder / "SIGTERM").write_text("")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
run_id = uuid.uuid4().hex
with open(folder / "metrics.jsonl", "a") as f:
    for step in range(1, steps + 1):
        time.sleep(step_s)
        f.write(json.dumps({"step": step, "time": time.time(), "run_id": run_id, "loss": 1.0}) + "\\n")
        f.flush()
"""


def test_seconds_to_finish_reads_the_rate_of_the_latest_process(tmp_path):
    """The steps left and their time: at the rate between the first and the last record of the
    process that wrote the last one (a resumed run's own), less the time since that record; None
    where it cannot be told or the records stopped coming."""
    argv = ["--training.steps=100"]
    assert compare.launcher.seconds_to_finish(argv, tmp_path) is None  # no metrics yet
    recs = [{"step": s, "time": 1000.0 + s, "run_id": "a"} for s in (10, 20, 30)]  # 1 s a step
    # resumed from step 30: 0.5 s a step from its first record (its start-up before it left out)
    recs += [{"step": s, "time": 2000.0 + (s - 40) * 0.5, "run_id": "b"} for s in (40, 50, 60)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert compare.launcher.seconds_to_finish(argv, tmp_path, now=2010.0) == (40, 20.0)
    assert compare.launcher.seconds_to_finish(argv, tmp_path, now=2016.0) == (40, 14.0)
    assert compare.launcher.seconds_to_finish(argv, tmp_path, now=2030.0) == (40, 0.0)
    # no record for longer than launcher.STALE_S (60 s; more than 5 of its 5-s intervals): not
    # progressing as it logged, so unknown (the run is stopped as before)
    assert compare.launcher.seconds_to_finish(argv, tmp_path, now=2071.0) is None
    assert compare.launcher.seconds_to_finish(["--config=x"], tmp_path) is None  # steps unknown
    (tmp_path / "metrics.jsonl").write_text(json.dumps(recs[3]) + "\n")  # one record of the process
    assert compare.launcher.seconds_to_finish(argv, tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    assert compare.launcher.seconds_to_finish(argv, tmp_path) is None


@pytest.mark.parametrize("steps, finishes", [(100, True), (400, False)])
def test_at_the_grace_a_run_that_fits_finishes_and_one_that_does_not_is_stopped(
    tmp_path, monkeypatch, capsys, steps, finishes
):
    """The SIGTERM at the grace would make a run save a checkpoint (moe_2b: 23 GB, more than 75 s)
    even when its last steps take less: a run whose remaining steps fit before the limit (x
    FINISH_FACTOR + FINISH_MARGIN_S) finishes instead; one that does not is stopped as before."""
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(compare.launcher, "trainer_command", lambda nproc: [sys.executable, str(script)])
    monkeypatch.setattr(compare.launcher, "FINISH_MARGIN_S", 0.5)
    folder = tmp_path / "runs" / "a" / "seed0"
    argv = [f"--training.steps={steps}", "--step_s=0.05", f"--job.dump_folder={folder}"]
    # SIGTERM due at 4 s, within the 100 steps (5 s and the start-up) or the 400 (20 s); limit at 14 s
    status = compare.launch([("a", 0, argv, folder)], 1, None, time_limit_s=14, grace_s=10)
    out = capsys.readouterr().out
    rec = json.loads((folder / "command.json").read_text())
    last = json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    if finishes:
        assert status == {("a", 0): compare.DONE} and rec["stopped"] is False
        assert last == steps and not (folder / "SIGTERM").exists()
        assert "a seed 0: " in out and "finishing it instead of stopping it" in out
    else:
        assert status == {("a", 0): "stopped at the time limit"} and rec["stopped"] is True
        assert (folder / "SIGTERM").exists() and last < steps
        assert "finishing it" not in out and rec["seconds"] < 14


@pytest.mark.gpu
def test_a_gpu_run_has_the_same_bits_alone_and_beside_two_others(tmp_path, monkeypatch):
    """On one GPU: a deterministic run alone and the same run started with two others (another seed,
    MX) at once give the same loss, gradient-norm and validation bits at every step."""
    monkeypatch.chdir(REPO)
    gpu = [a for a in TINY if not a.startswith(("--training.device", "--training.cpu_threads"))]
    gpu += ["--training.device=cuda", "--model.dim=128", "--model.moe_hidden_dim=128"]
    gpu += ["--training.seq_len=128"]

    def job(variant, vargs, seed, where):
        folder = tmp_path / where / variant / f"seed{seed}"
        argv = compare.launcher.trainer_argv("debug_moe", 8, True, vargs, gpu, seed, folder)
        return (variant, seed, argv, folder)

    mx = ["--model.converters=mx"]
    alone = job("mx", mx, 0, "alone")
    assert compare.launch([alone], 1, None) == {("mx", 0): compare.DONE}
    three = [job("mx", mx, 0, "three"), job("mx", mx, 1, "three")]
    three.append(job("bf16", ["--model.converters="], 0, "three"))
    assert set(compare.launch(three, 3, None).values()) == {compare.DONE}
    assert len(bits(alone[3])) == 8 and bits(three[0][3]) == bits(alone[3])
