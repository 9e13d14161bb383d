"""Trainer configuration: dataclass sections, a TOML file, `--section.key=value` overrides.

    mxmoe train --config configs/debug_moe.toml --model.converters=mx --mx.recipe_name=mxfp8 \
        --training.compile --training.steps=100

Values are typed from the field types: int, float, str, bool (true/false/1/0/yes/no; a bare
`--section.flag` means true), `X | None` ("none" gives None, except for `str | None` fields, where
it is the string "none") and list[str] / list[int] (comma separated). Unknown sections or keys
and badly typed values raise `ConfigError` naming them. Every field carries a one-line doc
(`mxmoe train --help` prints them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field

from mxmoe.recipe import DEFAULT_RECIPE_NAME, RECIPES


class ConfigError(ValueError):
    """A bad config file or command-line override; the message names the key and value."""


def _f(default, doc: str):
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class Model:
    name: str = _f(
        "debug_moe",
        "model preset (mxmoe.models.PRESETS): debug_moe, debug_dense, moe_small, moe_1b, dense_1b",
    )
    converters: list[str] = _f(
        [], "model converters applied after building; 'mx' swaps in MXFP8 linears/experts"
    )
    dim: int | None = _f(None, "override the preset's model width")
    n_layers: int | None = _f(None, "override the preset's number of blocks")
    n_heads: int | None = _f(None, "override the preset's attention heads")
    num_experts: int | None = _f(None, "override the preset's routed experts (0 = dense model)")
    top_k: int | None = _f(None, "override the preset's experts per token")
    moe_hidden_dim: int | None = _f(None, "override the preset's expert hidden width (multiple of 32 for mx)")
    num_shared_experts: int | None = _f(None, "override the preset's always-on shared experts")
    load_balance: str | None = _f(None, "router load balancing: aux_loss | bias | none")
    aux_loss_coef: float | None = _f(None, "weight of the load-balancing aux loss in the training loss")
    bias_update_rate: float | None = _f(None, "step of the bias-based balancing update per optimizer step")


@dataclass
class MX:
    recipe_name: str = _f(
        DEFAULT_RECIPE_NAME,
        f"MX recipe passed to mxmoe.convert, one of mxmoe.recipe.RECIPES: {', '.join(RECIPES)} "
        "(mxfp8_rceil: RCEIL scales, never saturate; mxfp8: FLOOR scales, the OCP rule)",
    )
    mxfp8_dim1_cast_kernel_choice: str = _f(
        "auto",
        "kernel for the dim1 (transposing) casts: auto (the fastest here: cuda on a GPU, torch on "
        "CPU) | triton | cuda | torch",
    )
    mxfp8_dim0_cast_kernel_choice: str = _f(
        "auto", "kernel for the dim0 casts and dequantize: auto | triton | cuda | torch (as dim1's)"
    )
    filter_fqns: list[str] = _f(
        ["output", "router"], "modules whose name contains one of these stay high precision"
    )
    convert_linears: bool = _f(True, "convert the nn.Linear layers (MX GEMMs); false keeps them bf16")
    convert_grouped_experts: bool = _f(
        True, "also convert the routed experts (MX grouped GEMM, MXFP8 all-to-all)"
    )
    expert_gemm: str = _f(
        "mx",
        "the routed experts' GEMMs: mx (MX operands) | hp (the exchange only: bf16 GEMMs on rows "
        "rounded to MX, MXFP8 dispatch and combine gradient; with convert_linears=false no GEMM "
        "is MX, for Hopper; docs/comm.md)",
    )
    gemm_backend: str = _f(
        "auto",
        "GEMM on MX operands: auto (native on Blackwell sm_100 where torch runs it, else emulated) | "
        "emulated (exact dequantize, bf16 GEMM) | native (torch's block-scaled MXFP8 GEMMs, sm_100)",
    )


@dataclass
class Training:
    steps: int = _f(100, "optimizer steps to train for (total, including resumed ones)")
    batch_size: int = _f(8, "sequences per rank per step")
    seq_len: int = _f(256, "tokens per sequence")
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of lr (cosine decay)")
    warmup_steps: int = _f(10, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    max_norm: float = _f(1.0, "gradient clipping max norm (0 disables)")
    seed: int = _f(0, "seed of the model init, the data order and the RNG")
    deterministic: bool = _f(
        False,
        "bit-reproducible runs (same config, seed, GPU and software: same losses): deterministic "
        "algorithms, cuBLAS workspace, Inductor without benchmarking (mxmoe.train.determinism); slower",
    )
    compile: bool = _f(False, "torch.compile each transformer block")
    compile_full: bool = _f(
        False,
        "torch.compile the whole model as one graph (fullgraph=True; one process: no FSDP / expert "
        "parallelism); with cuda_graph=true the fastest mode measured, bf16 and MX",
    )
    compile_backend: str = _f(
        "inductor",
        "torch.compile backend of compile / compile_full (torchtitan's compile.backend): inductor "
        "generates kernels; aot_eager_decomp_partition traces, decomposes and partitions the graphs "
        "and runs them eagerly (a quick check of graph capture, e.g. on CPU)",
    )
    cuda_graph: bool = _f(
        False, "capture forward+backward in one CUDA graph and replay it (one GPU, no EP/FSDP)"
    )
    mixed_precision: str = _f(
        "bf16", "compute dtype on CUDA: bf16 (autocast; fp32 master weights) | fp32 | tf32 (fp32 with TF32 "
        "matmuls: the cheap high-precision reference); CPU is fp32"
    )
    device: str = _f("auto", "auto | cpu | cuda")
    cpu_threads: int = _f(0, "torch intra-op threads on CPU (0 = torch's default; 1 suits tiny models)")
    val_interval: int = _f(50, "validation loss every this many steps (0 disables; also at the last step)")
    val_batches: int = _f(4, "batches per validation")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = _f(
        -1, "FSDP degree of the dense parameters; -1 = world size (only value supported)"
    )
    expert_parallel_degree: int = _f(
        1, "ranks the experts are sharded over (divides world size and num_experts)"
    )
    tensor_parallel_degree: int = _f(1, "tensor parallelism: not supported (mx converter refuses > 1)")
    timeout_s: int = _f(300, "process-group timeout in seconds (collectives fail instead of hanging)")


@dataclass
class Data:
    path: str = _f(
        "",
        "text file or folder of text files; empty = the Python stdlib's own source; python-env = every "
        "Python file of the running environment (the stdlib and the installed packages; a folder of that "
        "name: ./python-env)",
    )
    val_fraction: float = _f(0.05, "fraction of files (chosen by file-name hash) held out for validation")
    max_files: int = _f(0, "use at most this many files (after the split, by hash order); 0 = all")
    extensions: list[str] = _f([".py"], "file suffixes read from a folder")
    max_file_bytes: int = _f(
        2**28,
        "largest data file read, in bytes (each rank holds the corpus in memory); a larger one is an error",
    )


@dataclass
class Checkpoint:
    folder: str = _f("", "checkpoint folder (empty disables checkpointing)")
    interval: int = _f(0, "save every this many steps (0 = only at the end / on SIGTERM)")
    keep_latest: int = _f(2, "complete checkpoints kept (older ones deleted; 0 keeps all)")
    resume: bool = _f(True, "resume from the latest complete checkpoint in folder if there is one")
    fallback: bool = _f(
        False,
        "when the latest checkpoint fails its checksums, move it aside (step-N.corrupt) and resume "
        "from the previous complete one (default: stop with an error naming the bad file)",
    )
    allow_precision_change: bool = _f(
        False,
        "resume a checkpoint trained in another precision (model.converters, the mx recipe and "
        "options, training.mixed_precision) in this run's, with a warning (default: an error naming both)",
    )


@dataclass
class Metrics:
    folder: str = _f("runs/debug", "metrics folder: metrics.jsonl (+ TensorBoard events if importable)")
    log_freq: int = _f(10, "log loss (mean over the interval), lr, tokens/s and memory every this many steps")
    tensorboard: bool = _f(
        False, "also write TensorBoard events (needs the tensorboard extra: pip install 'mxmoe[tensorboard]')"
    )
    progress_bar: bool = _f(
        True, "tqdm progress bar on rank 0 when stderr is a terminal (else a plain line every log_freq steps)"
    )


@dataclass
class Profiling:
    enable_profiling: bool = _f(False, "torch.profiler traces of training steps (torchtitan's flag)")
    save_traces_folder: str = _f(
        "profile_traces", "trace folder, relative to metrics.folder unless absolute"
    )
    profile_freq: int = _f(10, "profile the last profile_active steps of every profile_freq steps")
    profile_active: int = _f(1, "steps recorded per trace (1 <= profile_active < profile_freq)")
    profile_repeat: int = _f(1, "traces written per run (0 = one every profile_freq steps)")


@dataclass
class JobConfig:
    model: Model = field(default_factory=Model)
    mx: MX = field(default_factory=MX)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, typing.Any]:
        """{"section.key": value} of every field."""
        return {f"{sec}.{k}": v for sec, body in self.to_dict().items() for k, v in body.items()}

    def digest(self) -> str:
        """SHA-256 of the resolved config (every field, as JSON)."""
        return hashlib.sha256(json.dumps(self.flat(), sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class Range:
    """The accepted values of a float option: finite, within [low, high] (an open end excludes it)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def accepts(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below  # NaN fails every comparison

    def __str__(self) -> str:
        if math.isinf(self.high):
            text = f"a finite number {'>' if self.low_open else '>='} {self.low:g}"
        else:
            lo, hi = ("<" if self.low_open else "<="), ("<" if self.high_open else "<=")
            text = f"{self.low:g} {lo} value {hi} {self.high:g}"
        return f"{text} ({self.note})" if self.note else text


FLOAT_RANGES: dict[str, Range] = {
    "model.aux_loss_coef": Range(0.0, note="none keeps the preset's"),
    "model.bias_update_rate": Range(0.0, note="none keeps the preset's"),
    "training.lr": Range(0.0, low_open=True),
    "training.min_lr_ratio": Range(0.0, 1.0),
    "training.weight_decay": Range(0.0),
    "training.beta1": Range(0.0, 1.0, high_open=True),
    "training.beta2": Range(0.0, 1.0, high_open=True),
    "training.max_norm": Range(0.0, note="0 disables clipping"),
    "data.val_fraction": Range(0.0, 1.0, high_open=True),
}
"""Every float option of JobConfig and what it accepts (`check_limits` checks them all; a test checks
that every float field is listed)."""


def check_floats(cfg: JobConfig) -> None:
    """ConfigError naming the first float option (FLOAT_RANGES) outside its range, NaN and
    infinities included; None (an optional field left unset) is not checked."""
    flat = cfg.flat()
    for key, accepted in FLOAT_RANGES.items():
        value = flat[key]
        if value is not None and not accepted.accepts(value):
            raise ConfigError(f"{key}={value!r}: expected {accepted}")


def check_limits(cfg: JobConfig) -> None:
    """ConfigError for values of the right type that fail at run time: every float option
    (`check_floats`) and the limits below (the trainer's other range checks are in
    `mxmoe.train.build.check_values`)."""
    check_floats(cfg)
    t = cfg.training
    if cfg.parallelism.timeout_s < 1:
        raise ConfigError(f"parallelism.timeout_s={cfg.parallelism.timeout_s}: expected >= 1")
    # the sampler seeds torch's 64-bit generator with seed * 1_000_003 + epoch
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"training.seed={t.seed}: expected 0 <= seed < 2**32")
    # AdamW's step size lr / (1 - beta1**t) is a float32 scalar: beyond float32 it fails mid-step
    f32_max = float.fromhex("0x1.fffffep+127")
    if 0 <= t.beta1 < 1 and t.lr / (1 - t.beta1) > f32_max:
        raise ConfigError(
            f"training.lr={t.lr!r}: expected lr / (1 - training.beta1) <= {f32_max:.4g} (AdamW's step "
            "size in float32)"
        )


def check_ranks_agree(cfg: JobConfig) -> None:
    """Collective over the default process group: ConfigError on every rank, naming the differing
    keys and their values, unless every rank resolved the same config as rank 0 (a rank with
    another lr trains silently apart, another step count hangs, another checkpoint folder loses
    that rank's shard)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    digests: list = [None] * world
    dist.all_gather_object(digests, cfg.digest())
    if all(d == digests[0] for d in digests):
        return
    flats: list = [None] * world
    dist.all_gather_object(flats, cfg.flat())
    ref, diffs = flats[0], []
    for rank in range(1, world):
        keys = sorted(k for k in set(ref) | set(flats[rank]) if ref.get(k) != flats[rank].get(k))
        diffs += [f"{k} (rank 0: {ref.get(k)!r}, rank {rank}: {flats[rank].get(k)!r})" for k in keys]
    raise ConfigError(
        f"the ranks were started with different configs: {'; '.join(diffs)}; give every rank the same "
        "--config and options"
    )


def check_ranks_data(identity: dict, path: str) -> None:
    """Collective over the default process group: ConfigError on every rank, naming what each rank
    read, unless every rank's corpus (`mxmoe.train.data.Corpus.identity`: its files' names and
    sizes, its token counts) is rank 0's. The same config can name different data: a relative
    data.path from different working folders, a folder that differs between hosts."""
    import torch.distributed as dist

    def key(i: dict) -> tuple:
        return i["sha256"], i["train_tokens"], i["val_tokens"]

    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, identity)
    if all(key(i) == key(ids[0]) for i in ids):
        return
    each = "; ".join(
        f"rank {r}: {i['source']} ({i['files']} files, {i['train_tokens'] + i['val_tokens']} tokens, corpus "
        f"{i['sha256'][:12]})"
        for r, i in enumerate(ids)
    )
    raise ConfigError(
        f"the ranks read different data for data.path={path!r}: {each}; give every rank the same files "
        "(an absolute --data.path, on a file system they share)"
    )


SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _section_types(section: str) -> dict[str, typing.Any]:
    cls = typing.get_type_hints(JobConfig)[section]
    return typing.get_type_hints(cls)


def _convert_str(key: str, text: str, tp) -> typing.Any:
    """Parse the command-line text of `key` as type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        # "none" is a legitimate value of an optional str field (model.load_balance=none)
        if args[0] is not str and text.strip().lower() in ("none", "null"):
            return None
        return _convert_str(key, text, args[0])
    if origin is list:
        (elem,) = typing.get_args(tp)
        return [_convert_str(key, t.strip(), elem) for t in text.split(",") if t.strip()]
    if tp is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--{key}={text!r}: expected a bool (true/false)")
    try:
        return tp(text)
    except ValueError:
        raise ConfigError(f"--{key}={text!r}: expected {tp.__name__}") from None


def _check_value(key: str, value, tp) -> typing.Any:
    """Type-check a TOML value for `key`; ints are accepted for float fields."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check_value(key, value, args[0])
    if origin is list:
        (elem,) = typing.get_args(tp)
        if isinstance(value, str):
            return _convert_str(key, value, tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list of {elem.__name__}")
        return [_check_value(key, v, elem) for v in value]
    ok = (
        isinstance(value, bool)
        if tp is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if tp is float
        else isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    )
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {tp.__name__}, got {type(value).__name__}")
    return float(value) if tp is float else value


def _field_type(key: str) -> typing.Any:
    """The type of `section.name`; ConfigError naming the key if there is no such field."""
    if "." not in key:
        raise ConfigError(f"option {key!r} is not of the form section.key; sections: {list(SECTIONS)}")
    section, name = key.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown config section {section!r} (in {key!r}); expected one of {list(SECTIONS)}"
        )
    hints = _section_types(section)
    if name not in hints:
        raise ConfigError(f"unknown config key {key!r}; section {section!r} has {sorted(hints)}")
    return hints[name]


def _set(cfg: JobConfig, key: str, value, from_text: bool) -> None:
    tp = _field_type(key)
    section, name = key.split(".", 1)
    value = _convert_str(key, value, tp) if from_text else _check_value(key, value, tp)
    setattr(getattr(cfg, section), name, value)


def load_toml(path: str, cfg: JobConfig | None = None) -> JobConfig:
    """Read a TOML config into `cfg` (default: a fresh JobConfig)."""
    cfg = JobConfig() if cfg is None else cfg
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {path!r}: is a folder, expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path!r}: not UTF-8 text ({e}); expected a UTF-8 TOML file") from None
    except OSError as e:
        raise ConfigError(f"--config {path!r}: cannot be read: {e}") from None
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
        for name, value in body.items():
            _set(cfg, f"{section}.{name}", value, from_text=False)
    return cfg


def parse_args(argv: list[str]) -> JobConfig:
    """`--config PATH` (applied first) then `--section.key=value` / `--section.key value` /
    `--section.flag` overrides, in order."""
    argv = list(argv)
    cfg = JobConfig()
    config_path = None
    overrides: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key=value")
        body = arg[2:]
        key, eq, val = body.partition("=")
        if not eq:
            val = None
            takes_value = key == "config" or _field_type(key) is not bool
            if takes_value:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"option --{key} needs a value")
                val = argv[i + 1]
                i += 1
        if key == "config":
            config_path = val
        else:
            overrides.append((key, val))
        i += 1
    if config_path is not None:
        load_toml(config_path, cfg)
    for key, val in overrides:
        _set(cfg, key, "true" if val is None else val, from_text=True)
    return cfg


def help_text() -> str:
    lines = ["usage: mxmoe train [--config FILE.toml] [--section.key=value ...] [--section.flag]", ""]
    defaults = JobConfig()
    for section in SECTIONS:
        lines.append(f"[{section}]")
        hints = _section_types(section)
        for f in dataclasses.fields(getattr(defaults, section)):
            tp = hints[f.name]
            tname = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
            default = getattr(getattr(defaults, section), f.name)
            lines.append(f"  --{section}.{f.name} ({tname}, default {default!r}): {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)
