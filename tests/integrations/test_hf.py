"""mxmoe in Hugging Face transformers (mxmoe.integrations.hf): `mxmoe.convert` of tiny Qwen3-MoE,
Mixtral, DeepSeek-V3 and GPT-OSS models (built from local configs) converts the experts and keeps
attention, router and lm_head high precision; the "mxmoe" experts implementation equals the MX
oracle (quantize-dequantize products) and trains within MX rounding of the bf16 model, under
transformers' own Trainer too; save_pretrained writes the model's weights (not MX) and
from_pretrained loads them back, by name `experts_implementation="mxmoe"` too. Slow: every other MoE
family transformers ships with an experts-interface module."""

from __future__ import annotations

import copy
import json
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip(f"transformers {transformers.__version__}: mxmoe.integrations.hf needs >= 5",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from conftest import assert_same_bits  # noqa: E402
from hf_models import ALL_FAMILIES, TINY, UNCONVERTED_FAMILIES, tiny_model, tokens  # noqa: E402

import mxmoe  # noqa: E402
import mxmoe.integrations.hf as hf  # noqa: E402
from mxmoe.nn import MXLinear  # noqa: E402
from mxmoe.quant.qdq import qdq  # noqa: E402
from mxmoe.recipe import DEFAULT_RECIPE  # noqa: E402

LAYERS = 2


def experts_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if mxmoe.nn.converter.hf_experts_dims(m) is not None}


def converted(model, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an HF model converts with no warning
        return mxmoe.convert(model, mxmoe.MXOptions(**options))


@pytest.mark.parametrize("family", list(TINY))
def test_convert_knows_the_hf_names_and_experts(family, caplog):
    """Issue 57.1: the experts compute in MX (experts_implementation="mxmoe"), attention
    (`self_attn`), the router (`gate` / `router`) and lm_head stay high precision; the log line says so."""
    model = tiny_model(family)
    with caplog.at_level(logging.INFO, logger="mxmoe"):
        converted(model)
    rep = model.mx_conversion
    experts = experts_modules(model)
    moe_layers = LAYERS - (1 if family == "deepseek_v3" else 0)  # first_k_dense_replace=1
    assert len(experts) == moe_layers and rep.converted["transformers experts"] == list(experts)
    assert model.config._experts_implementation == "mxmoe"
    assert all(m.mx_recipe == DEFAULT_RECIPE for m in experts.values())
    mx_linears = [n for n, m in model.named_modules() if isinstance(m, MXLinear)]
    assert not any("self_attn" in n or "gate" == n.split(".")[-1] or "router" in n for n in mx_linears)
    assert not isinstance(model.lm_head, MXLinear)
    if family == "deepseek_v3":  # its dense MLP and shared experts: Linear layers, MX
        assert any("shared_experts" in n for n in mx_linears) and any("layers.0.mlp" in n for n in mx_linears)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "mxmoe"]
    assert f'{moe_layers} transformers experts -> experts_implementation="mxmoe"' in line, line
    assert "by filter_fqns 'attention'" in line and "lm_head (filter_fqns 'lm_head')" in line


def _oracle(mod, x, idx, w):
    """The experts' output from the MX oracle: per token and expert, quantize-dequantize products
    (blocks of 32 along each GEMM's reduction dim) in fp32, transformers' gate between them."""
    r = DEFAULT_RECIPE
    up = mod.gate_up_proj if mod.has_gate else mod.up_proj
    up_k = up if mod.is_transposed else up.transpose(-2, -1)  # (E, K=H, N)
    down_k = mod.down_proj if mod.is_transposed else mod.down_proj.transpose(-2, -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = qdq(x[t : t + 1], -1, recipe=r) @ qdq(up_k[e].t().contiguous(), -1, recipe=r).t()
            if mod.has_bias:
                h = h + (mod.gate_up_proj_bias if mod.has_gate else mod.up_proj_bias)[e]
            h = mod._apply_gate(h) if mod.has_gate else mod.act_fn(h)
            y = qdq(h, -1, recipe=r) @ qdq(down_k[e].t().contiguous(), -1, recipe=r).t()
            if mod.has_bias:
                y = y + mod.down_proj_bias[e]
            out[t] += y[0] * w[t, j]
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_forward_equals_the_mx_oracle(family):
    """fp32: the fused SwiGLU path (Qwen3-MoE) and the general one (GPT-OSS: biases, transposed
    weights, its own gate) equal the oracle up to fp32 summation order."""
    model = tiny_model(family)
    mod = next(iter(experts_modules(model).values()))
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.endswith("bias"):
                p.normal_()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 64, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    w = torch.rand(24, 2, generator=g)
    assert hf.experts._is_swiglu(mod) == (family == "qwen3_moe")
    y = hf.mxmoe_experts_forward(mod, x, idx, w)
    ref = _oracle(mod, x, idx, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_fused_swiglu_equals_the_general_path(monkeypatch):
    """Forward and every gradient of the fused SwiGLU op equal the general path (two mx_grouped_mm
    around transformers' gate) up to fp32 summation order."""
    mod = next(iter(experts_modules(tiny_model("qwen3_moe")).values()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=g)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(hf.experts, "_is_swiglu", lambda self, f=fused: f)
        xi = x.clone().requires_grad_()
        mod.zero_grad()
        y = hf.mxmoe_experts_forward(mod, xi, idx, w)
        y.backward(torch.cos(y.detach()))
        runs.append((y.detach(), xi.grad, mod.gate_up_proj.grad.clone(), mod.down_proj.grad.clone()))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", list(TINY))
def test_forward_and_backward_within_mx_rounding_of_bf16(family):
    """The converted bf16 model against the same model in bf16: loss within 0.1 %, logits within
    2^-4 (one e4m3 rounding step) in relative norm, the whole gradient within 2^-3, each experts
    weight's gradient pointing the same way (cosine > 0.9)."""
    ref = tiny_model(family, dtype=torch.bfloat16)
    mx = converted(copy.deepcopy(ref))
    ids = tokens()
    out_ref, out_mx = ref(input_ids=ids, labels=ids), mx(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out_mx.loss.backward()
    assert torch.isfinite(out_mx.loss) and out_mx.loss.item() != out_ref.loss.item()  # MX did something
    assert abs(out_mx.loss.item() - out_ref.loss.item()) < 1e-3 * out_ref.loss.item()
    lr, lm = out_ref.logits.float(), out_mx.logits.float()
    assert (lm - lr).norm() < 2**-4 * lr.norm()
    pairs = zip(ref.parameters(), mx.parameters(), strict=True)
    grads = [(p.grad.float().flatten(), q.grad.float().flatten()) for p, q in pairs if p.grad is not None]
    gr, gm = torch.cat([a for a, _ in grads]), torch.cat([b for _, b in grads])
    assert (gm - gr).norm() < 2**-3 * gr.norm()
    for name, p in mx.named_parameters():
        if ".experts." in name and p.ndim == 3:
            q = dict(ref.named_parameters())[name]
            cos = torch.nn.functional.cosine_similarity(p.grad.float().flatten(), q.grad.float().flatten(), 0)
            assert cos > 0.9, (name, cos)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_equals_none_bit_for_bit(reentrant):
    """`gradient_checkpointing_enable()` (torch.utils.checkpoint, either kind) on a converted model:
    the loss and every gradient of the run without it, bit for bit."""
    ref = converted(tiny_model("qwen3_moe", dtype=torch.bfloat16))
    ref.train()
    ckpt = copy.deepcopy(ref)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = tokens()
    losses = []
    for m in (ref, ckpt):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss)
    assert_same_bits(losses[1], losses[0], "loss")
    for (name, p), q in zip(ref.named_parameters(), ckpt.parameters(), strict=True):
        if p.grad is not None:
            assert_same_bits(q.grad, p.grad, name)


def test_save_pretrained_writes_the_models_weights_and_loads_back(tmp_path):
    """save_pretrained of a converted model writes the model's own weights and config (nothing MX:
    the plain class loads them bit for bit without mxmoe); from_pretrained(...,
    experts_implementation="mxmoe") runs the experts in MX, as mxmoe.convert does."""
    for family in ("qwen3_moe", "deepseek_v3"):
        model = converted(tiny_model(family))
        folder = tmp_path / family
        model.save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        assert "mxmoe" not in json.dumps(config)
        plain = type(model).from_pretrained(folder)
        assert plain.config._experts_implementation != "mxmoe"
        assert not any(isinstance(m, MXLinear) for m in plain.modules())
        saved, loaded = model.state_dict(), plain.state_dict()
        assert saved.keys() == loaded.keys()
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)
        ids = tokens(2, 16)
        with torch.no_grad():
            want = model(input_ids=ids).logits
            again = converted(type(model).from_pretrained(folder))(input_ids=ids).logits
            assert torch.equal(want, again)
            by_name = type(model).from_pretrained(folder, experts_implementation="mxmoe")
            assert by_name.config._experts_implementation == "mxmoe"
            only_experts = converted(type(model).from_pretrained(folder), convert_linears=False)
            assert torch.equal(by_name(input_ids=ids).logits, only_experts(input_ids=ids).logits)
            assert not torch.equal(by_name(input_ids=ids).logits, plain(input_ids=ids).logits)


@pytest.mark.slow
def test_trainer_trains_the_converted_model_near_bf16(tmp_path):
    """transformers' own Trainer, 4 steps on CPU: the converted model's losses follow the bf16
    model's within 1 % and its weights move (the saved checkpoint is the model's, not MX)."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __init__(self):
            self.ids = tokens(16, 32, seed=3)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    losses = {}
    for name in ("bf16", "mx"):
        model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
        if name == "mx":
            converted(model)
        before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
        args = TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        assert not torch.equal(before, model.model.layers[0].mlp.experts.gate_up_proj)
        if name == "mx":
            trainer.save_model(str(tmp_path / "saved"))
            plain = type(model).from_pretrained(tmp_path / "saved")
            assert torch.equal(plain.model.layers[0].mlp.experts.gate_up_proj,
                               model.model.layers[0].mlp.experts.gate_up_proj)
    assert len(losses["mx"]) == len(losses["bf16"]) == 4
    assert losses["mx"] != losses["bf16"]
    for a, b in zip(losses["mx"], losses["bf16"], strict=True):
        assert abs(a - b) < 0.01 * b, losses


def test_experts_left_out_stay_high_precision():
    """Experts skipped by the filter keep their implementation though they share the config with
    the MX ones: layer 0's experts give what transformers' own grouped_mm gives."""
    model = tiny_model("qwen3_moe")
    ref = copy.deepcopy(model)
    converted(model, filter_fqns=["layers.0.mlp.experts", "self_attn", "lm_head"])
    e0, e1 = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    assert e0.mx_recipe is None and e1.mx_recipe == DEFAULT_RECIPE
    assert ("model.layers.0.mlp.experts", "filter_fqns 'layers.0.mlp.experts'") in model.mx_conversion.skipped
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=g)
    with torch.no_grad():
        assert torch.equal(e0(x, idx, w), ref.model.layers[0].mlp.experts(x, idx, w))
        assert not torch.equal(e1(x, idx, w), ref.model.layers[1].mlp.experts(x, idx, w))


def test_experts_of_dims_not_divisible_by_32_warn_and_are_refused_by_name():
    """moe_intermediate_size=48: mxmoe.convert leaves the experts high precision and warns naming
    why (the attention-free rest converts nothing either: an error unless allow_unconverted);
    experts_implementation="mxmoe" on them is an error naming the dims."""
    model = tiny_model("qwen3_moe", moe_intermediate_size=48)
    why = r"2 experts modules .* none is MX: 2 by dims 64x48 not divisible by 32"
    with pytest.warns(UserWarning, match=why):
        with pytest.raises(ValueError, match="no module was converted"):
            mxmoe.convert(model, mxmoe.MXOptions())
    model.set_experts_implementation("mxmoe")
    with pytest.raises(ValueError, match=r"Qwen3MoeExperts has gate_up/down dims \(64, 96\) / \(48, 64\)"):
        model(input_ids=tokens(1, 8))


def test_expert_parallel_ids_of_other_ranks_weigh_nothing():
    """transformers' expert parallelism hands each rank ids >= E for experts it does not hold: their
    rows contribute nothing (as transformers' grouped_mm's sentinel rows)."""
    mod = next(iter(experts_modules(tiny_model("mixtral")).values()))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=g)
    mod._is_expert_parallel = True
    sentinel = idx.clone()
    sentinel[:, 1] = 4  # the second choice of every token lives on another rank
    y = hf.mxmoe_experts_forward(mod, x, sentinel, w)
    first_only = hf.mxmoe_experts_forward(mod, x, idx[:, :1], w[:, :1])
    torch.testing.assert_close(y, first_only, rtol=1e-6, atol=1e-6)


def _mx_inside_attention_or_router(model) -> list[str]:
    """FQNs of MX Linear layers inside a module of a class named *Attention, *Router, *GatedDeltaNet
    or named like attention or a router."""
    inside = []
    for name, mod in model.named_modules():
        by_kind = type(mod).__name__.endswith(("Attention", "Router", "GatedDeltaNet"))
        if by_kind or name.rsplit(".", 1)[-1] in ("self_attn", "linear_attn", "gate"):
            inside += [f"{name}.{n}" for n, m in mod.named_modules() if isinstance(m, MXLinear)]
    return inside


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_other_family_converts_and_trains_near_bf16(family):
    """Every other MoE family transformers ships with an experts-interface module (tiny generic
    configs): its experts become MX, no Linear inside attention (of any kind) or a router does, its
    experts' output equals the MX oracle's (fp32), it generates, and loss and gradients stay within
    MX rounding of bf16: the gradient within 2^-3 of bf16's, or, for a tiny model whose gradient
    rounding alone moves further (Gemma 4's: bf16's is 73 % from fp32's; MX's e4m3 has 3 mantissa
    bits to bf16's 7), within twice bf16's distance from fp32's."""
    ref = tiny_model(family, dtype=torch.bfloat16)
    mx = mxmoe.convert(copy.deepcopy(ref), mxmoe.MXOptions())
    assert mx.mx_conversion.converted["transformers experts"], mx.mx_conversion.summary()
    assert len(mx.mx_conversion.converted["transformers experts"]) == len(experts_modules(mx))
    assert not _mx_inside_attention_or_router(mx)
    fp32 = tiny_model(family)
    mod = copy.deepcopy(next(iter(experts_modules(fp32).values())))
    with torch.no_grad():
        for name, p in mod.named_parameters():
            if name.endswith("bias"):
                p.normal_()
        x, idx, w = _random_routing(mod)
        y = hf.mxmoe_experts_forward(mod, x, idx, w)
        torch.testing.assert_close(y, _oracle(mod, x, idx, w), rtol=1e-5, atol=1e-6)
    ids = tokens()
    lr, lm = ref(input_ids=ids, labels=ids).loss, mx(input_ids=ids, labels=ids).loss
    lr.backward()
    lm.backward()
    assert abs(lm.item() - lr.item()) < 1e-3 * lr.item()
    gr, gm = _all_grads(ref), _all_grads(mx)
    if (gm - gr).norm() >= 2**-3 * gr.norm():
        fp32(input_ids=ids, labels=ids).loss.backward()
        assert (gm - gr).norm() < 2 * (_all_grads(fp32) - gr).norm()
    with torch.no_grad():  # decoding: one token a step through the MX experts
        out = mx.eval().generate(ids[:1, :8], max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 1 and 8 < out.shape[1] <= 11  # 11, or fewer at an end-of-text token


def _random_routing(mod, num_tokens: int = 24, seed: int = 0):
    """Random rows (T, H) for the experts module `mod`, top-2 expert ids (T, 2) and weights (T, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, mxmoe.nn.converter.hf_experts_dims(mod)[0], generator=g)
    idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:2] for _ in range(num_tokens)])
    return x, idx, torch.rand(num_tokens, 2, generator=g)


def _all_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"])),  # `linear_attn`
        ("zaya", dict(num_experts_per_tok=1)),  # its router `gate` is an MLP (down_proj, router_mlp)
    ],
)
def test_linear_attention_and_a_router_mlp_stay_high_precision(family, overrides):
    """Attention whatever its kind (Qwen3-Next's linear attention, `linear_attn`) and every Linear
    of a router that is an MLP of its own (ZAYA's `gate`) stay high precision, as the docs say; the
    experts and the shared-expert MLP are MX."""
    model = converted(tiny_model(family, **overrides))
    mx_linears = [n for n, m in model.named_modules() if isinstance(m, MXLinear)]
    assert not any({"linear_attn", "self_attn", "gate"} & set(n.split(".")) for n in mx_linears), mx_linears
    assert len(model.mx_conversion.converted["transformers experts"]) == LAYERS
    skipped = dict(model.mx_conversion.skipped)
    if family == "qwen3_next":
        assert any("shared_expert." in n for n in mx_linears)
        assert skipped["model.layers.0.linear_attn.in_proj_qkvz"] == "filter_fqns 'attention'"
    else:
        assert skipped["model.layers.0.mlp.gate.down_proj"] == "filter_fqns 'router'"


def test_experts_outside_the_interface_are_named():
    """JetMoE's experts (`input_linear` / `output_linear`, 3D weights outside transformers' experts
    interface, no "expert" in their names) are found by their class and named: a warning that no
    experts module is MX and why, and the error that nothing converted."""
    model = tiny_model("jetmoe")
    why = r"8 experts modules .* none is MX: 8 by JetMoeParallelExperts: experts of a kind mxmoe does not"
    with pytest.warns(UserWarning, match=why):
        with pytest.raises(ValueError, match="no module was converted"):
            mxmoe.convert(model, mxmoe.MXOptions())
    assert "model.layers.0.mlp.input_linear" in model.mx_conversion.experts


def test_float16_and_expert_gemm_bf16_are_refused_before_anything_changes():
    """A float16 model: mxmoe.convert names the experts module, its dtype and the fix, and so does
    experts_implementation="mxmoe" at the forward (both GEMMs' casts take bf16 / fp32).
    expert_gemm="bf16" (the exchange-only mode) on transformers experts, which have no MXFP8
    exchange, is an error (they ran MX GEMMs while the log said bf16), and the model is unchanged."""
    model = tiny_model("qwen3_moe", dtype=torch.float16)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts \(Qwen3MoeExperts\) has torch.float16"):
        mxmoe.convert(model, mxmoe.MXOptions())
    model.set_experts_implementation("mxmoe")
    with pytest.raises(TypeError, match=r"Qwen3MoeExperts has torch.float16 weights; MX experts take"):
        model(input_ids=tokens(1, 8))
    model = tiny_model("deepseek_v3", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expert_gemm='bf16' .* does not apply to transformers experts"):
        mxmoe.convert(model, mxmoe.MXOptions(expert_gemm="bf16"))
    assert not any(isinstance(m, MXLinear) for m in model.modules())
    assert model.config._experts_implementation != "mxmoe"


def test_converting_again_after_set_experts_implementation_makes_the_experts_mx_again():
    """set_experts_implementation("grouped_mm") after a conversion puts the experts back in high
    precision; converting again makes them MX again (it reported them "already MX" and left them)."""
    model = converted(tiny_model("qwen3_moe"))
    model.set_experts_implementation("grouped_mm")
    converted(model)
    assert model.config._experts_implementation == "mxmoe"
    assert model.mx_conversion.converted["transformers experts"] == list(experts_modules(model))
    converted(model)
    assert len(model.mx_conversion.already) == LAYERS


def test_reconverting_refuses_expert_gemm_bf16_and_a_block_the_experts_cannot_take():
    """Converting a converted model again with expert_gemm="bf16" or a block size its experts' dims
    cannot take is refused as a first conversion is, before anything changes (both were re-given:
    the experts ran MX GEMMs under a recipe saying bf16, or failed at their forward)."""
    model = converted(tiny_model("mixtral"))
    with pytest.raises(ValueError, match=r"expert_gemm='bf16' .* does not apply to transformers experts"):
        mxmoe.convert(model, mxmoe.MXOptions(expert_gemm="bf16"))
    why = r"model.layers.0.mlp.experts \(MixtralExperts, dims 64x32\) is MX already and cannot take this"
    why += r" recipe: its dims are not divisible by block_size=64 \(2 of"
    with pytest.raises(ValueError, match=why):
        mxmoe.convert(model, mxmoe.recipe(block_size=64))
    assert {m.mx_recipe for m in experts_modules(model).values()} == {DEFAULT_RECIPE}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(UNCONVERTED_FAMILIES))
def test_experts_outside_the_interface_stay_high_precision_and_are_named(family):
    """LongCat-Flash and JetMoE keep their experts outside transformers' experts interface:
    mxmoe.convert leaves them high precision and a warning names their class; what it converts
    (their MLPs) trains as the other families do."""
    ref = tiny_model(family, dtype=torch.bfloat16)
    why = f"none is MX: .*{UNCONVERTED_FAMILIES[family]}: experts of a kind mxmoe does not convert"
    with pytest.warns(UserWarning, match=why):
        mx = mxmoe.convert(copy.deepcopy(ref), mxmoe.MXOptions(allow_unconverted=True))
    assert not _mx_inside_attention_or_router(mx)
    ids = tokens()
    lr, lm = ref(input_ids=ids, labels=ids).loss, mx(input_ids=ids, labels=ids).loss
    assert abs(lm.item() - lr.item()) < 1e-3 * lr.item()


@pytest.mark.parametrize("family, fused", [("qwen3_moe", True), ("lfm2_moe", True), ("gemma4_text", False)])
def test_swiglu_experts_take_the_fused_op_whatever_their_silu(family, fused):
    """SwiGLU experts run as one fused op whether their SiLU is a module (Qwen3-MoE) or `F.silu`
    itself (LFM2-MoE); Gemma 4's GeGLU takes the general path. Both equal the MX oracle (fp32)."""
    mod = next(iter(experts_modules(tiny_model(family)).values()))
    assert hf.experts._is_swiglu(mod) == fused
    x, idx, w = _random_routing(mod)
    with torch.no_grad():
        y = hf.mxmoe_experts_forward(mod, x, idx, w)
        torch.testing.assert_close(y, _oracle(mod, x, idx, w), rtol=1e-5, atol=1e-6)


# Llama 4: experts outside transformers' experts interface (every expert runs every token, scaled by
# its router score), made MX by a class of mxmoe's own (mxmoe.integrations.hf.llama4)


def _llama4_oracle(mod, x):
    """Llama4TextExperts' output on rows x (E * T, H) from the MX oracle (fp32): per expert,
    quantize-dequantize products (blocks of 32 along each GEMM's reduction dim), act(gate) * up."""
    r, E = DEFAULT_RECIPE, mod.num_experts
    out = []
    for e, xe in enumerate(x.view(E, -1, x.shape[-1])):
        gu = qdq(xe, -1, recipe=r) @ qdq(mod.gate_up_proj[e].t().contiguous(), -1, recipe=r).t()
        gate, up = gu.chunk(2, dim=-1)
        h = up * mod.act_fn(gate)
        out.append(qdq(h, -1, recipe=r) @ qdq(mod.down_proj[e].t().contiguous(), -1, recipe=r).t())
    return torch.cat(out)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_llama4_experts_are_mx_and_equal_the_oracle(act):
    """mxmoe.convert makes Llama 4's experts MX (class MXLlama4TextExperts, the same parameters)
    with no warning, keeps attention and the router high precision; the experts equal the MX oracle
    in fp32: SiLU through the fused SwiGLU op, another activation through two grouped GEMMs."""
    from mxmoe.integrations.hf.llama4 import MXLlama4TextExperts

    ref = tiny_model("llama4_text", hidden_act=act)
    model = converted(copy.deepcopy(ref))
    rep = model.mx_conversion
    experts = {n: m for n, m in model.named_modules() if isinstance(m, MXLlama4TextExperts)}
    assert list(experts) == rep.converted["Llama 4 experts"] == ["model.layers.0.feed_forward.experts"]
    assert "1 Llama 4 experts -> MXLlama4TextExperts" in rep.summary()
    assert not _mx_inside_attention_or_router(model)
    assert model.state_dict().keys() == ref.state_dict().keys()
    mod = experts["model.layers.0.feed_forward.experts"]
    assert mod.mx_recipe == DEFAULT_RECIPE and mod.gate_up_proj is dict(model.named_parameters())[
        "model.layers.0.feed_forward.experts.gate_up_proj"]
    x = torch.randn(mod.num_experts * 12, mod.hidden_size, generator=torch.Generator().manual_seed(0))
    x[::3] = 0  # rows of tokens an expert was not chosen for: score 0
    with torch.no_grad():
        torch.testing.assert_close(mod(x), _llama4_oracle(mod, x), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not a multiple of the 4 experts"):
        mod(x[:-1])


def test_llama4_trains_near_bf16_generates_and_saves():
    """Converted Llama 4 (bf16): loss within MX rounding of the bf16 model's, finite gradients that
    reach the experts, generate, and save_pretrained writing the model's own weights, which load
    back into a plain model."""
    ref = tiny_model("llama4_text", dtype=torch.bfloat16)
    model = converted(copy.deepcopy(ref))
    ids = tokens()
    lr, lm = ref(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    assert abs(lm.item() - lr.item()) < 1e-2 * lr.item()
    lm.backward()
    g = model.model.layers[0].feed_forward.experts.gate_up_proj.grad
    assert g is not None and g.isfinite().all() and g.abs().sum() > 0
    assert model.generate(ids[:1, :4], max_new_tokens=3).shape == (1, 7)


def test_llama4_saves_reconverts_and_refuses_expert_gemm_bf16(tmp_path):
    """save_pretrained writes the weights (a plain model loads them); converting again with another
    recipe re-gives it (a warning says so); expert_gemm="bf16" is refused before anything changes."""
    from mxmoe.integrations.hf.llama4 import MXLlama4TextExperts

    model = converted(tiny_model("llama4_text"))
    model.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back.model.layers[0].feed_forward.experts).__name__ == "Llama4TextExperts"
    assert_same_bits(back.model.layers[0].feed_forward.experts.down_proj,
                     model.model.layers[0].feed_forward.experts.down_proj, "down_proj")
    with pytest.warns(UserWarning, match="already MX with another recipe"):
        mxmoe.convert(model, mxmoe.MXOptions(recipe_name="mxfp8"))
    assert model.model.layers[0].feed_forward.experts.mx_recipe == mxmoe.recipe("mxfp8")
    plain = tiny_model("llama4_text")
    why = r"expert_gemm='bf16' .* does not apply to transformers experts \(Llama4TextExperts\)"
    with pytest.raises(ValueError, match=why):
        mxmoe.convert(plain, mxmoe.MXOptions(expert_gemm="bf16"))
    assert not any(isinstance(m, (MXLinear, MXLlama4TextExperts)) for m in plain.modules())
