"""Config parsing: TOML + --section.key=value overrides, and their errors."""

from pathlib import Path

import pytest

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
        ("--training.max_norm=nan", "training.max_norm=nan: expected a number >= 0"),
        ("--training.beta2=1", "training.beta2=1.0: expected 0 <= value < 1"),
        ("--training.weight_decay=inf", "training.weight_decay=inf: expected a finite number >= 0"),
        ("--mx.gemm_backend=fp4", "mx.gemm_backend='fp4' is not a GEMM backend; expected one of"),
        ("--mx.recipe_name=nvfp4", "mx.recipe_name='nvfp4' is not an MX recipe; expected one of"),
        ("--mx.mxfp8_dim1_cast_kernel_choice=cudnn", "mx.mxfp8_dim1_cast_kernel_choice='cudnn' is not"),
    ],
)
def test_main_rejects_out_of_range_values(capsys, arg, match):
    # checked before any model or data is built: an error naming the key, not a ZeroDivisionError
    assert trainer.main([arg, "--training.device=cpu"]) == 2
    assert match in capsys.readouterr().err


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


def test_mx_gemm_backend_reaches_every_converted_module():
    from mxmoe.models import Transformer
    from mxmoe.train.parallel import make_parallel_dims
    from mxmoe.train.trainer import build_model_args, mx_convert

    cfg = parse_args(["--config", "configs/debug_moe.toml", "--mx.gemm_backend=fp8"])
    model = Transformer(build_model_args(cfg))
    mx_convert(model, cfg, make_parallel_dims(1, -1, 1, 1))
    backends = [m.recipe.gemm_backend for m in model.modules() if hasattr(m, "recipe")]
    assert len(backends) >= 14 and set(backends) == {"fp8"}  # 12 linears, 2 expert groups at least


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
