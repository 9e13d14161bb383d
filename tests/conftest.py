"""Shared test set-up and helpers.

- On a machine without a GPU, Triton kernels run through its interpreter (TRITON_INTERPRET must be
  set before any `@triton.jit` runs, i.e. before the kernel modules are imported), and Inductor
  compiles without a pool of worker processes (TORCHINDUCTOR_COMPILE_THREADS=1) and scalar C++
  kernels (TORCHINDUCTOR_VEC_ISA_OK=0: a third less g++ time).
- GPU-only tests carry `@pytest.mark.gpu` and are skipped without a CUDA GPU; select them with
  `pytest -m gpu`, or a package with `pytest tests/<package>` (scripts/gpu/suite.sh runs them in parts).
- Tests that run Triton kernels on CPU tensors through the interpreter carry
  `@pytest.mark.interpreter` and are skipped where it is off (a GPU host, where the GPU tests run
  the same kernels on the device).
- Helpers shared by several packages' tests: `free_port`, `spawn_ranks` (gloo process groups in
  processes of their own: spawned on a GPU host, forked from a fork server that imported torch and
  mxmoe once on a CPU host) and `assert_same_bits`, as plain functions (usable inside spawned workers via
  `from conftest import ...`) and as fixtures of the same names.
- `--torchtitan02 DIR` (`make test` passes the folder it installs torchtitan 0.2.2 into): the 0.2
  adapter's tests run, inside the suite, in a pytest process of their own with DIR first on
  PYTHONPATH (one process cannot import two torchtitan versions).
- `mx_cast_sm90`: csrc/*.cu compiled once per session for sm_90 with nvcc (no GPU needed),
  what every test of the build's PTX, registers and spills reads (one build for all xdist workers);
  `triton_sm90`: the Triton kernels' sm_90 build checks (tests/triton_sm90.py), once per session
  in one process, each test asserting its checks (`assert_sm90_check`).
- Subprocess jobs (`subprocess_job`): a check that is one long subprocess (a compiler, an inner
  pytest run) is started in the background when the session starts, once for all xdist workers, and
  its test waits for the result: it runs beside the other tests instead of holding a worker idle at
  whatever point the test is reached (on 2 cores a minute-long job then never ends the run alone);
  it runs at nice 10, so it takes the cores the test workers leave.
- Under xdist every worker, and every process it starts, runs torch with one intra-op thread
  (OMP_NUM_THREADS=1 unless set): the workers already use the cores.
- Known-slow tests run first (`SLOW_FIRST`), spread over the xdist workers' first batches, so that no
  long test starts last on one worker while the other has finished; after those batches each worker
  is handed one test at a time (`pytest_xdist_make_scheduler`).
- Under the interpreter, Triton's type objects are memoized and a @triton.jit helper's call no
  longer re-patches triton.language when the running launch already has (tests/triton_interpreter.py:
  the same launches and results, less of the interpreter's own Python).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the host's cores: one intra-op thread each, in every process they start too
    # (trainer runs, ranks, jobs inherit it); with torch's default of one per core their OpenMP
    # threads spin-wait against each other (on 2 cores the suite took 25 % more CPU time)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS: OpenMP reads it once, at load)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # also where torch was imported earlier

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Inductor compiles in the calling process: a pool of compile workers per test process (xdist
    # workers, spawned ranks) costs their start-up and buys nothing on a CPU host's few busy cores
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Inductor's C++ kernels without the vector ISA (AVX2/AVX-512 templates): g++ takes a third less
    # time on a cold cache (the MX compiled-training test: 84 -> 55 s). The CPU tests check graph
    # capture and compiled-vs-eager numerics, which scalar kernels show as well; the GPU's Triton
    # kernels are tested on the GPU.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

HAS_CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import speed_up

    INTERPRETER_SPEED_UPS = speed_up()


def pytest_addoption(parser):
    parser.addoption(
        "--torchtitan02",
        metavar="DIR",
        default=None,
        help="a folder holding torchtitan 0.2.x (pip install --target): the suite then also runs "
        "tests/integrations/test_torchtitan_v0_2.py with it first on PYTHONPATH, in a process of its own",
    )


# Tests of more than ~5 s each (per parameter set) inside a `make test` run on 2 busy cores, with
# those seconds (the slowest parameter set): the order in which they start, not a limit. Tests
# awaiting a subprocess job are not listed: they run last, when their job is done.
SLOW_FIRST = {
    "tests/train/test_trainer.py::test_compiled_training_matches_eager": 139,
    "tests/train/test_compare.py::test_compare_runs_two_variants_by_two_seeds_on_cpu": 78,
    "tests/train/test_study.py::test_a_run_has_the_same_bits_alone_and_beside_another": 30,
    "tests/train/test_study.py::test_a_run_stopped_at_the_deadline_keeps_a_loadable_checkpoint": 33,
    "tests/integrations/test_torchtitan.py::test_mxfp8_dispatcher_equals_bf16_dispatch_of_qdq_rows": 22,
    "tests/train/test_trainer.py::test_two_process_fsdp_compiled_mx_matches_one_process_eager": 18,
    "tests/train/test_compare.py::test_launch_runs_an_expert_parallel_job_under_torch_distributed_run": 11,
    "tests/bench/test_bench_overhead_train.py::test_train_bench_counts_compiled_graphs": 9,
    "tests/quant/test_swiglu_bwd_qdq.py::test_swiglu_bwd_qdq_matches_oracle": 9,
    "tests/bench/test_bench_overhead_train.py::"
    "test_train_bench_rows_in_children_and_in_the_deterministic_mode": 15,
    "tests/models/test_expert_parallel.py::test_per_block_compile_takes_the_expert_parallel_moe_whole": 8,
    "tests/models/test_step_capture.py::"
    "test_per_block_compile_takes_the_moe_layer_whole_and_matches_eager": 6,
    "tests/ops/test_mx_ops.py::test_compile_fullgraph_same_results": 6,
    "tests/train/test_trainer.py::test_profiling_writes_a_trace_and_an_operator_table": 5,
    "tests/comm/test_symm.py::test_exchange_kernel_under_the_interpreter": 5,
    "tests/train/test_determinism.py::test_two_expert_parallel_runs_give_the_same_loss_bits": 5,
    "tests/comm/test_dispatch.py::test_exchange_bytes_numbers_and_a_registered_transport": 8,
}


# Tests that compile the same Inductor graphs, in the order they must run, on one xdist worker: the
# first compiles (cold: C++ kernels through g++), the next find its graphs in Inductor's on-disk cache
# (the FSDP ranks' per-block graphs are the one-process compiled run's). Started at once on two
# workers, both would compile everything.
CHAINS = (
    (
        "tests/train/test_trainer.py::test_compiled_training_matches_eager[mx]",
        "tests/train/test_trainer.py::test_two_process_fsdp_compiled_mx_matches_one_process_eager",
    ),
)


def _slow_lanes(nodeids: list[str], workers: int) -> list[list[str]]:
    """The SLOW_FIRST tests among `nodeids` (CHAINS kept together, in their order) dealt into one
    lane per worker, longest first to the least loaded lane: each worker's first tests. A pure
    function of the node ids, so that the xdist controller (which collects nothing) and the workers
    (which order their collections by it) agree."""
    def seconds(nodeid: str) -> float:
        return SLOW_FIRST.get(nodeid.split("[", 1)[0], 0)

    present = set(nodeids)
    chained = {n for chain in CHAINS for n in chain}
    units = [[n for n in chain if n in present] for chain in CHAINS]
    units = [u for u in units if u] + [[n] for n in nodeids if seconds(n) and n not in chained]
    units.sort(key=lambda u: sum(map(seconds, u)), reverse=True)
    lanes: list[list[str]] = [[] for _ in range(max(workers, 1))]
    loads = [0.0] * len(lanes)
    for u in units:
        k = loads.index(min(loads))
        lanes[k] += u
        loads[k] += sum(map(seconds, u))
    return lanes


def _slow_first(config, items) -> None:
    """Reorder `items` in place: the slow lanes (`_slow_lanes`, one per xdist worker), then the
    others, tests awaiting a subprocess job last. Under xdist each worker starts on its lane
    (`pytest_xdist_make_scheduler`) and is then handed the others one at a time, so that no long test
    starts last on one worker while the other has finished."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    lanes = _slow_lanes([it.nodeid for it in items], workers)
    by_id = {it.nodeid: it for it in items}
    slow = [by_id[n] for lane in lanes for n in lane]
    first = {id(it) for it in slow}
    last = [it for it in items if id(it) not in first and JOBS.keys() & set(getattr(it, "fixturenames", ()))]
    placed = first | {id(it) for it in last}
    order = slow + [it for it in items if id(it) not in placed] + last
    assert sorted(map(id, order)) == sorted(map(id, items)), "the reordering lost or repeated tests"
    items[:] = order


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's, absent where it is off (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """xdist's `--dist load` (what -n alone chooses), except for the tests it sends: each worker first
    gets its slow lane (`_slow_lanes`, the same the workers put first in their collections), then one
    test at a time whenever it has fewer than two waiting. xdist's own first batches (a quarter of the
    tests, consecutive) and refills (up to a quarter of what is left) left one worker running a batch
    at the end while the other, done, sat idle."""
    if config.getoption("dist", "no") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class LanesThenOneAtATime(LoadScheduling):
        def schedule(self) -> None:
            if self.collection is not None or not self.collection_is_completed:
                return super().schedule()
            if not self._check_nodes_have_same_collection():
                return super().schedule()  # aborts the run, saying why
            self.collection = next(iter(self.node2collection.values()))
            index = {n: i for i, n in enumerate(self.collection)}
            lanes = _slow_lanes(list(self.collection), len(self.nodes))
            first = {index[n] for lane in lanes for n in lane}
            self.pending[:] = [i for i in range(len(self.collection)) if i not in first]
            for node, lane in zip(self.nodes, lanes, strict=True):
                if lane:
                    self.node2pending[node].extend(index[n] for n in lane)
                    node.send_runtest_some([index[n] for n in lane])
            for node in self.nodes:
                self.check_schedule(node)

        def check_schedule(self, node, duration: float = 0) -> None:
            if node.shutting_down:
                return
            if not self.pending:
                node.shutdown()
            elif len(self.node2pending[node]) < 2:  # a worker runs a test once the next one is known
                self._send_tests(node, min(2 - len(self.node2pending[node]), len(self.pending)))

    return LanesThenOneAtATime(config, log)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: `items` are the tests that will run
def pytest_collection_modifyitems(config, items):
    _slow_first(config, items)


GPU_SKIP = "needs a CUDA GPU; run `pytest -m gpu` on one"
INTERPRETER_SKIP = "runs Triton on CPU tensors: needs TRITON_INTERPRET=1 (set without a GPU)"


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up, and before skipif marks are read
def pytest_runtest_setup(item):
    """A GPU-only test without a GPU, or an interpreter test where the interpreter is off, is
    skipped here, before its fixtures: the report names this line, so the run's summary folds each
    kind into one line ("SKIPPED [N] tests/conftest.py:...") instead of one per test function."""
    if "gpu" in item.keywords and not HAS_CUDA:
        pytest.skip(GPU_SKIP)
    if "interpreter" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(INTERPRETER_SKIP)


def _ephemeral_ports() -> range:
    """The kernel's range of ports for connections' local ends (Linux; else IANA's)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(49152, 65536)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's rendezvous), taken
    below the kernel's ephemeral range where there is room: a port from that range (what binding port
    0 gives) can be taken between this check and the rendezvous's listen by any connection's local
    end, e.g. another test's Gloo pairs (EADDRINUSE, once in a full CPU run). Drawn from the OS's
    randomness: the xdist workers seed `random` alike."""
    import random

    low = _ephemeral_ports().start
    pick = random.SystemRandom()
    for _ in range(64 if low > 11024 else 0):
        port = pick.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, *args) -> None:
    """A spawned rank: fn(*args), then exit at once with 0 (1 after printing the traceback if fn
    raised), skipping the interpreter's finalization: there Gloo's worker threads can abort the
    process ("terminate called without an active exception", SIGABRT) after the rank's work and
    destroy_process_group are done; seen once in a full CPU run (torch 2.13), never in isolation."""
    import os
    import sys
    import traceback

    code = 0
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# what the fork server of `spawn_ranks` imports before forking ranks (one missing is skipped): every
# rank imports torch._dynamo (0.75 s of CPU each, ~60 ranks a run), a compiling one Inductor, a
# checkpointing one torch.distributed.checkpoint
RANK_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.fsdp",
                "torch.distributed.checkpoint", "torch._dynamo", "torch._inductor.compile_fx", "triton",
                "mxmoe", "mxmoe.quant.qdq", "mxmoe.comm.a2a", "mxmoe.comm.symm", "mxmoe.nn",
                "mxmoe.train.trainer", "conftest"]


def _forked_rank(env: dict[str, str], fn, *args) -> None:
    """A rank forked from the fork server: the caller's environment (as a spawned rank would have
    it), then `_rank_main`."""
    os.environ.clear()
    os.environ.update(env)
    _rank_main(fn, *args)


def trainer_rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """A `spawn_ranks` target: `mxmoe train argv` as rank `rank` of `world` (gloo rendezvous on
    127.0.0.1:port, one intra-op thread); its standard output is written to out/stdout{rank}, its
    exit status to out/rc{rank}."""
    import contextlib

    import torch

    from mxmoe.train import trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    with open(Path(out, f"stdout{rank}"), "w") as f, contextlib.redirect_stdout(f):
        rc = trainer.main(argv)
    Path(out, f"rc{rank}").write_text(str(rc))


def spawn_ranks(fn, world: int, *args, timeout_s: float = 180.0) -> None:
    """Run fn(rank, world, port, *args) in `world` processes and wait at most `timeout_s`.

    Each rank is a fresh process: spawned on a GPU host; on a CPU host forked from a fork server
    (one per test process) that has imported torch and mxmoe (RANK_PRELOAD), with the caller's
    environment at the call, what a spawned rank would have seen. `fn` must be a module-level
    function (it is pickled by name); `port` is a fresh free port for
    the ranks' rendezvous (e.g. `init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", ...)`
    or MASTER_PORT). Fails the test, after killing every straggler, if a rank exits non-zero or is
    still running at the deadline: a distributed test never hangs the suite.
    """
    import torch.multiprocessing as mp

    port = free_port()
    if HAS_CUDA:  # a fresh interpreter per rank: nothing CUDA-related inherited
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(fn, rank, world, port, *args)) for rank in range(world)]
    else:
        # CPU host: ranks forked from this process's fork server, which imported torch and mxmoe once
        # (a spawned rank spends seconds of CPU importing them), given this process's environment now
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(RANK_PRELOAD)
        env = dict(os.environ)
        procs = [ctx.Process(target=_forked_rank, args=(env, fn, rank, world, port, *args))
                 for rank in range(world)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert not hung, f"ranks {hung} still running after {timeout_s:.0f} s (killed); exit codes {codes}"
    assert codes == [0] * world, f"exit codes {codes}"


def assert_same_bits(
    a: torch.Tensor | None, b: torch.Tensor | None, what: str = "", *, nan_payload: bool = False
) -> None:
    """Equal shapes and dtypes, NaNs at the same places, and equal bit patterns everywhere else
    (so +0 != -0, and float8 / e8m0 tensors compare byte for byte); with `nan_payload` the NaNs'
    bits too (every element byte for byte). Tensors on different devices are compared on the CPU;
    None equals only None (e.g. a gradient that must not exist). The error gives the number of
    differing elements and the first five (flat index, both bits)."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {type(a).__name__} vs {type(b).__name__}"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.device != b.device:
        a, b = a.cpu(), b.cpu()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    ba, bb = a.contiguous().view(ints).reshape(-1), b.contiguous().view(ints).reshape(-1)
    bad = ba != bb
    if a.dtype.itemsize > 1 and not nan_payload:
        na, nb = a.isnan().reshape(-1), b.isnan().reshape(-1)
        assert torch.equal(na, nb), f"{what}: NaN positions differ"
        bad &= ~na
    if bad.any():
        idx = bad.nonzero().flatten()[:5].tolist()
        detail = ", ".join(f"{i}: {int(ba[i]):#x} vs {int(bb[i]):#x}" for i in idx)
        n = int(bad.sum())
        raise AssertionError(f"{what}: bits differ at {n} of {bad.numel()} elements; first {detail}")


def recipe_for(
    kernel: str,
    scaling_mode: str = "rceil",
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    block_size: int = 32,
):
    """An MXRecipe in the given format whose casts all run `kernel` (its dim0_kernel and dim1_kernel):
    how a test picks a cast kernel, which the public casts take only through a recipe."""
    from mxmoe.recipe import MXRecipe

    return MXRecipe(
        elem_dtype=elem_dtype, block_size=block_size, scaling_mode=scaling_mode,
        dim0_kernel=kernel, dim1_kernel=kernel,
    )


@pytest.fixture(name="free_port")
def _free_port_fixture() -> int:
    return free_port()


@pytest.fixture(name="spawn_ranks")
def _spawn_ranks_fixture():
    return spawn_ranks


@pytest.fixture(name="assert_same_bits")
def _assert_same_bits_fixture():
    return assert_same_bits


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The cast-kernel choices (`mxmoe.quant.backends`) as on a GPU machine, for tensors on a
    (fake) CUDA device: `configure(builds=True, cuda_reason=None)` makes the cuda backend
    available on CUDA devices (cuda_reason: why not, e.g. no toolkit) and its extension build
    (builds=False: `load_extension` raises, as a failed build) and forgets the resolved choices.
    Returns the list that records `load_extension` calls; choices are forgotten again afterwards."""
    from mxmoe.quant import backends, cuda_cast

    loads: list[int] = []
    state = {"builds": True}

    def load_extension():
        loads.append(1)
        if not state["builds"]:
            raise RuntimeError("kernel='cuda': building the CUDA extension failed")

    def configure(builds: bool = True, cuda_reason: str | None = None) -> list[int]:
        state["builds"] = builds

        def why_unavailable(device, cast):
            if device.type != "cuda":
                return f"kernel='cuda' needs a CUDA tensor (got a {device.type} tensor)"
            return cuda_reason

        monkeypatch.setattr(cuda_cast, "why_unavailable", why_unavailable)
        backends.clear_resolved()
        return loads

    monkeypatch.setattr(cuda_cast, "load_extension", load_extension)
    configure()
    yield configure
    backends.clear_resolved()


# ------------------------------------------------------------------------------------------------
# Subprocess jobs: started in the background when the session starts, awaited by their tests


@dataclass(frozen=True)
class Job:
    """A subprocess to run in the background: `cmd` in `cwd` with environment `env` (None: the
    session's), killed after `timeout_s` seconds."""

    cmd: list[str]
    timeout_s: float
    cwd: str | None = None
    env: dict[str, str] | None = None


@dataclass(frozen=True)
class JobResult:
    """A finished job: its command, exit status (None: timed out or did not start), output and its
    folder (outputs it was told to write)."""

    cmd: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    folder: Path = field(compare=False)


# name -> spec(config, folder): the Job (writing its outputs into the empty `folder`) or, as a str,
# why the tests waiting for it are skipped
JOBS: dict[str, Callable[[pytest.Config, Path], Job | str]] = {}
_STARTED: dict[str, subprocess.Popen] = {}  # the job runners this process started

# the job runner: runs folder/job.json's command and writes folder/result.json (atomically)
_JOB_RUNNER = r"""
import json, os, subprocess, sys
os.nice(10)  # the tests first: a job (and its command) takes the cores when the test workers leave them
folder = sys.argv[1]
with open(os.path.join(folder, "job.json")) as f:
    spec = json.load(f)
try:
    p = subprocess.run(spec["cmd"], cwd=spec["cwd"], env=spec["env"], capture_output=True, text=True,
                       timeout=spec["timeout_s"])
    res = {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
except subprocess.TimeoutExpired as e:
    out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    res = {"returncode": None, "stdout": out, "stderr": f"timed out after {spec['timeout_s']} s"}
except OSError as e:
    res = {"returncode": None, "stdout": "", "stderr": f"could not start: {e}"}
with open(os.path.join(folder, "result.json.tmp"), "w") as f:
    json.dump(res, f)
os.replace(os.path.join(folder, "result.json.tmp"), os.path.join(folder, "result.json"))
"""


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary folder, shared by its xdist workers (each works in a folder inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _start_job(name: str, config: pytest.Config, root: Path) -> Path:
    """Start job `name` unless this run (any xdist worker) already has; returns its folder."""
    import fcntl
    import json

    folder = root / "jobs" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "job.json").exists() or (folder / "skip").exists():
            return folder
        out = folder / "out"
        out.mkdir(exist_ok=True)
        spec = JOBS[name](config, out)
        if isinstance(spec, str):
            (folder / "skip").write_text(spec)
            return folder
        (folder / "job.json").write_text(json.dumps(
            {"cmd": spec.cmd, "cwd": spec.cwd, "env": spec.env, "timeout_s": spec.timeout_s}))
        # a session of its own: killed as a group (the command with it) if this run is interrupted
        _STARTED[name] = subprocess.Popen([sys.executable, "-c", _JOB_RUNNER, str(folder)],
                                          stdin=subprocess.DEVNULL, start_new_session=True)
    return folder


def job_result(name: str, config: pytest.Config, root: Path) -> JobResult:
    """Wait for job `name` (starting it if no one has) and return its result; skips the test where
    the job's spec gave a reason to, fails it if the job's runner died without a result."""
    import json

    folder = _start_job(name, config, root)
    if (folder / "skip").exists():
        pytest.skip((folder / "skip").read_text())
    spec = json.loads((folder / "job.json").read_text())
    result = folder / "result.json"
    deadline = time.monotonic() + spec["timeout_s"] + 120
    while not result.exists():
        runner = _STARTED.get(name)
        if runner is not None and runner.poll() is not None and not result.exists():
            pytest.fail(f"job {name}: its runner exited with {runner.returncode} and no result")
        if time.monotonic() > deadline:
            pytest.fail(f"job {name}: no result after {spec['timeout_s'] + 120:.0f} s")
        time.sleep(0.2)
    res = json.loads(result.read_text())
    return JobResult(spec["cmd"], res["returncode"], res["stdout"], res["stderr"], folder / "out")


def subprocess_job(name: str, spec: Callable[[pytest.Config, Path], Job | str]):
    """Register job `name` (see JOBS) and return a session fixture of that name giving its JobResult;
    a module assigns it to a global of that name. The session's first test starts every job a
    selected test's fixtures include."""
    JOBS[name] = spec

    @pytest.fixture(scope="session", name=name)
    def _result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
        return job_result(name, request.config, run_root(tmp_path_factory))

    return _result


@pytest.fixture(scope="session", autouse=True)
def _start_subprocess_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    names = {n for item in request.session.items for n in getattr(item, "fixturenames", ()) if n in JOBS}
    root = run_root(tmp_path_factory)
    for name in sorted(names):
        try:
            _start_job(name, request.config, root)
        except (Exception, pytest.skip.Exception, pytest.fail.Exception):
            pass  # reported by the job's own test, which starts it again
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Jobs this process started and no test has awaited yet: waited for (another xdist worker's
    test may need one), or killed with their command if the run was interrupted or stopped."""
    import signal

    stopped = bool(session.shouldstop or session.shouldfail) or exitstatus == pytest.ExitCode.INTERRUPTED
    for runner in _STARTED.values():
        if runner.poll() is None and not stopped:
            try:
                runner.wait(timeout=1200)
            except subprocess.TimeoutExpired:
                pass
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


def _triton_sm90_job(config: pytest.Config, folder: Path) -> Job | str:
    """tests/triton_sm90.py: every Triton kernel's sm_90 build check, in one process with Triton's
    compiler (TRITON_INTERPRET=0), its results in folder/results.json."""
    from triton_sm90 import unavailable

    why = unavailable()
    if why is not None:
        return why
    cmd = [sys.executable, "-m", "tests.triton_sm90", str(folder / "results.json")]
    return Job(cmd, timeout_s=900, cwd=str(ROOT), env={**os.environ, "TRITON_INTERPRET": "0"})


triton_sm90 = subprocess_job("triton_sm90", _triton_sm90_job)


def assert_sm90_check(result: JobResult, *names: str) -> None:
    """The `triton_sm90` job ran and its checks `names` passed (else their failures)."""
    import json

    assert result.returncode == 0, f"{' '.join(result.cmd)} failed:\n{result.stderr[-4000:]}"
    results = json.loads((result.folder / "results.json").read_text())
    failed = {n: results.get(n, "not run") for n in names if results.get(n) != "ok"}
    assert not failed, "\n".join(f"{n}:\n{why}" for n, why in failed.items())


CSRC = ROOT / "mxmoe" / "quant" / "csrc"


def nvcc_path() -> str | None:
    """nvcc on PATH, else under CUDA_HOME / CUDA_PATH; None without one."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return None


@dataclass(frozen=True)
class Sm90Build:
    """csrc/*.cu (the kernels' translation units) compiled for sm_90: the command, the object files,
    the PTX text of all of them and, per kernel entry, (stack frame bytes, spill store bytes, spill
    load bytes, registers) from ptxas."""

    cmd: list[str]
    objs: list[Path]
    ptx: str
    ptxas: dict[str, tuple[int, int, int, int]]

    def entries(self, pattern: str) -> dict[str, str]:
        """{mangled name: PTX of the entry} of the kernels whose name matches the regex `pattern`."""
        return {m.group(1): m.group(0) for m in re.finditer(r"\.entry (\w+)\((.*?)\n}\n", self.ptx, re.S)
                if re.search(pattern, m.group(1))}


def _mx_cast_sm90_job(config: pytest.Config, folder: Path) -> Job | str:
    """nvcc of csrc/*.cu for sm_90 (-O3, as scripts/check_cuda_build.sh, plus `-Xptxas -v`; the
    objects and the PTX kept in `folder`)."""
    nvcc = nvcc_path()
    if nvcc is None:
        return "nvcc not found (neither on PATH nor under CUDA_HOME): cannot compile csrc/*.cu"
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Xptxas", "-v", "--keep", "--keep-dir", str(folder),
           "-odir", str(folder), "-c", *(str(p) for p in sorted(CSRC.glob("*.cu")))]
    return Job(cmd, timeout_s=900)


mx_cast_sm90_nvcc = subprocess_job("mx_cast_sm90_nvcc", _mx_cast_sm90_job)


@pytest.fixture(scope="session")
def mx_cast_sm90(mx_cast_sm90_nvcc: JobResult) -> Sm90Build:
    """The run's one nvcc build of csrc/*.cu for sm_90 (a subprocess job: started when the
    session starts, shared by the xdist workers); skips the test where nvcc is missing and fails it,
    with nvcc's messages, if the build fails."""
    res = mx_cast_sm90_nvcc
    messages = f"{res.stdout}\n{res.stderr}"
    assert res.returncode == 0, f"{' '.join(res.cmd)} failed:\n{messages[-6000:]}"
    pattern = (r"Compiling entry function '(\w+)'.*?\n.*?Function properties.*?\n\s*(\d+) bytes stack "
               r"frame, (\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers")
    ptxas = {m.group(1): tuple(int(m.group(i)) for i in range(2, 6)) for m in re.finditer(pattern, messages)}
    units = sorted(CSRC.glob("*.cu"))
    ptx = "\n".join((res.folder / f"{p.stem}.ptx").read_text() for p in units)
    return Sm90Build(res.cmd, [res.folder / f"{p.stem}.o" for p in units], ptx, ptxas)


def run_without(packages: list[str], argv: list[str], cwd) -> subprocess.CompletedProcess:
    """`python ARGV` in a subprocess (this checkout first on the path) as on a machine where
    `packages` are not installed (tests/without/sitecustomize.py); its output captured as text."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "without"), str(ROOT)]),
        "MXMOE_TEST_WITHOUT": ",".join(packages),
    }
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
