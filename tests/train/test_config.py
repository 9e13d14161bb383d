"""Config parsing: TOML + --section.key=value overrides, and their errors."""

from pathlib import Path

import pytest

from mxmoe.recipe import GEMM_BACKENDS
from mxmoe.train import trainer
from mxmoe.train.config import ConfigError, load_toml, parse_args

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))


def test_torchtitan_flags_as_typed():
    cfg = parse_args(
        [
            "--model.converters=mx",
            "--mx.recipe_name=mxfp8",
            "--mx.mxfp8_dim1_cast_kernel_choice=cuda",
            "--training.compile",
            "--training.steps=100",
        ]
    )
    assert cfg.model.converters == ["mx"] and cfg.mx.recipe_name == "mxfp8"
    assert cfg.mx.mxfp8_dim1_cast_kernel_choice == "cuda"
    assert cfg.training.compile is True and cfg.training.steps == 100


def test_override_forms_and_types(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[training]\nsteps = 7\nlr = 1\n[mx]\nfilter_fqns = ["a"]\n[model]\nconverters = []\n')
    cfg = parse_args(
        [
            "--config",
            str(toml),
            "--training.lr",
            "0.5",
            "--mx.filter_fqns=x, y",
            "--model.dim=none",
            "--model.n_layers=3",
            "--training.compile=false",
            "--metrics.tensorboard",
        ]
    )
    assert cfg.training.steps == 7 and cfg.training.lr == 0.5 and isinstance(cfg.training.lr, float)
    assert cfg.mx.filter_fqns == ["x", "y"]
    assert cfg.model.dim is None and cfg.model.n_layers == 3
    assert cfg.training.compile is False and cfg.metrics.tensorboard is True
    assert load_toml(str(toml)).training.lr == 1.0  # TOML int accepted for a float field


def test_none_is_a_string_value_for_optional_str_fields():
    # model.load_balance accepts "none" (no balancing); it used to parse as None = the preset's default
    assert parse_args(["--model.load_balance=none"]).model.load_balance == "none"
    assert parse_args(["--model.load_balance", "bias"]).model.load_balance == "bias"
    assert parse_args(["--model.top_k=none"]).model.top_k is None


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--trainig.steps=3"], "unknown config section 'trainig'"),
        (["--training.stepz=3"], "unknown config key 'training.stepz'"),
        (["--training.steps=abc"], "--training.steps='abc': expected int"),
        (["--training.compile=maybe"], "expected a bool"),
        (["--training.steps"], "--training.steps needs a value"),
        # a bare unknown key is reported as unknown, not as missing a value
        (["--training.stepz"], "unknown config key 'training.stepz'"),
        (["--training.stepz", "--training.steps=3"], "unknown config key 'training.stepz'"),
        (["--trainig.compile"], "unknown config section 'trainig'"),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--steps=3"], "not of the form section.key"),
        (["--config", "/nonexistent.toml"], "file not found"),
    ],
)
def test_bad_overrides_name_the_key(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(argv)


@pytest.mark.parametrize(
    "body, match",
    [
        ("[nope]\nx = 1\n", "unknown config section 'nope'"),
        ("[training]\nsteps = 1\nbogus = 2\n", "unknown config key 'training.bogus'"),
        ('[training]\nsteps = "10"\n', "training.steps = '10': expected int, got str"),
        ("[training]\ncompile = 1\n", "expected bool, got int"),
        ("[training]\nsteps = true\n", "expected int, got bool"),
        ("steps = 3\n", "must be a \\[section\\] table"),
        ("[training\n", "invalid TOML"),
    ],
)
def test_bad_toml_names_the_key(tmp_path, body, match):
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(ConfigError, match=match):
        load_toml(str(p))


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


def test_ranks_with_different_configs_stop_naming_the_keys(tmp_path):
    """rank 1 started with another lr and step count: both ranks stop at start (no training, no
    hang until the timeout) with an error naming the differing keys and both values."""
    from conftest import spawn_ranks
    from test_trainer import TINY

    argv = TINY + ["--training.steps=2", "--parallelism.timeout_s=60", f"--metrics.folder={tmp_path}/run"]
    spawn_ranks(_rank_with_extra, 2, argv, ["--training.lr=0.001", "--training.steps=3"], str(tmp_path))
    for r in range(2):
        assert (tmp_path / f"rc{r}").read_text() == "2"
        err = (tmp_path / f"err{r}").read_text()
        assert "the ranks were started with different configs" in err, err
        assert "training.lr (rank 0: 0.003, rank 1: 0.001)" in err, err
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
    argv = TINY + ["--training.steps=2", "--data.path=data", f"--metrics.folder={tmp_path}/run"]
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
        ("--training.batch_size=0", "training.batch_size=0: expected >= 1"),
        ("--checkpoint.keep_latest=-1", "checkpoint.keep_latest=-1: expected >= 0"),
        ("--training.steps=0", "training.steps=0: expected >= 1"),
        ("--training.lr=inf", "training.lr=inf: expected a finite number > 0"),
        ("--training.lr=nan", "training.lr=nan: expected a finite number > 0"),
        ("--training.lr=0", "training.lr=0.0: expected a finite number > 0"),
        ("--training.lr=-1e-3", "training.lr=-0.001: expected a finite number > 0"),
        ("--training.min_lr_ratio=1.5", "training.min_lr_ratio=1.5: expected 0 <= value <= 1"),
        ("--training.min_lr_ratio=-0.1", "training.min_lr_ratio=-0.1: expected 0 <= value <= 1"),
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
        ("--training.beta2=1", "training.beta2=1.0: expected 0 <= value < 1"),
        ("--training.weight_decay=inf", "training.weight_decay=inf: expected a finite number >= 0"),
        ("--mx.gemm_backend=fp4",
         "mx.gemm_backend='fp4': not a GEMM backend; expected one of ['auto', 'emulated', 'native']"),
        # a removed backend: why, and where to read it
        ("--mx.gemm_backend=fp8", "mx.gemm_backend='fp8': the Hopper fp8 GEMM backend was removed"),
        ("--mx.expert_gemm=bf16", "mx.expert_gemm='bf16': expected one of ['mx', 'hp']"),
        ("--mx.expert_gemm=hp --mx.convert_grouped_experts=false",
         "mx.convert_grouped_experts=false leaves them unconverted"),
        # finite, but AdamW's float32 step size lr / (1 - beta1) overflows mid-step
        ("--training.lr=1e38", "training.lr=1e+38: expected lr / (1 - training.beta1) <= 3.403e+38"),
        (f"--training.seed={2**70}", f"training.seed={2**70}: expected 0 <= seed < 2**32"),
        ("--training.seed=-1", "training.seed=-1: expected 0 <= seed < 2**32"),
        ("--parallelism.timeout_s=0", "parallelism.timeout_s=0: expected >= 1"),
        ("--training.mixed_precision=fp16",
         "training.mixed_precision='fp16': expected bf16, fp32 or tf32"),
        ("--parallelism.timeout_s=-5", "parallelism.timeout_s=-5: expected >= 1"),
        ("--mx.mxfp8_dim1_cast_kernel_choice=cudnn", "mx.mxfp8_dim1_cast_kernel_choice='cudnn' is not"),
        ("--training.compile --training.compile_backend=inductr",
         "training.compile_backend='inductr': not a torch.compile backend; expected one of ["),
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
    assert "model.bias_update_rate" in floats and "training.lr" in floats
    assert set(FLOAT_RANGES) == floats, "a float option without a range (or a range of no option)"
    for key in sorted(floats):
        for bad in ("nan", "inf", "-inf"):
            with pytest.raises(ValueError, match=rf"^{key}={bad}: expected "):
                check_values(parse_args([f"--{key}={bad}", "--training.val_interval=0"]))
        # the default (or the preset's, for None) passes
        check_values(parse_args(["--training.val_interval=0"]))


def test_a_cuda_device_without_a_gpu_is_a_setting_error(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trainer.main(["--training.device=cuda", "--training.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "mxmoe train: error: training.device='cuda': no CUDA GPU is available here" in err
    assert "--training.device=cpu" in err and "Traceback" not in err, err


def test_help_lists_every_field_with_doc(capsys):
    assert trainer.main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in (
        "--mx.mxfp8_dim1_cast_kernel_choice",
        "--checkpoint.interval",
        "--metrics.log_freq",
        "--parallelism.expert_parallel_degree",
        "--data.path",
        "--training.compile",
    ):
        assert key in out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_parse(path):
    cfg = load_toml(str(path))
    assert cfg.training.steps > 0


def test_debug_config_trains_with_mx_and_the_default_recipe():
    from mxmoe.nn import MXConfig

    cfg = load_toml(str(Path(__file__).parents[2] / "configs" / "debug_moe.toml"))
    assert cfg.model.converters == ["mx"]
    # the trainer's defaults are MXConfig()'s: one recipe (its "auto" kernels run torch on CPU)
    mine = MXConfig(
        recipe_name=cfg.mx.recipe_name, mxfp8_dim1_cast_kernel_choice=cfg.mx.mxfp8_dim1_cast_kernel_choice
    )
    assert mine.to_recipe() == MXConfig().to_recipe()


def test_mx_recipe_default_is_the_library_default_and_help_lists_recipes(capsys):
    from mxmoe.recipe import DEFAULT_RECIPE_NAME, RECIPES

    assert parse_args([]).mx.recipe_name == DEFAULT_RECIPE_NAME == "mxfp8_rceil"
    assert trainer.main(["--help"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "--mx.recipe_name" in x]
    assert "default 'mxfp8_rceil'" in line and all(name in line for name in RECIPES)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_use_the_default_recipe(path):
    from mxmoe.recipe import DEFAULT_RECIPE_NAME

    assert load_toml(str(path)).mx.recipe_name == DEFAULT_RECIPE_NAME


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
def test_mx_gemm_backend_reaches_every_converted_module(backend):
    from mxmoe.models import Transformer
    from mxmoe.train.parallel import make_parallel_dims
    from mxmoe.train.trainer import build_model_args, mx_convert

    cfg = parse_args(["--config", "configs/debug_moe.toml", f"--mx.gemm_backend={backend}"])
    model = Transformer(build_model_args(cfg))
    mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    backends = [m.recipe.gemm_backend for m in model.modules() if hasattr(m, "recipe")]
    assert len(backends) >= 14 and set(backends) == {backend}  # 12 linears, 2 expert groups at least


def test_mx_exchange_only_converts_the_experts_alone():
    """--mx.expert_gemm=hp --mx.convert_linears=false: no Linear is MX, every expert group holds the
    recipe with expert_gemm="hp" (bf16 GEMMs, MXFP8 exchange)."""
    from torch import nn

    from mxmoe.models import Transformer
    from mxmoe.nn import MXGroupedExperts, MXLinear
    from mxmoe.train.build import build_model_args, mx_convert, precision
    from mxmoe.train.parallel import make_parallel_dims

    args = ["--config", "configs/debug_moe.toml", "--mx.expert_gemm=hp", "--mx.convert_linears=false"]
    cfg = parse_args(args)
    model = Transformer(build_model_args(cfg))
    report = mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    experts = [m for m in model.modules() if isinstance(m, MXGroupedExperts)]
    assert len(experts) == model.args.n_layers
    assert {m.recipe.expert_gemm for m in experts} == {"hp"}
    assert not any(isinstance(m, MXLinear) for m in model.modules())
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) >= 12
    assert report.converted["Linear"] == [] and "expert_gemm=hp" in report.summary()
    assert "high-precision experts on MX-rounded rows" in precision(model, cfg)


@pytest.mark.interpreter  # a CPU model with 'triton' casts: the Triton interpreter
def test_mx_cast_kernel_choices_reach_every_converted_module():
    """--mx.mxfp8_dim0_cast_kernel_choice / dim1 set the recipe's dim0_kernel / dim1_kernel of every
    converted module (the rest of the recipe as named)."""
    import dataclasses

    from mxmoe.models import Transformer
    from mxmoe.recipe import recipe
    from mxmoe.train.parallel import make_parallel_dims
    from mxmoe.train.trainer import build_model_args, mx_convert

    cfg = parse_args(["--config", "configs/debug_moe.toml", "--mx.mxfp8_dim0_cast_kernel_choice=triton",
                      "--mx.mxfp8_dim1_cast_kernel_choice=torch"])
    model = Transformer(build_model_args(cfg))
    mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    recipes = {m.recipe for m in model.modules() if hasattr(m, "recipe")}
    base = recipe(cfg.mx.recipe_name)
    assert recipes == {dataclasses.replace(base, dim0_kernel="triton", dim1_kernel="torch")}
