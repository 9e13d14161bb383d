"""torchao's entry point (mxmoe.integrations.torchao): `torchao.quantize_(model, MXMoETrainingConfig,
filter_fn=mx_filter_fn(config))` through torchao's handler registration makes the modules MX that
`mxmoe.convert` makes MX, with the same recipe: on mxmoe's own model and on a Hugging Face one."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao", reason="torchao is not installed")
from torchao import quantize_  # noqa: E402
from torchao.prototype.moe_training.config import MXFP8TrainingRecipe  # noqa: E402

import mxmoe  # noqa: E402
from mxmoe.integrations.torchao import MXMoETrainingConfig, mx_filter_fn  # noqa: E402
from mxmoe.models import Transformer, model_args  # noqa: E402
from mxmoe.nn import GroupedExperts, MXGroupedExperts, MXLinear  # noqa: E402
from mxmoe.recipe import RECIPES  # noqa: E402


def mx_modules(model) -> dict[str, object]:
    return {n: m.recipe for n, m in model.named_modules() if isinstance(m, (MXLinear, MXGroupedExperts))}


def tiny_moe():
    torch.manual_seed(0)
    args = model_args("debug_moe", dim=64, n_layers=2, n_heads=2, num_experts=4, moe_hidden_dim=32)
    return Transformer(args)


@pytest.mark.parametrize("recipe", list(MXFP8TrainingRecipe))
def test_quantize_with_torchaos_recipe_names_equals_mxmoe_convert(recipe):
    """Each of torchao's MXFP8 training recipes (enum or name) converts what mxmoe.convert
    converts, with mxmoe's recipe of that name; the forward is bit for bit mxmoe.convert's."""
    config = MXMoETrainingConfig.from_recipe(recipe)
    assert config == MXMoETrainingConfig.from_recipe(recipe.value)
    model = tiny_moe()
    ref = mxmoe.convert(copy.deepcopy(model), config.options)
    quantize_(model, config, filter_fn=mx_filter_fn(config))
    assert mx_modules(model) == mx_modules(ref) and mx_modules(model)
    assert set(mx_modules(model).values()) == {RECIPES[recipe.value]}
    assert any(isinstance(m, MXGroupedExperts) for m in model.modules())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], ref(ids)[0])


@pytest.mark.parametrize("family", ["deepseek_v3", "llama4_text"])
def test_quantize_a_hugging_face_model_as_mxmoe_convert(family):
    """A Hugging Face model: the experts get experts_implementation="mxmoe" (Llama 4's, outside
    transformers' experts interface: MXLlama4TextExperts), attention, router and lm_head stay high
    precision, as with mxmoe.convert; the logits are bit for bit the same."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import tiny_model, tokens

    model = tiny_model(family)
    ref = mxmoe.convert(copy.deepcopy(model), mxmoe.MXOptions())
    config = MXMoETrainingConfig.from_recipe("mxfp8_rceil")
    quantize_(model, config, filter_fn=mx_filter_fn(config))
    if family == "llama4_text":
        experts = model.model.layers[0].feed_forward.experts
        assert type(experts).__name__ == "MXLlama4TextExperts"
    else:
        assert model.config._experts_implementation == "mxmoe"
        experts = model.model.layers[1].mlp.experts
    assert experts.mx_recipe == RECIPES["mxfp8_rceil"]
    assert mx_modules(model) == mx_modules(ref)
    assert not any("self_attn" in n or n == "lm_head" for n in mx_modules(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens(2, 16)).logits, ref(input_ids=tokens(2, 16)).logits)


def test_a_parent_module_selected_converts_its_children_and_bad_input_is_named():
    """filter_fn selecting a block converts inside it by the options; an unknown recipe name and a
    module that cannot be MX (dims not divisible by 32) are errors naming them."""
    model = tiny_moe()
    config = MXMoETrainingConfig()
    quantize_(model, config, filter_fn=lambda m, fqn: fqn == "layers.1")
    assert {n.split(".")[1] for n in mx_modules(model)} == {"1"}
    with pytest.raises(ValueError, match=r"recipe_name='mxfp9'"):
        MXMoETrainingConfig.from_recipe("mxfp9")
    odd = torch.nn.Sequential(torch.nn.Linear(64, 40), GroupedExperts(64, 33, 4))
    with pytest.raises(ValueError, match=r"a Linear with dims 64x40 cannot be MX"):
        quantize_(odd, config, filter_fn=lambda m, fqn: fqn == "0")
    quantize_(odd, config, filter_fn=mx_filter_fn(config))  # leaves both out
    assert not mx_modules(odd)


def test_an_mx_module_re_given_a_block_it_cannot_take_is_refused():
    """quantize_ re-gave an MXLinear of block 16 (dims 48) the config's block-32 recipe, which failed
    at its forward; it is refused as a high-precision Linear of those dims is."""
    from mxmoe.nn import MXLinear

    model = torch.nn.Sequential(MXLinear(48, 48, recipe=mxmoe.recipe(block_size=16)))
    why = r"a MXLinear with dims 48x48 cannot be MX \(not divisible by the block size 32\)"
    with pytest.raises(ValueError, match=why):
        quantize_(model, MXMoETrainingConfig(), filter_fn=lambda m, fqn: fqn == "0")
    assert model[0].recipe.block_size == 16


def test_a_module_registered_under_two_names_is_warned_of():
    """quantize_ visits `m.a = m.b = linear` under its first name only (torch's named_children): the
    second name stayed high precision without a word; mx_filter_fn warns, naming both."""
    lin = torch.nn.Linear(64, 64)
    model = torch.nn.Module()
    model.a = model.b = lin
    config = MXMoETrainingConfig()
    with pytest.warns(UserWarning, match=r"a and b are one module; quantize_ visits it under its first name"):
        quantize_(model, config, filter_fn=mx_filter_fn(config))


def test_a_recipe_where_options_go_is_named():
    """A recipe name or an MXRecipe given to mx_filter_fn or as MXMoETrainingConfig's options (an
    AttributeError "... has no attribute 'to_recipe'", for the config only once quantize_ ran) is a
    TypeError naming what is taken and how to make it."""
    takes = r"mx_filter_fn takes an MXMoETrainingConfig, an mxmoe.MXOptions or None, got "
    for bad in ("mxfp8_rceil", mxmoe.recipe()):
        with pytest.raises(TypeError, match=takes + r".*MXMoETrainingConfig.from_recipe\(name\)"):
            mx_filter_fn(bad)
    with pytest.raises(TypeError, match=r"options must be an mxmoe.MXOptions, got MXRecipe .*from_recipe"):
        MXMoETrainingConfig(options=mxmoe.recipe())
    assert mx_filter_fn(mxmoe.MXOptions())(torch.nn.Linear(64, 64), "x")


def test_attention_and_router_by_what_they_are_as_mxmoe_convert():
    """mx_filter_fn keeps what mxmoe.convert keeps by what it is, not by its name: attention of a
    class named *Attention, `linear_attn`, a vision tower's `attn`, every Linear of a router MLP."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "nn"))
    from test_converter import HybridBlock

    model, ref = HybridBlock(), mxmoe.convert(HybridBlock(), mxmoe.MXOptions())
    config = MXMoETrainingConfig()
    quantize_(model, config, filter_fn=mx_filter_fn(config))
    assert mx_modules(model) == mx_modules(ref) and set(mx_modules(model)) == {"mlp", "experts"}


def test_subclasses_and_float16_modules_are_left_out_or_refused_as_mxmoe_convert():
    """A Linear subclass with its own forward became a plain MXLinear (its forward dropped, outputs
    twice off) and a float16 Linear an MXLinear whose first forward failed deep in an MX op;
    mx_filter_fn leaves the subclass out as mxmoe.convert does, and quantize_ handed either is an
    error naming why."""

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    config = MXMoETrainingConfig()
    model = torch.nn.Sequential(Scaled(64, 64), torch.nn.Linear(64, 64))
    ref = copy.deepcopy(model)
    quantize_(model, config, filter_fn=mx_filter_fn(config))
    assert type(model[0]) is Scaled and type(model[1]) is MXLinear
    x = torch.randn(4, 64)
    assert torch.equal(model[0](x), ref[0](x))
    with pytest.raises(ValueError, match=r"a Scaled cannot be MX \(Scaled: a Linear subclass with a forward"):
        quantize_(torch.nn.Sequential(Scaled(64, 64)), config)
    half = torch.nn.Sequential(torch.nn.Linear(64, 64)).half()
    with pytest.raises(ValueError, match=r"a Linear cannot be MX \(torch.float16 parameters; MX modules"):
        quantize_(half, config, filter_fn=mx_filter_fn(config))
    assert type(half[0]) is torch.nn.Linear
