"""model.* options the configured model ignores were dropped without a word: experts options on a
dense model (`--model.num_experts 0 --model.top_k 4`), `aux_loss_coef` under `load_balance=bias`,
`bias_update_rate` under `aux_loss`. They are refused before anything is built, naming the option,
its value and why; the combinations that apply still pass."""

import pytest

from mxmoe.train.build import check_values
from mxmoe.train.config import parse_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model.num_experts=0", "--model.top_k=4"],
            "model.top_k=4 configures routed experts, but model.num_experts=0 is dense",
        ),
        (
            ["--model.name=debug_dense", "--model.moe_hidden_dim=64"],
            "model.moe_hidden_dim=64 configures routed experts, but model 'debug_dense' (num_experts 0) is "
            "dense",
        ),
        (
            ["--model.load_balance=bias", "--model.aux_loss_coef=0.5"],
            "model.aux_loss_coef=0.5 applies with model.load_balance='aux_loss' only; this model balances "
            "with load_balance='bias'",
        ),
        (
            ["--model.bias_update_rate=0.01"],  # debug_moe balances with aux_loss
            "model.bias_update_rate=0.01 applies with model.load_balance='bias' only",
        ),
        (
            ["--model.load_balance=none", "--model.bias_update_rate=0.01"],
            "this model balances with load_balance='none' and would ignore it",
        ),
    ],
)
def test_an_ignored_model_option_is_refused(argv, message):
    with pytest.raises(ValueError) as e:
        check_values(parse_args(argv))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model.load_balance=bias", "--model.bias_update_rate=0.01", "--model.top_k=1"],
        ["--model.aux_loss_coef=0.02", "--model.num_experts=4"],
        ["--model.name=debug_dense"],
        ["--model.num_experts=0"],
    ],
)
def test_options_the_model_uses_pass(argv):
    check_values(parse_args(argv))  # raises on a refusal
    assert parse_args(argv).model.name in ("debug_moe", "debug_dense")


def test_the_trainer_refuses_before_building(tmp_path, capsys):
    from mxmoe.train import trainer

    argv = ["--model.num_experts=0", "--model.top_k=2", f"--job.dump_folder={tmp_path}/run"]
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err
    assert "mxmoe train: error: model.top_k=2 configures routed experts" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model.top_k=100"],
            "model.top_k=100: expected 1 <= top_k <= model.num_experts=8 (preset debug_moe's)",
        ),
        (
            ["--model.num_experts=1"],
            "model.top_k=2 (preset debug_moe's): expected 1 <= top_k <= model.num_experts=1",
        ),
        (
            ["--model.n_heads=7"],
            "model.dim=64 (preset debug_moe's) and model.n_heads=7: expected a dim divisible",
        ),
        (["--model.dim=48", "--model.n_heads=16"], "model.dim=48 and model.n_heads=16: expected"),
    ],
)
def test_model_shape_errors_name_the_options(argv, message):
    # they named ModelArgs' fields ("ModelArgs.top_k=100: expected 1..num_experts=8"), not the options
    with pytest.raises(ValueError) as e:
        check_values(parse_args(argv))
    assert message in str(e.value) and "ModelArgs" not in str(e.value)
