"""Trainer configuration: one dataclass per section, a TOML file, command-line overrides (tyro).

    mxmoe train --config debug_moe --model.converters=mx --mx.recipe_name=mxfp8 \
        --compile.enable --training.steps=100

`--config` names a config that ships with mxmoe (`mxmoe config list`) or a TOML file; its values
replace the defaults below, and `--section.key value` / `--section.key=value` options replace those.
The command line is parsed by tyro, as torchtitan's is: `--help` lists every field with its
docstring, type, default and, for a `Literal` field, its choices; a value of the wrong type or not
among the choices stops at parse time (exit status 2, tyro's message). A boolean takes true/false or
no value (`--compile.enable` is `--compile.enable=true`), and its negative flag is false
(`--mx.no-convert-linears`, torchtitan 0.2's spelling); a list is comma separated
(`--mx.filter_fqns=output,router`); `None` gives an optional model field back to the preset.

Keys are torchtitan 0.2's where it has one for the same idea (`training.local_batch_size`,
`optimizer.lr`, `compile.enable`, ...); `RENAMED_KEYS` maps the old spellings to them, and an old
key, in a file or on the command line, is refused with its replacement named; so are torchtitan keys
mxmoe spells otherwise (`TORCHTITAN_KEYS`; `--job.config_file` is taken as `--config`). Options are
written with underscores, as torchtitan's keys; dashes are accepted too. Values that parse but
cannot run are refused after parsing (`check_limits`, `mxmoe.train.build.check_values`).
"""

# No `from __future__ import annotations`: tyro reads the field types at run time.
import dataclasses
import hashlib
import json
import math
import os
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

import tyro

from mxmoe.models.moe import LOAD_BALANCE, PRESETS
from mxmoe.options import REMOVED_VALUES, RENAMED_VALUES, MXOptions, why_not_accepted


class ConfigError(ValueError):
    """A bad config file or command-line option; the message names the key and value."""


PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
LoadBalance = Literal[LOAD_BALANCE]  # type: ignore[valid-type]
Converter = Literal["mx", "mxmoe"]
MixedPrecision = Literal["bf16", "fp32", "tf32"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass
class Job:
    dump_folder: str = "runs/debug"
    """The run's folder: metrics.jsonl, config.json, TensorBoard events and profiler traces."""


@dataclass
class Model:
    name: PresetName = "debug_moe"
    """Model preset (mxmoe.models.PRESETS)."""
    converters: list[Converter] = field(default_factory=list)
    """Converters applied after building: mx swaps in MXFP8 linears and experts (mxmoe: the same)."""
    dim: int | None = None
    """Model width (None: the preset's)."""
    n_layers: int | None = None
    """Transformer blocks (None: the preset's)."""
    n_heads: int | None = None
    """Attention heads (None: the preset's)."""
    num_experts: int | None = None
    """Routed experts, 0 = a dense model (None: the preset's)."""
    top_k: int | None = None
    """Experts per token (None: the preset's)."""
    moe_hidden_dim: int | None = None
    """Expert hidden width, a multiple of 32 for mx (None: the preset's)."""
    num_shared_experts: int | None = None
    """Always-on shared experts (None: the preset's)."""
    load_balance: LoadBalance | None = None
    """Router load balancing: aux_loss | bias | none (None: the preset's)."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing aux loss in the trained loss (None: the preset's)."""
    bias_update_rate: float | None = None
    """Step of the bias-based balancing update per optimizer step (None: the preset's)."""

    def __post_init__(self) -> None:
        # "mxmoe" is the converter's name in torchtitan; both name the one mx converter
        self.converters = list(dict.fromkeys("mx" if c == "mxmoe" else c for c in self.converters))


@dataclass
class Optimizer:
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and 1-d parameters)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    """Steps of linear warmup to optimizer.lr; then cosine decay to the end of training."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class Training:
    steps: int = 100
    """Optimizer steps to train for (total, including resumed ones)."""
    local_batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Gradient clipping max norm (0 disables)."""
    mixed_precision: MixedPrecision = "bf16"
    """Compute on CUDA: bf16 (autocast over fp32 weights) | fp32 | tf32 (TF32 matmuls); CPU: fp32."""
    cuda_graph: bool = False
    """Capture forward+backward as one CUDA graph and replay it (one GPU; no FSDP / expert parallelism)."""
    device: Device = "auto"
    """Device: auto (cuda if available) | cpu | cuda."""
    cpu_threads: int = 0
    """Torch intra-op threads on CPU (0 = torch's default; 1 suits tiny models)."""
    stop_grace_s: float = 20.0
    """Seconds SIGTERM / Ctrl-C leaves the step in progress to finish before its save and stop; a step
    still running then is given up, nothing of it saved (exit status 143 / 130)."""


@dataclass
class Validation:
    freq: int = 50
    """Validation loss every this many steps and at the last step (0 disables)."""
    steps: int = 4
    """Batches per validation (0 disables)."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile the model: each block's parts (see whole_model)."""
    backend: str = "inductor"
    """torch.compile backend: inductor; aot_eager_decomp_partition traces and runs eagerly (a quick check)."""
    whole_model: bool = False
    """With enable: the whole model as one graph (one process); fastest with training.cuda_graph."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP degree of the dense parameters; -1 = the world size (the only value supported)."""
    expert_parallel_degree: int = 1
    """Ranks the experts are sharded over (divides the world size and num_experts)."""
    tensor_parallel_degree: int = 1
    """Tensor parallelism: not supported (the mx converter refuses > 1)."""
    timeout_s: int = 300
    """Process-group timeout in seconds (collectives fail instead of hanging)."""


@dataclass
class Data:
    path: str = ""
    """Text file or folder of text files; empty = the stdlib; python-env = every .py file of this env."""
    val_fraction: float = 0.05
    """Fraction of files (chosen by file-name hash) held out for validation."""
    max_files: int = 0
    """Use at most this many files (after the split, in hash order); 0 = all."""
    extensions: list[str] = field(default_factory=lambda: [".py"])
    """File suffixes read from a folder (each a file name's ending, e.g. ".py"); empty = every file."""
    max_file_bytes: int = 2**28
    """Largest data file read, in bytes (each rank holds the corpus in memory); a larger one is an error."""


@dataclass
class Checkpoint:
    folder: str = ""
    """Checkpoint folder (empty: no checkpoints)."""
    interval: int = 0
    """Save every this many steps (0 = only at the end and on SIGTERM)."""
    last_save: bool = True
    """Save after the last step (false: a finished run saves none; SIGTERM and interval saves stay)."""
    keep_latest_k: int = 2
    """Complete checkpoints kept, older ones deleted (0 keeps all)."""
    threads: int = 0
    """Threads per rank that write (a file each) and hash a save (0: min(8, this process's CPUs / the
    host's ranks)); one thread writes ~3.5x slower (docs/training.md#checkpoints)."""
    resume: bool = True
    """Resume from the latest complete checkpoint in folder, if there is one."""
    fallback: bool = False
    """If the latest checkpoint fails its checksums, set it aside (step-N.corrupt), resume the one before."""
    allow_precision_change: bool = False
    """Resume a checkpoint of another precision (converters, mx recipe, mixed_precision), with a warning."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log loss (mean over the interval), lr, tokens/s and memory every this many steps."""
    enable_tensorboard: bool = False
    """Also write TensorBoard events to job.dump_folder (pip install 'mxmoe[tensorboard]')."""
    enable_wandb: bool = False
    """Also log to Weights & Biases what TensorBoard gets (pip install 'mxmoe[wandb]'; WANDB_MODE=offline
    writes the run under job.dump_folder/wandb only)."""
    wandb_project: str = "mxmoe"
    """W&B project of the run (with enable_wandb; the run is named after its run id)."""
    progress_bar: bool = True
    """A tqdm progress bar on rank 0 when stderr is a terminal (else a line every log_freq steps)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """torch.profiler traces of training steps."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder unless absolute."""
    profile_freq: int = 10
    """Profile the last profiler_active steps of every profile_freq steps."""
    profiler_active: int = 1
    """Steps recorded per trace (1 <= profiler_active < profile_freq)."""
    profile_repeat: int = 1
    """Traces written per run (0 = one every profile_freq steps)."""


@dataclass
class Debug:
    seed: int = 0
    """Seed of the model's initialization, the data order and the RNGs."""
    deterministic: bool = False
    """Bit-reproducible runs: same config, seed, GPU and software, same losses (mxmoe.train.determinism)."""


@dataclass
class JobConfig:
    """`mxmoe train`'s configuration, one field per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    mx: MXOptions = field(default_factory=MXOptions)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    compile: Compile = field(default_factory=Compile)
    parallelism: Parallelism = field(default_factory=Parallelism)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, typing.Any]:
        """{"section.key": value} of every field."""
        return {f"{sec}.{k}": v for sec, body in self.to_dict().items() for k, v in body.items()}

    def digest(self) -> str:
        """SHA-256 of the resolved config (every field, as JSON)."""
        return hashlib.sha256(json.dumps(self.flat(), sort_keys=True, default=str).encode()).hexdigest()


RENAMED_KEYS: dict[str, str] = {
    "training.batch_size": "training.local_batch_size",
    "training.lr": "optimizer.lr",
    "training.beta1": "optimizer.beta1",
    "training.beta2": "optimizer.beta2",
    "training.weight_decay": "optimizer.weight_decay",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "training.min_lr_ratio": "lr_scheduler.min_lr_factor",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "training.compile": "compile.enable",
    "training.compile_backend": "compile.backend",
    "training.compile_full": "compile.whole_model",
    "training.val_interval": "validation.freq",
    "training.val_batches": "validation.steps",
    "checkpoint.keep_latest": "checkpoint.keep_latest_k",
    "metrics.folder": "job.dump_folder",
    "metrics.tensorboard": "metrics.enable_tensorboard",
    "profiling.profile_active": "profiling.profiler_active",
}
"""Old key -> the key that replaced it (torchtitan 0.2's spelling of the same idea)."""
_RENAME_NOTES = {
    "training.compile_full": ", set together with compile.enable=true",
}


TORCHTITAN_KEYS: dict[str, str] = {
    "checkpoint.enable": "mxmoe train checkpoints when checkpoint.folder is set (--checkpoint.folder=PATH; "
    "empty, the default, saves none)",
    "validation.enable": "mxmoe train validates every validation.freq steps (--validation.freq=N; "
    "0 disables)",
    "job.config_file": "the config is --config NAME|FILE",
}
"""torchtitan keys with no field here -> what mxmoe calls the same idea. On the command line
`--job.config_file FILE` is taken as `--config FILE`; the others (and job.config_file in a file) are
refused naming their equivalent."""


def torchtitan_key_message(key: str) -> str:
    """What an error says of torchtitan's key `key` (a key of TORCHTITAN_KEYS)."""
    return f"{key} is torchtitan's key; {TORCHTITAN_KEYS[key]}"


def renamed_key_message(old: str) -> str:
    """What an error says of the old key `old` (a key of RENAMED_KEYS)."""
    return f"{old} is now {RENAMED_KEYS[old]}{_RENAME_NOTES.get(old, '')}"


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
    "optimizer.lr": Range(0.0, low_open=True),
    "optimizer.beta1": Range(0.0, 1.0, high_open=True),
    "optimizer.beta2": Range(0.0, 1.0, high_open=True),
    "optimizer.weight_decay": Range(0.0),
    "lr_scheduler.min_lr_factor": Range(0.0, 1.0),
    "training.max_norm": Range(0.0, note="0 disables clipping"),
    "training.stop_grace_s": Range(0.0, low_open=True),
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
    opt = cfg.optimizer
    if cfg.parallelism.timeout_s < 1:
        raise ConfigError(f"parallelism.timeout_s={cfg.parallelism.timeout_s}: expected >= 1")
    # the sampler seeds torch's 64-bit generator with seed * 1_000_003 + epoch
    if not 0 <= cfg.debug.seed < 2**32:
        raise ConfigError(f"debug.seed={cfg.debug.seed}: expected 0 <= seed < 2**32")
    # AdamW's step size lr / (1 - beta1**t) is a float32 scalar: beyond float32 it fails mid-step
    f32_max = float.fromhex("0x1.fffffep+127")
    if 0 <= opt.beta1 < 1 and opt.lr / (1 - opt.beta1) > f32_max:
        raise ConfigError(
            f"optimizer.lr={opt.lr!r}: expected lr / (1 - optimizer.beta1) <= {f32_max:.4g} (AdamW's step "
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


def section_types() -> dict[str, type]:
    """{section: its dataclass}, in JobConfig's order."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def check_ranks_data(identity: dict, path: str) -> None:
    """Collective over the default process group: ConfigError on every rank, naming what each rank
    read, unless every rank's corpus (`mxmoe.train.data.Corpus.identity`: its files' names and
    sizes, its token counts, the hash of its bytes) is rank 0's. The same config can name different
    data: a relative data.path from different working folders, a folder that differs between hosts,
    files that differ in content only."""
    import torch.distributed as dist

    def key(i: dict) -> tuple:
        return i["sha256"], i["train_tokens"], i["val_tokens"], i.get("content_sha256")

    ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(ids, identity)
    if all(key(i) == key(ids[0]) for i in ids):
        return
    same_names = all(key(i)[:3] == key(ids[0])[:3] for i in ids)
    each = "; ".join(
        f"rank {r}: {i['source']} ({i['files']} files, {i['train_tokens'] + i['val_tokens']} tokens, corpus "
        f"{i['sha256'][:12]}"
        + (f", contents {str(i.get('content_sha256'))[:12]}" if same_names else "")
        + ")"
        for r, i in enumerate(ids)
    )
    what = " (files of the same names and sizes, other contents)" if same_names else ""
    raise ConfigError(
        f"the ranks read different data for data.path={path!r}{what}: {each}; give every rank the same "
        "files (an absolute --data.path, on a file system they share)"
    )


def field_types(section: type) -> dict[str, typing.Any]:
    """{field: its type} of one section's dataclass."""
    return typing.get_type_hints(section)


# ---------------------------------------------------------------- TOML files


def _check_value(key: str, value, tp) -> typing.Any:
    """A TOML value of `key` checked against the field type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            why = why_not_accepted(key.rpartition(".")[2], value, typing.get_args(tp))
            raise ConfigError(f"{key} = {value!r}: {why}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check_value(key, value, args[0])
    if origin is list:
        (elem,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list, e.g. [\"a\", \"b\"]")
        return [_check_value(key, v, elem) for v in value]
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {tp.__name__}, got {type(value).__name__}")
    return float(value) if tp is float else value


def config_from_dict(data: dict, where: str) -> JobConfig:
    """A JobConfig from parsed TOML `data` ({section: {key: value}}); ConfigError naming `where`
    (the file) and the key for an unknown or renamed key or a value of the wrong type."""
    sections = section_types()
    built = {}
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: top-level key {section!r} must be a [section] table")
        if section not in sections:
            raise ConfigError(
                f"{where}: unknown config section [{section}]; expected one of {list(sections)}"
            )
        hints = field_types(sections[section])
        values = {}
        for name, value in body.items():
            key = f"{section}.{name}"
            if key in RENAMED_KEYS:
                raise ConfigError(f"{where}: {renamed_key_message(key)}")
            if key in TORCHTITAN_KEYS:
                raise ConfigError(f"{where}: {torchtitan_key_message(key)}")
            if name not in hints:
                raise ConfigError(f"{where}: unknown config key {key!r}; [{section}] has {list(hints)}")
            try:
                values[name] = _check_value(key, value, hints[name])
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
        try:
            built[section] = sections[section](**values)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: [{section}]: {e}") from None
    return JobConfig(**built)


def load_toml(config: str) -> JobConfig:
    """The JobConfig of `config`: a config shipped with mxmoe by name (`mxmoe.configs`) or a TOML file."""
    from mxmoe import configs

    try:
        path = configs.resolve(config, kind="trainer")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {config!r}: file not found{configs.hint(config)}") from None
    except IsADirectoryError:
        raise ConfigError(f"--config {config!r}: is a folder, expected a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {config!r}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {config!r}: not UTF-8 text ({e}); expected a UTF-8 TOML file") from None
    except OSError as e:
        raise ConfigError(f"--config {config!r}: cannot be read: {e}") from None
    return config_from_dict(data, str(path))


# ---------------------------------------------------------------- the command line

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse_bool(args: list[str]) -> bool:
    low = args[0].strip().lower()
    if low in _TRUE or low in _FALSE:
        return low in _TRUE
    raise ValueError(f"{args[0]!r} is not a bool: expected true or false")


def _registry() -> tyro.constructors.ConstructorRegistry:
    """tyro's rules for the trainer: booleans take a value (true/false); lists are comma separated
    (torchtitan's rule), their entries checked against a Literal's choices."""
    spec = tyro.constructors.PrimitiveConstructorSpec
    registry = tyro.constructors.ConstructorRegistry()

    @registry.primitive_rule
    def bool_rule(info: tyro.constructors.PrimitiveTypeInfo):
        if info.type is not bool:
            return None
        return spec(
            nargs=1,
            metavar="{true,false}",
            instance_from_str=_parse_bool,
            is_instance=lambda x: isinstance(x, bool),
            str_from_instance=lambda x: ["true" if x else "false"],
        )

    @registry.primitive_rule
    def comma_list_rule(info: tyro.constructors.PrimitiveTypeInfo):
        if info.type_origin is not list:
            return None
        (elem,) = typing.get_args(info.type)
        if elem is str:
            choices = None
        elif typing.get_origin(elem) is Literal:
            choices = typing.get_args(elem)
        else:
            return None

        def parse(args: list[str]) -> list[str]:
            items = [t.strip() for t in args[0].split(",") if t.strip()]
            bad = [t for t in items if choices is not None and t not in choices]
            if bad:
                raise ValueError(f"{bad[0]!r} is not one of {', '.join(choices)}")
            return items

        return spec(
            nargs=1,
            metavar=("{" + ",".join(choices) + "},..." if choices else "A,B,..."),
            instance_from_str=parse,
            is_instance=lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x),
            str_from_instance=lambda x: [",".join(x)],
        )

    return registry


def _bool_keys() -> set[str]:
    return {
        f"{section}.{name}"
        for section, cls in section_types().items()
        for name, tp in field_types(cls).items()
        if tp is bool
    }


def _prepare(argv: list[str], twice: list[str] | None = None) -> tuple[str | None, list[str]]:
    """(the --config value, the other arguments for tyro): an old key refused naming its
    replacement, torchtitan's keys taken or refused (TORCHTITAN_KEYS), a bare boolean option given
    the value true and its negative form (`--mx.no-convert-linears`, `--mx.no_convert_linears`,
    torchtitan 0.2's flags) the value false; `twice` gets a line per key given more than once (the
    last applies, as tyro takes it)."""
    twice = [] if twice is None else twice
    bools = _bool_keys()
    config, out, i = None, [], 0
    given: dict[str, str] = {}  # key -> its argument, to name a key given twice
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        section, _, name = key.partition(".")
        if key in ("config", "job.config_file"):
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    raise ConfigError(f"--{key} needs a value: a config name (mxmoe config list) or a file")
                i += 1
                value = argv[i]
            if config is not None:
                raise ConfigError(f"--config is given twice ({config!r} and {value!r})")
            config = value
        elif key in RENAMED_KEYS:
            raise ConfigError(f"--{renamed_key_message(key).replace(' is now ', ' is now --', 1)}")
        elif key in TORCHTITAN_KEYS:
            raise ConfigError(f"--{torchtitan_key_message(key)}")
        elif name.startswith("no_") and key not in bools and f"{section}.{name[3:]}" in bools:
            if eq:
                raise ConfigError(
                    f"{arg}: a negative flag takes no value; expected --{section}.{name[3:]}={value}"
                    f" or --{key}"
                )
            key = f"{section}.{name[3:]}"
            if key in given:
                twice.append(f"--{key} is given twice ({given[key]!r} and {arg!r}): the last applies")
            given[key] = arg
            out.append(f"--{key}=false")
        else:
            _refuse_old_value(key, value if eq else argv[i + 1] if i + 1 < len(argv) else None)
            if "." in key:
                alone = eq or i + 1 >= len(argv) or argv[i + 1].startswith("--")
                shown = arg if alone else f"{arg} {argv[i + 1]}"
                if key in given:
                    twice.append(f"--{key} is given twice ({given[key]!r} and {shown!r}): the last applies")
                given[key] = shown
            out.append(arg)
            if key in bools and not eq and (i + 1 >= len(argv) or argv[i + 1].startswith("-")):
                out.append("true")
        i += 1
    return config, out


def _refuse_old_value(key: str, value: str | None) -> None:
    """ConfigError for a renamed or removed value of an [mx] option, saying what replaced it or why
    it went (tyro's own message would only list the choices)."""
    section, _, name = key.partition(".")
    if section == "mx" and ((name, value) in RENAMED_VALUES or (name, value) in REMOVED_VALUES):
        choices = typing.get_args(field_types(MXOptions)[name])
        raise ConfigError(f"{key}={value!r}: {why_not_accepted(name, value, choices)}")


def description() -> str:
    """The head of `mxmoe train --help`."""
    import textwrap

    from mxmoe import configs

    paragraphs = [
        "Train an MoE (or dense) byte-level language model, bf16 or MXFP8.",
        "Config: --config NAME|FILE, a config that ships with mxmoe (one of "
        f"{', '.join(configs.names('trainer'))}: `mxmoe config list`) or a TOML file of the sections "
        "below; the options below override it.",
        "Booleans: --key, --key=true, --key=false, --no_key (e.g. --mx.no_convert_linears). Lists: comma "
        "separated. Dashes and underscores are one (--training.local-batch-size). An old key (e.g. "
        "--training.batch_size) is refused with its new name; --job.config_file is --config.",
    ]
    # tyro joins a line starting with a letter to the one before: continuation lines are indented
    return "\n\n".join(textwrap.fill(p, 78, subsequent_indent="  ") for p in paragraphs)


def parse_args(argv: list[str], prog: str = "mxmoe train") -> JobConfig:
    """The JobConfig of `argv`: `--config NAME|FILE` (applied first, wherever it stands) and
    `--section.key value` / `--section.key=value` options (a key given twice: the last, with a
    warning on stderr naming both). ConfigError for a bad config file or an old key; SystemExit
    from tyro (status 2, its message on stderr) for an unknown option or a bad value, and for
    `--help` (status 0)."""
    twice: list[str] = []
    config, rest = _prepare(list(argv), twice)
    base = load_toml(config) if config is not None else JobConfig()
    if os.environ.get("RANK", "0") == "0":  # a base list of options, overrides after it: said once
        for line in twice:
            print(f"mxmoe WARNING: {line}", file=sys.stderr)  # as the run's own warnings
    return tyro.cli(
        JobConfig,
        args=rest,
        default=base,
        prog=prog,
        description=description(),
        use_underscores=True,
        config=(tyro.conf.FlagConversionOff,),
        registry=_registry(),
    )
