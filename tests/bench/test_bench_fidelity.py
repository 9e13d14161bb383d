"""`mxmoe bench fidelity` on CPU: each variant quantizes what its name says (errors vs fp32 land in
the parameter groups it touches and nowhere else), and the CLI's table and JSON."""

import json

import pytest
import torch

from mxmoe.bench import fidelity
from mxmoe.cli import main
from mxmoe.train.config import parse_args

SMALL = ["--training.local_batch_size=2", "--training.seq_len=64"]


@pytest.fixture(scope="module")
def res():
    # attention converted too (the default filter keeps it high precision): MX GEMMs in every group
    cfg = parse_args(["--config", "debug_moe", *SMALL, "--mx.filter_fqns=output,lm_head,router"])
    return fidelity.measure(cfg, 0, 1, list(fidelity.VARIANTS), torch.device("cpu"))


def test_bf16_on_cpu_is_fp32(res):
    # no autocast on CPU: the high-precision model is fp32 itself, bit for bit
    r = res["bf16"]
    assert r["dloss_pct"] == 0.0
    assert all(r[g] == 0.0 for g in ("attention", "experts", "router", "shared_expert"))


def test_mx_errors_where_its_gemms_are(res):
    mx = res["mx"]
    for g in ("attention", "experts", "shared_expert"):  # MX GEMMs: e4m3 rounding, a few %
        assert 0.005 < mx[g] < 0.5, (g, mx[g])
    eo, lo = res["mx_experts_only"], res["mx_linears_only"]
    # only the experts MX: the linears' weight gradients barely move, and the reverse
    assert eo["attention"] < 0.05 * mx["attention"] and eo["shared_expert"] < 0.05 * mx["shared_expert"]
    assert eo["experts"] == pytest.approx(mx["experts"], rel=0.5)
    assert lo["experts"] < 0.05 * mx["experts"]
    assert lo["attention"] == pytest.approx(mx["attention"], rel=0.5)
    assert lo["shared_expert"] == pytest.approx(mx["shared_expert"], rel=0.5)


def test_attention_stays_high_precision_under_the_default_filter():
    cfg = parse_args(["--config", "debug_moe", *SMALL])
    mx = fidelity.measure(cfg, 0, 1, ["mx"], torch.device("cpu"))["mx"]
    assert 0.005 < mx["shared_expert"] < 0.5
    # attention stays high precision by default (mxmoe.options.DEFAULT_FILTER_FQNS): its weight
    # gradients only see the MX dgrads of the layers above
    assert mx["attention"] < 0.1 * mx["shared_expert"]


def test_straight_through_variants(res):
    mx = res["mx"]
    # at the initial weights (steps=0): the experts' weight gradients come from high-precision
    # operands in fwd_only, from MX ones in fwd_wgrad_only
    assert res["mx_fwd_only"]["experts"] < 0.05 * mx["experts"]
    assert res["mx_fwd_wgrad_only"]["experts"] == pytest.approx(mx["experts"], rel=0.2)
    # forward values are MX's in both: the same loss as mx
    for v in ("mx_fwd_only", "mx_fwd_wgrad_only"):
        assert res[v]["loss"] == pytest.approx(mx["loss"], abs=1e-6)


def test_wgrad_with_hp_is_the_recipe(res):
    """mx_wgrad_with_hp runs the recipe mxfp8_rceil_wgrad_with_hp: mx's forward (the same loss, bit
    for bit) and weight gradients from high-precision GEMMs, whose operands still carry the MX error
    of the forward GEMMs before them and of the dgrads above (h, dh inside an MLP): errors below
    mx's, not near zero (the straight-through mx_fwd_only, whose whole module is high precision in
    backward, is the bound)."""
    mx, wh = res["mx"], res["mx_wgrad_with_hp"]
    assert wh["loss"] == mx["loss"]
    for g in ("experts", "shared_expert"):
        assert 0.005 < wh[g] < mx[g], (g, wh[g], mx[g])


def test_cli_table_and_json(tmp_path, capsys, monkeypatch):
    """No --config: the shipped debug_moe, found by name from any folder."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "f.json"
    rc = main(["bench", "fidelity", "--steps", "0", "--batches", "1",
               "--variants", "bf16,mx", "--json", str(out), "--device", "cpu", *SMALL])
    assert rc == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].startswith("| variant | loss | vs fp32 |")
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == ["fp32", "bf16", "mx"]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"fp32", "bf16", "mx"} and data["results"]["mx"]["experts"] > 0
    # what the numbers were measured on (the file held the results alone)
    assert (data["bench"], data["steps"], data["batches"], data["device"]) == ("fidelity", 0, 1, "cpu")
    assert data["config"]["model"]["name"] == "debug_moe"
    assert {"torch", "python", "mxmoe"} <= set(data["environment"])


@pytest.mark.parametrize(
    "args, match",
    [(["--variants", "mx,fp4"], "'fp4' is not one of"), (["--steps", "-1"], "--steps=-1"),
     (["--variants", "mx_hp_wgrad"], "'mx_hp_wgrad' is now 'mx_wgrad_with_hp'"),
     (["--variants", "mx_hp_dgrad"], "'mx_hp_dgrad' is now 'mx_fwd_wgrad_only'"),
     (["stray"], "Unrecognized options: stray"),
     (["--training.batch_size=2"], "is now --training.local_batch_size"),
     (["--training.local_batch_size=0"], "training.local_batch_size=0: expected >= 1"),
     (["--device", "tpu"], "--device='tpu': expected cpu, cuda or cuda:N"),
     (["--json", "/proc/no/x.json"], "--json '/proc/no/x.json': cannot write in"),
     (["--json", "/"], "--json '/': is a folder, expected a file path"),
     (["--device", "cpu", "--mx.mxfp8_dim0_cast_kernel_choice=cuda"],
      "mx.mxfp8_dim0_cast_kernel_choice='cuda' cannot run on cpu: kernel='cuda' needs")],
)
def test_cli_errors(capsys, args, match):  # before anything is trained
    with pytest.raises(SystemExit) as e:
        main(["bench", "fidelity", "--config", "debug_moe", *args])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_relative_error_where_the_fp32_gradient_is_zero():
    """A zero reference group: exact only if the variant's gradient is zero too (it read 0.0 before)."""
    from mxmoe.bench.fidelity import rel_error

    assert rel_error(4.0, 16.0) == 0.5
    assert rel_error(0.0, 0.0) == 0.0
    assert rel_error(1e-30, 0.0) == float("inf")
