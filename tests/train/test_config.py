"""Config parsing: a TOML file (by name or path) + --section.key value overrides on tyro, and errors."""

import dataclasses
import typing
from pathlib import Path

import pytest

from mxmoe import configs
from mxmoe.recipe import GEMM_BACKENDS
from mxmoe.train import trainer
from mxmoe.train.config import (
    RENAMED_KEYS,
    TORCHTITAN_KEYS,
    ConfigError,
    JobConfig,
    field_types,
    load_toml,
    parse_args,
    section_types,
)

CONFIGS = configs.names("trainer")


def test_torchtitan_flags_as_typed():
    cfg = parse_args(
        [
            "--model.converters=mx",
            "--mx.recipe_name=mxfp8",
            "--mx.mxfp8_dim1_cast_kernel_choice=cuda",
            "--compile.enable",
            "--training.steps=100",
        ]
    )
    assert cfg.model.converters == ["mx"] and cfg.mx.recipe_name == "mxfp8"
    assert cfg.mx.mxfp8_dim1_cast_kernel_choice == "cuda"
    assert cfg.compile.enable is True and cfg.training.steps == 100


def test_override_forms_and_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[training]\nsteps = 7\n[optimizer]\nlr = 1\n[mx]\nfilter_fqns = ["a"]\n[model]\nconverters = []\n'
    )
    cfg = parse_args(
        [
            "--optimizer.lr",
            "0.5",
            "--mx.filter_fqns=x, y",
            "--config",  # applied first, wherever it stands
            str(toml),
            "--model.dim=None",
            "--model.n_layers=3",
            "--compile.enable=false",
            "--metrics.enable_tensorboard",
            "--debug.deterministic",
            "true",
            "--checkpoint.resume=False",
            "--data.extensions=",
        ]
    )
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 0.5 and isinstance(cfg.optimizer.lr, float)
    assert cfg.mx.filter_fqns == ["x", "y"] and cfg.data.extensions == []
    assert cfg.model.dim is None and cfg.model.n_layers == 3
    assert cfg.compile.enable is False and cfg.metrics.enable_tensorboard is True
    assert cfg.debug.deterministic is True and cfg.checkpoint.resume is False
    assert load_toml(str(toml)).optimizer.lr == 1.0  # TOML int accepted for a float field


def test_none_and_the_string_none():
    # model.load_balance="none" is no balancing; None gives the field back to the preset
    assert parse_args(["--model.load_balance=none"]).model.load_balance == "none"
    assert parse_args(["--model.load_balance", "bias"]).model.load_balance == "bias"
    assert parse_args(["--model.load_balance=None"]).model.load_balance is None
    assert parse_args(["--model.top_k=None"]).model.top_k is None


def test_mxmoe_is_the_mx_converter():
    """torchtitan names the converter mxmoe: the trainer takes it as mx (issue 47, item 2)."""
    assert parse_args(["--model.converters=mxmoe"]).model.converters == ["mx"]
    assert parse_args(["--model.converters=mx,mxmoe"]).model.converters == ["mx"]
    assert parse_args(["--model.converters="]).model.converters == []


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--trainig.steps=3"], "Unrecognized options: --trainig.steps=3"),
        (["--training.stepz=3"], "Unrecognized options: --training.stepz=3"),
        (["--training.steps=abc"], "--training.steps"),
        (["--compile.enable=maybe"], "'maybe' is not a bool: expected true or false"),
        (["--training.steps"], "Missing value for argument '--training.steps'"),
        (["--model.name=moe_3b"], "invalid choice 'moe_3b' for argument '--model.name'"),
        (["--mx.recipe_name=mxfp4"], "invalid choice 'mxfp4' for argument '--mx.recipe_name'"),
        (["--training.mixed_precision=fp16"], "invalid choice 'fp16'"),
        (["--model.converters=float8"], "'float8' is not one of mx, mxmoe"),
        (["steps=3"], "Unrecognized options: steps=3"),
    ],
)
def test_bad_options_stop_at_parse_time_with_tyros_message(capsys, argv, match):
    """A wrong type, an unknown key or a value outside a Literal's choices: exit status 2 and tyro's
    message, before anything is built."""
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert match in " ".join(err.replace("│", " ").split()), err


@pytest.mark.parametrize("old", sorted(RENAMED_KEYS))
def test_every_old_key_is_refused_naming_the_new_one(tmp_path, capsys, old):
    """Each entry of the OLD -> NEW table, on the command line (both forms) and in a TOML file."""
    new = RENAMED_KEYS[old]
    for argv in ([f"--{old}=1"], [f"--{old}", "1"], [f"--{old.replace('_', '-')}=1"]):
        with pytest.raises(ConfigError, match=f"--{old} is now --{new}"):
            parse_args(argv)
    section, key = old.split(".")
    toml = tmp_path / "old.toml"
    toml.write_text(f"[{section}]\n{key} = 1\n")
    with pytest.raises(ConfigError, match=f"{old} is now {new}"):
        load_toml(str(toml))
    assert trainer.main([f"--{old}=1"]) == 2
    assert f"mxmoe train: error: --{old} is now --{new}" in capsys.readouterr().err
    # the new key exists, in the section the table names
    new_section, new_key = new.split(".")
    assert new_key in field_types(section_types()[new_section])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--config", "/nonexistent.toml"], "file not found; the configs that ship with mxmoe: debug_dense"),
        (["--config", "configs/debug_moe.toml"], "(the configs that ship with mxmoe go by name: debug_moe)"),
        (["--config", "moe_9b"], "file not found"),
        (["--config"], "--config needs a value"),
        (["--config", "debug_moe", "--config=moe_1b"], "--config is given twice"),
        (["--config", "torchtitan/deepseek_v3_debug_0.2"], "is a torchtitan job config, not mxmoe train's"),
    ],
)
def test_bad_config_names_it(argv, match):
    with pytest.raises(ConfigError, match=match.replace("(", "\\(").replace(")", "\\)")):
        parse_args(argv)


@pytest.mark.parametrize(
    "body, match",
    [
        ("[nope]\nx = 1\n", "unknown config section \\[nope\\]"),
        ("[training]\nsteps = 1\nbogus = 2\n", "unknown config key 'training.bogus'"),
        ('[training]\nsteps = "10"\n', "training.steps = '10': expected int, got str"),
        ("[compile]\nenable = 1\n", "expected bool, got int"),
        ("[training]\nsteps = true\n", "expected int, got bool"),
        ('[model]\nname = "moe_3b"\n', "model.name = 'moe_3b': expected one of \\['debug_moe'"),
        ('[model]\nconverters = "mx"\n', "model.converters = 'mx': expected a list"),
        ('[mx]\nexpert_gemm = "hp"\n', "expert_gemm='hp' is now expert_gemm='bf16'"),
        ("steps = 3\n", "must be a \\[section\\] table"),
        ("[training\n", "invalid TOML"),
    ],
)
def test_bad_toml_names_the_key(tmp_path, body, match):
    """... and the file (a value of the wrong type or outside the choices did not name it)."""
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(ConfigError, match=match) as e:
        load_toml(str(p))
    assert str(p) in str(e.value), e.value


def _field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal that follows it in the class body}."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        stmt.target.id: nxt.value.value
        for stmt, nxt in zip(body, body[1:], strict=False)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(nxt, ast.Expr)
        and isinstance(nxt.value, ast.Constant)
    }


def test_every_field_has_a_docstring_and_help_shows_it(capsys):
    """Every key of every section (the [mx] section included) has a docstring, and `mxmoe train
    --help` shows the key, its docstring, its default and, for a Literal, its choices."""
    assert trainer.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    defaults = JobConfig()
    for section, cls in section_types().items():
        for f in dataclasses.fields(cls):
            doc = _field_docs(cls).get(f.name)
            assert doc and doc.strip(), f"{section}.{f.name} has no docstring"
            assert f"--{section}.{f.name} " in out, f"--{section}.{f.name}"
            assert " ".join(doc.split())[:40] in out, (section, f.name)
            tp = field_types(cls)[f.name]
            if typing.get_origin(tp) is typing.Literal:
                choices = "{" + ",".join(typing.get_args(tp)) + "}"
                assert f"--{section}.{f.name} {choices}" in out.replace(", ", ","), (section, f.name)
            default = getattr(getattr(defaults, section), f.name)
            if isinstance(default, bool):
                assert f"(default: {str(default).lower()})" in out


def test_model_names_and_configs_in_help_come_from_their_registries(capsys):
    from mxmoe.models import PRESETS

    assert trainer.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "--model.name {" + ",".join(PRESETS) + "}" in out
    assert all(name in out for name in configs.names("trainer"))


@pytest.mark.parametrize("kind", ["folder", "latin1"])
def test_an_unreadable_config_file_is_a_config_error(tmp_path, capsys, kind):
    path = tmp_path / "c.toml"
    if kind == "folder":
        path.mkdir()
        match = "is a folder, expected a TOML file"
    else:
        path.write_bytes('[training]\n# caf\u00e9\nsteps = 3\n'.encode("latin-1"))
        match = "not UTF-8 text"
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", str(path)])
    assert trainer.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert match in err and str(path) in err and "Traceback" not in err, err


def test_an_empty_config_name_is_named_as_empty(capsys):
    # Path("") is the current folder: it was refused as "is a folder, expected a TOML file"
    assert trainer.main(["--config", ""]) == 2
    err = capsys.readouterr().err
    assert "--config '' is empty; expected a config name (`mxmoe config list`) or a TOML file" in err, err


def test_ranks_with_different_configs_stop_naming_the_keys(tmp_path):
    """rank 1 started with another lr and step count: both ranks stop at start (no training, no
    hang until the timeout) with an error naming the differing keys and both values."""
    from conftest import spawn_ranks
    from test_trainer import TINY

    argv = TINY + ["--training.steps=2", "--parallelism.timeout_s=60", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_with_extra, 2, argv, ["--optimizer.lr=0.001", "--training.steps=3"], str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rc{r}").read_text() == "2"
        err = (tmp_path / f"err{r}").read_text()
        assert "the ranks were started with different configs" in err, err
        assert "optimizer.lr (rank 0: 0.003, rank 1: 0.001)" in err, err
        assert "training.steps (rank 0: 2, rank 1: 3)" in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _rank_with_extra(rank: int, world: int, port: int, argv: list[str], extra: list[str], out: str) -> None:
    """A trainer rank; rank 1 gets `extra` options; its exit status and stderr go to files in `out`."""
    import contextlib
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    with open(Path(out, f"err{rank}"), "w") as err, contextlib.redirect_stderr(err):
        rc = trainer.main(argv + (extra if rank == 1 else []))
    Path(out, f"rc{rank}").write_text(str(rc))


def _rank_in_its_folder(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """A trainer rank started in out/cwd{rank}; its exit status and stderr go to files in `out`."""
    import os

    os.chdir(Path(out, f"cwd{rank}"))
    _rank_with_extra(rank, world, port, argv, [], out)


def test_ranks_reading_different_data_stop_naming_each_ranks_corpus(tmp_path):
    """One config, a relative data.path, each rank started in another folder: every rank stops at start
    naming what each read (they once trained silently on different corpora)."""
    from conftest import spawn_ranks
    from test_trainer import TINY

    for r in range(2):
        data = tmp_path / f"cwd{r}" / "data"
        data.mkdir(parents=True)
        for i in range(6):
            (data / f"m{i}.py").write_text(f"# rank {r} file {i}\n" + "x = 1\n" * (40 + 10 * r))
    argv = TINY + ["--training.steps=2", "--data.path=data", f"--job.dump_folder={tmp_path}/run"]
    spawn_ranks(_rank_in_its_folder, 2, argv, str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rc{r}").read_text() == "2"
        err = (tmp_path / f"err{r}").read_text()
        assert "the ranks read different data for data.path='data': rank 0: " in err, err
        assert f"rank 0: {tmp_path / 'cwd0' / 'data'} (6 files, " in err, err
        assert f"rank 1: {tmp_path / 'cwd1' / 'data'} (6 files, " in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_main_reports_config_errors(capsys):
    assert trainer.main(["--training.stepz=3"]) == 2
    assert "training.stepz" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arg, match",
    [
        ("--metrics.log_freq=0", "metrics.log_freq=0: expected >= 1"),
        ("--training.local_batch_size=0", "training.local_batch_size=0: expected >= 1"),
        ("--checkpoint.keep_latest_k=-1", "checkpoint.keep_latest_k=-1: expected >= 0"),
        ("--training.steps=0", "training.steps=0: expected >= 1"),
        ("--optimizer.lr=inf", "optimizer.lr=inf: expected a finite number > 0"),
        ("--optimizer.lr=nan", "optimizer.lr=nan: expected a finite number > 0"),
        ("--optimizer.lr=0", "optimizer.lr=0.0: expected a finite number > 0"),
        ("--optimizer.lr=-1e-3", "optimizer.lr=-0.001: expected a finite number > 0"),
        ("--lr_scheduler.min_lr_factor=1.5", "lr_scheduler.min_lr_factor=1.5: expected 0 <= value <= 1"),
        ("--lr_scheduler.min_lr_factor=-0.1", "lr_scheduler.min_lr_factor=-0.1: expected 0 <= value <= 1"),
        ("--training.max_norm=nan", "training.max_norm=nan: expected a finite number >= 0 (0 disables"),
        # float options of the model: NaN / inf once trained with NaN expert biases, rc 0
        ("--model.bias_update_rate=nan", "model.bias_update_rate=nan: expected a finite number >= 0"),
        ("--model.bias_update_rate=inf", "model.bias_update_rate=inf: expected a finite number >= 0"),
        ("--model.aux_loss_coef=nan", "model.aux_loss_coef=nan: expected a finite number >= 0"),
        ("--model.num_shared_experts=-1", "model.num_shared_experts=-1: expected >= 0"),
        ("--model.moe_hidden_dim=0", "model.moe_hidden_dim=0: expected >= 1"),
        ("--data.max_files=-1", "data.max_files=-1: expected >= 0"),
        ("--data.val_fraction=1", "data.val_fraction=1.0: expected 0 <= value < 1"),
        # not "the corpus has 0 tokens": what is wrong and the two ways out
        ("--data.val_fraction=0", "data.val_fraction=0 holds out no validation data, but validation is on"),
        ("--optimizer.beta2=1", "optimizer.beta2=1.0: expected 0 <= value < 1"),
        ("--optimizer.weight_decay=inf", "optimizer.weight_decay=inf: expected a finite number >= 0"),
        # a removed value: why, and where to read it; a renamed one: its new name (before tyro's check)
        ("--mx.gemm_backend=fp8", "mx.gemm_backend='fp8': the Hopper fp8 GEMM backend was removed"),
        ("--mx.gemm_backend fp8", "mx.gemm_backend='fp8': the Hopper fp8 GEMM backend was removed"),
        ("--mx.expert_gemm=hp",
         "mx.expert_gemm='hp': expected one of ['mx', 'bf16'] (expert_gemm='hp' is now expert_gemm='bf16')"),
        ("--mx.expert_gemm=bf16 --mx.convert_grouped_experts=false",
         "mx.convert_grouped_experts=false leaves them unconverted"),
        # finite, but AdamW's float32 step size lr / (1 - beta1) overflows mid-step
        ("--optimizer.lr=1e38", "optimizer.lr=1e+38: expected lr / (1 - optimizer.beta1) <= 3.403e+38"),
        (f"--debug.seed={2**70}", f"debug.seed={2**70}: expected 0 <= seed < 2**32"),
        ("--debug.seed=-1", "debug.seed=-1: expected 0 <= seed < 2**32"),
        ("--parallelism.timeout_s=0", "parallelism.timeout_s=0: expected >= 1"),
        ("--parallelism.timeout_s=-5", "parallelism.timeout_s=-5: expected >= 1"),
        ("--compile.enable --compile.backend=inductr",
         "compile.backend='inductr': not a torch.compile backend; expected one of ["),
    ],
)
def test_main_rejects_out_of_range_values(capsys, arg, match):
    # checked before any model or data is built: an error naming the key, not a ZeroDivisionError
    assert trainer.main([*arg.split(), "--training.device=cpu"]) == 2
    assert match in capsys.readouterr().err


def _float_fields() -> set[str]:
    """Every `section.key` of JobConfig whose type is float or float | None."""
    import dataclasses
    import typing

    from mxmoe.train.config import JobConfig

    out = set()
    for sec, cls in typing.get_type_hints(JobConfig).items():
        for name, tp in typing.get_type_hints(cls).items():
            if float in (tp, *typing.get_args(tp)):
                out.add(f"{sec}.{name}")
    assert {f.name for f in dataclasses.fields(JobConfig)} >= {k.split(".")[0] for k in out}
    return out


def test_every_float_option_has_a_range_and_refuses_nan_and_infinities():
    from mxmoe.train.build import check_values
    from mxmoe.train.config import FLOAT_RANGES

    floats = _float_fields()
    assert "model.bias_update_rate" in floats and "optimizer.lr" in floats
    assert set(FLOAT_RANGES) == floats, "a float option without a range (or a range of no option)"
    for key in sorted(floats):
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ValueError, match=rf"^{key}={bad}: expected "):
                check_values(parse_args([f"--{key}={bad}", "--validation.freq=0"]))
        # the default (or the preset's, for None) passes
        check_values(parse_args(["--validation.freq=0"]))


def test_a_cuda_device_without_a_gpu_is_a_setting_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trainer.main(["--training.device=cuda", "--training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "mxmoe train: error: training.device='cuda': no CUDA GPU is available here" in err
    assert "--training.device=cpu" in err and "Traceback" not in err, err


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_parse_by_name_and_by_path(name):
    cfg = load_toml(name)
    assert cfg.training.steps > 0 and cfg == load_toml(str(configs.path(name)))


def test_debug_config_trains_with_mx_and_the_default_recipe():
    from mxmoe.options import MXOptions

    cfg = load_toml("debug_moe")
    assert cfg.model.converters == ["mx"]
    # the trainer's defaults are MXOptions()'s: one recipe (its "auto" kernels run torch on CPU)
    mine = MXOptions(
        recipe_name=cfg.mx.recipe_name, mxfp8_dim1_cast_kernel_choice=cfg.mx.mxfp8_dim1_cast_kernel_choice
    )
    assert mine.to_recipe() == MXOptions().to_recipe()


def test_mx_recipe_default_is_the_library_default_and_help_lists_recipes(capsys):
    from mxmoe.recipe import DEFAULT_RECIPE_NAME, RECIPES

    assert parse_args([]).mx.recipe_name == DEFAULT_RECIPE_NAME == "mxfp8_rceil"
    assert trainer.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    entry = out[out.index("--mx.recipe_name") :].split("--mx.", 2)[1]
    assert "(default: mxfp8_rceil)" in entry and all(name in entry for name in RECIPES)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_use_the_default_recipe(name):
    from mxmoe.recipe import DEFAULT_RECIPE_NAME

    assert load_toml(name).mx.recipe_name == DEFAULT_RECIPE_NAME


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
def test_mx_gemm_backend_reaches_every_converted_module(backend):
    from mxmoe.models import Transformer
    from mxmoe.train.parallel import make_parallel_dims
    from mxmoe.train.trainer import build_model_args, mx_convert

    cfg = parse_args(["--config", "debug_moe", f"--mx.gemm_backend={backend}"])
    model = Transformer(build_model_args(cfg))
    mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    backends = [m.recipe.gemm_backend for m in model.modules() if hasattr(m, "recipe")]
    # the default filter keeps attention, router and head high precision: per block the shared
    # expert's 3 linears and the expert group
    assert len(backends) == 8 and set(backends) == {backend}


def test_mx_exchange_only_converts_the_experts_alone():
    """--mx.expert_gemm=bf16 --mx.convert_linears=false: no Linear is MX, every expert group holds the
    recipe with expert_gemm="bf16" (bf16 GEMMs, MXFP8 exchange)."""
    from torch import nn

    from mxmoe.models import Transformer
    from mxmoe.nn import MXGroupedExperts, MXLinear
    from mxmoe.train.build import build_model_args, mx_convert, precision
    from mxmoe.train.parallel import make_parallel_dims

    args = ["--config", "debug_moe", "--mx.expert_gemm=bf16", "--mx.convert_linears=false"]
    cfg = parse_args(args)
    model = Transformer(build_model_args(cfg))
    report = mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    experts = [m for m in model.modules() if isinstance(m, MXGroupedExperts)]
    assert len(experts) == model.args.n_layers
    assert {m.recipe.expert_gemm for m in experts} == {"bf16"}
    assert not any(isinstance(m, MXLinear) for m in model.modules())
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) >= 12
    assert report.converted["Linear"] == [] and "expert_gemm=bf16" in report.summary()
    assert "experts in the compute dtype on MX-rounded rows" in precision(model, cfg)


@pytest.mark.interpreter  # a CPU model with 'triton' casts: the Triton interpreter
def test_mx_cast_kernel_choices_reach_every_converted_module():
    """--mx.mxfp8_dim0_cast_kernel_choice / dim1 set the recipe's dim0_kernel / dim1_kernel of every
    converted module (the rest of the recipe as named)."""
    import dataclasses

    from mxmoe.models import Transformer
    from mxmoe.recipe import recipe
    from mxmoe.train.parallel import make_parallel_dims
    from mxmoe.train.trainer import build_model_args, mx_convert

    cfg = parse_args(["--config", "debug_moe", "--mx.mxfp8_dim0_cast_kernel_choice=triton",
                      "--mx.mxfp8_dim1_cast_kernel_choice=torch"])
    model = Transformer(build_model_args(cfg))
    mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    recipes = {m.recipe for m in model.modules() if hasattr(m, "recipe")}
    base = recipe(cfg.mx.recipe_name)
    assert recipes == {dataclasses.replace(base, dim0_kernel="triton", dim1_kernel="torch")}


@pytest.mark.parametrize(
    "key, equivalent",
    [("checkpoint.enable", "--checkpoint.folder=PATH"), ("validation.enable", "--validation.freq=N")],
)
def test_torchtitan_keys_mxmoe_spells_otherwise_are_refused_naming_mxmoe_s(tmp_path, capsys, key, equivalent):
    """torchtitan's checkpoint.enable / validation.enable, on the command line and in a file, are
    refused with what mxmoe calls the same idea (issue 57)."""
    assert set(TORCHTITAN_KEYS) >= {"checkpoint.enable", "validation.enable", "job.config_file"}
    for argv in ([f"--{key}"], [f"--{key}=true"], [f"--{key.replace('_', '-')}", "false"]):
        with pytest.raises(ConfigError, match=f"--{key} is torchtitan's key; .*{equivalent}"):
            parse_args(argv)
    section, name = key.split(".")
    toml = tmp_path / "tt.toml"
    toml.write_text(f"[{section}]\n{name} = true\n")
    with pytest.raises(ConfigError, match=f"{key} is torchtitan's key; .*{equivalent}"):
        load_toml(str(toml))
    assert trainer.main([f"--{key}"]) == 2
    assert f"mxmoe train: error: --{key} is torchtitan's key" in capsys.readouterr().err


def test_job_config_file_is_config_and_wandb_is_a_metrics_key():
    for argv in (["--job.config_file", "debug_dense"], ["--job.config-file=debug_dense"]):
        assert parse_args(argv).model.name == "debug_dense"
    with pytest.raises(ConfigError, match="--config is given twice"):
        parse_args(["--config", "debug_moe", "--job.config_file", "debug_dense"])
    cfg = parse_args(["--metrics.enable_wandb", "--metrics.wandb_project=p"])
    assert (cfg.metrics.enable_wandb, cfg.metrics.wandb_project) == (True, "p")


@pytest.mark.parametrize(
    "argv",
    [
        ["--mx.no-convert-linears", "--compile.no_enable"],  # torchtitan 0.2's flags
        ["--mx.no_convert_linears", "--compile.no-enable"],
        ["--mx.convert_linears=false", "--compile.enable", "false"],  # values
        ["--mx.convert-linears", "false", "--compile.enable=0"],
    ],
)
def test_both_boolean_spellings(argv):
    cfg = parse_args(["--compile.enable", "--mx.convert_linears", *argv])  # the last one wins
    assert (cfg.mx.convert_linears, cfg.compile.enable) == (False, False)


def test_a_negative_flag_takes_no_value():
    with pytest.raises(ConfigError, match="a negative flag takes no value; expected --mx.convert_linears="):
        parse_args(["--mx.no-convert-linears=true"])
