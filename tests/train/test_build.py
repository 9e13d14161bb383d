"""`mxmoe.train.build`: what `build_run` makes for one CPU process, checked against a model, optimizer
and schedule built by hand from the same settings."""

import pytest
import torch

import mxmoe
from mxmoe.models import Transformer, model_args
from mxmoe.options import MXOptions
from mxmoe.train.build import build_model, build_run, check_values, set_matmul_precision
from mxmoe.train.config import parse_args
from mxmoe.train.data import VOCAB_SIZE
from mxmoe.train.parallel import make_parallel_dims

ARGS = [
    "--config",
    "debug_moe",
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.num_experts=4",
    "--model.moe_hidden_dim=32",
    "--training.seq_len=32",
    "--training.local_batch_size=2",
    "--debug.seed=7",
    "--lr_scheduler.warmup_steps=4",
    "--data.max_files=2",
    "--checkpoint.folder=",
    "--mx.mxfp8_dim1_cast_kernel_choice=torch",
]


def test_build_run_matches_a_model_built_by_hand(tmp_path):
    cfg = parse_args([*ARGS, f"--job.dump_folder={tmp_path}"])
    check_values(cfg)
    run = build_run(cfg, 0, 1, torch.device("cpu"))

    torch.manual_seed(7)  # the reference: the preset with the overrides, seeded, converted as [mx] says
    ref = Transformer(
        model_args(
            "debug_moe", vocab_size=VOCAB_SIZE, max_seq_len=32, dim=32, n_layers=1, num_experts=4,
            moe_hidden_dim=32,
        )
    )
    mxmoe.convert(ref, MXOptions(recipe_name=cfg.mx.recipe_name, mxfp8_dim1_cast_kernel_choice="torch",
                                filter_fqns=list(cfg.mx.filter_fqns)))
    got, want = run.model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert [type(m) for m in run.model.modules()] == [type(m) for m in ref.modules()]

    # AdamW over every parameter once: weight decay on matrices, none on norms and vectors
    groups = run.optimizer.param_groups
    assert sum(len(g["params"]) for g in groups) == len(list(ref.parameters()))
    assert all(p.ndim >= 2 for p in groups[0]["params"])
    assert groups[0]["weight_decay"] == cfg.optimizer.weight_decay
    assert groups[1]["weight_decay"] == 0.0
    assert run.scheduler.get_last_lr()[0] == pytest.approx(cfg.optimizer.lr / 4)  # warmup step 1 of 4
    assert (run.step, run.world, run.exp_params, run.ckpt, run.val_ds is not None) == (0, 1, [], None, True)
    assert run.tokens_per_step == 2 * 32
    assert len(run.dense_params) == len(groups[0]["params"]) + len(groups[1]["params"])


def test_build_model_rejects_an_unknown_compile_mode():
    cfg = parse_args(ARGS)
    with pytest.raises(ValueError, match=r"compile='fast': expected None or one of \['blocks'"):
        build_model(cfg, torch.device("cpu"), make_parallel_dims(1, -1, 1, 1), mx=False, compile="fast")


@pytest.mark.parametrize("mp, want", [("tf32", "tf32"), ("fp32", "none"), ("bf16", "none")])
def test_mixed_precision_sets_cuda_fp32_matmul_precision(mp, want):
    """tf32: fp32 matmuls on CUDA run on TF32 tensor cores; every other setting restores torch's
    default, so runs built one after another in one process do not inherit it. CPU is untouched."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32" if want == "none" else "ieee"  # the opposite of what is wanted
        cfg = parse_args([*ARGS, f"--training.mixed_precision={mp}"])
        check_values(cfg)
        set_matmul_precision(cfg, torch.device("cpu"))
        assert matmul.fp32_precision == ("tf32" if want == "none" else "ieee")
        set_matmul_precision(cfg, torch.device("cuda"))
        assert matmul.fp32_precision == want
    finally:
        matmul.fp32_precision = before


@pytest.mark.parametrize("name", ["mx", "mxmoe"])
def test_the_converter_has_both_names(name, tmp_path):
    """`--model.converters mx` or `mxmoe`: the same converter, as in torchtitan's front ends; others
    are refused naming both."""
    from mxmoe.train.build import uses_mx

    cfg = parse_args([*ARGS, f"--job.dump_folder={tmp_path}", f"--model.converters={name}"])
    check_values(cfg)
    assert uses_mx(cfg)
    model = build_model(cfg, torch.device("cpu"), make_parallel_dims(1, -1, 1, 1), mx=uses_mx(cfg))
    assert model.mx_conversion.is_mx
    cfg.model.converters = ["float8"]
    with pytest.raises(ValueError, match=r"converter\(s\) \['float8'\]; expected one of \['mx', 'mxmoe'\]"):
        check_values(cfg)


def test_mx_options_without_the_mx_converter_are_an_error_unless_allowed(tmp_path):
    """Issue 59 case 2: `--mx.*` options that ask for MX with `--model.converters=` (moe_1b and
    moe_2b ship converters = []) stop before anything is built, naming the options and the fix;
    --mx.allow_unconverted=true trains high precision."""
    base = [*ARGS, f"--job.dump_folder={tmp_path}", "--model.converters="]
    cfg = parse_args([*base, "--mx.recipe_name=mxfp8", "--mx.convert_linears=false"])
    why = (r"mx.recipe_name='mxfp8', mx.convert_linears=False given, but model.converters=\[\] names no "
           r"MX converter.*--model.converters=mx.*allow_unconverted")
    with pytest.raises(ValueError, match=why):
        check_values(cfg)
    check_values(parse_args([*base, "--mx.recipe_name=mxfp8", "--mx.allow_unconverted=true"]))
    check_values(parse_args(base))  # kernel choices alone (ARGS) ask for nothing


def test_a_conversion_that_converts_nothing_is_an_error_unless_allowed(tmp_path):
    """Issue 59 case 2: the mx converter converting nothing (experts of hidden dim 33, a filter
    matching every module) is an error naming why; --mx.allow_unconverted=true builds the model."""
    pd = make_parallel_dims(1, -1, 1, 1)
    for extra, why in (
        (["--model.moe_hidden_dim=33", "--mx.convert_linears=false"], "dims 32x33 not divisible by 32"),
        (["--mx.filter_fqns=layers,output"], "by filter_fqns 'layers'"),
    ):
        cfg = parse_args([*ARGS, f"--job.dump_folder={tmp_path}", "--model.converters=mx", *extra])
        check_values(cfg)
        with pytest.raises(ValueError, match=f"no module was converted.*{why}.*allow_unconverted"):
            build_model(cfg, torch.device("cpu"), pd, mx=True)
        cfg.mx.allow_unconverted = True
        assert not build_model(cfg, torch.device("cpu"), pd, mx=True).mx_conversion.is_mx
