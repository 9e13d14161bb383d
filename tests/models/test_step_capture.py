"""The model step without host syncs: it compiles with fullgraph=True (CPU here), MX and high
precision, and matches eager; the router's counts need no bincount."""

from __future__ import annotations

import pytest
import torch

import mxmoe
from mxmoe.models import GraphedStep, Transformer, expert_counts, model_args
from mxmoe.recipe import recipe

CPU_RECIPE = recipe(dim0_kernel="torch", dim1_kernel="torch")


def _model(mx: bool, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(model_args("debug_moe", vocab_size=64, max_seq_len=16, n_layers=1, dim=64))
    return mxmoe.convert(m, CPU_RECIPE) if mx else m


def _loss(model, tokens):
    logits, aux = model(tokens)
    return logits.float().square().mean() + 0.01 * aux


def test_expert_counts_equal_bincount():
    idx = torch.randint(0, 7, (33, 3), generator=torch.Generator().manual_seed(0))
    counts = expert_counts(idx, 9)
    assert counts.dtype == torch.int64
    assert torch.equal(counts, torch.bincount(idx.flatten(), minlength=9))


@pytest.mark.parametrize("mx", [False, True], ids=["hp", "mx"])
def test_model_step_compiles_fullgraph_and_matches_eager(mx):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, compiled = _model(mx), _model(mx)
    _loss(eager, tokens).backward()
    # fullgraph=True: a host sync or data-dependent shape anywhere in forward or backward fails here
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    loss = _loss(step, tokens)
    loss.backward()
    torch.testing.assert_close(loss, _loss(eager, tokens).detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def _compiled_modules(model: torch.nn.Module) -> list[str]:
    """Names of the submodules `nn.Module.compile` was called on."""
    return [n for n, mod in model.named_modules() if mod._compiled_call_impl is not None]


@pytest.mark.parametrize("mx", [False, True], ids=["hp", "mx"])
def test_per_block_compile_takes_the_moe_layer_whole_and_matches_eager(mx):
    """`compile.enable` (trainer.compile_submodules) at EP=1: each MoE layer, routed experts (MX
    or not) and their permutation included, is one fullgraph region; a training step (loss, every
    gradient, the router's counts) and an eval forward under no_grad match eager."""
    from torch._dynamo.utils import counters

    from mxmoe.train.trainer import compile_submodules

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    eager, compiled = _model(mx), _model(mx)
    torch._dynamo.reset()
    counters.clear()
    compile_submodules(compiled, backend="aot_eager")
    assert _compiled_modules(compiled) == [
        "layers.0.attention_norm",
        "layers.0.attention",
        "layers.0.ffn_norm",
        "layers.0.moe",
        "norm",
    ]
    eager_loss, loss = _loss(eager, tokens), _loss(compiled, tokens)
    eager_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # the router's in-place count update happens inside the compiled MoE graph
    counts = [m.layers[0].moe.router.tokens_per_expert for m in (eager, compiled)]
    assert counts[0].sum() > 0 and torch.equal(counts[1], counts[0])
    eager.eval(), compiled.eval()
    with torch.no_grad():
        (le, ae), (lc, ac) = eager(tokens), compiled(tokens)
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ac, ae, rtol=1e-6, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_graphed_step_needs_cuda_tensors():
    m = _model(False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            GraphedStep(lambda t: _loss(m, t), m.parameters(), (torch.zeros(2, 16, dtype=torch.long),))
    else:
        with pytest.raises(ValueError, match="example_batch must be CUDA tensors"):
            GraphedStep(lambda t: _loss(m, t), m.parameters(), (torch.zeros(2, 16, dtype=torch.long),))


def test_trainer_cuda_graph_needs_one_gpu(capsys):
    from mxmoe.train import trainer

    assert (
        trainer.main(["--training.device=cpu", "--training.cuda_graph", "--metrics.progress_bar=false"]) == 2
    )
    assert "training.cuda_graph=true captures one GPU's step" in capsys.readouterr().err
