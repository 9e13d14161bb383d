"""Expert parallelism as a strategy applied from outside (`apply_expert_parallel`), on 2 gloo ranks:
the MX dispatch quantizes with the experts' recipe, the result does not depend on whether EP is
applied before or after `mxmoe.convert`, and matches one process holding every expert."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks

import mxmoe
from mxmoe.models import ExpertParallel, LocalExperts, Transformer, apply_expert_parallel, model_args
from mxmoe.quant.mx_tensor import MXTensor
from mxmoe.recipe import recipe

RECIPE = recipe("mxfp8", dim0_kernel="torch", dim1_kernel="torch")  # FLOOR: not the exchange's default


def _model(num_experts: int = 4) -> Transformer:
    torch.manual_seed(0)
    args = model_args("debug_moe", vocab_size=64, max_seq_len=16, n_layers=1, dim=64, num_experts=num_experts)
    return Transformer(args)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 + rank))


def _run(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, aux = model(tokens)
    (logits.float().square().mean() + aux).backward()
    return logits.detach(), model.layers[0].moe.experts.w1.grad.clone()


def _join(rank: int, port: int) -> dist.ProcessGroup:
    """This rank in a 2-process gloo group (one CPU thread); returns the experts' group."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    return dist.new_group([0, 1])


def _worker(rank: int, world: int, port: int, out: str) -> None:
    group = _join(rank, port)
    try:
        results = []
        for order in ("ep_then_convert", "convert_then_ep"):
            m = _model()
            if order == "ep_then_convert":
                apply_expert_parallel(m, group)
                mxmoe.convert(m, RECIPE)
            else:
                mxmoe.convert(m, RECIPE)
                apply_expert_parallel(m, group)
            moe = m.layers[0].moe
            assert isinstance(moe.dispatch, ExpertParallel) and moe.experts.w1.shape[0] == 2
            seen = []
            forward = moe.experts.forward

            def spy(x, counts, forward=forward, seen=seen):
                seen.append((type(x), x.scaling_mode, x.elem_dtype))
                return forward(x, counts)

            moe.experts.forward = spy
            results.append(_run(m, _tokens(rank)))
            # the rows arrive as MX in the experts' recipe (FLOOR), not the exchange's default (RCEIL)
            assert seen == [(MXTensor, "floor", torch.float8_e4m3fn)], seen
            with pytest.raises(RuntimeError, match="already sharded"):
                apply_expert_parallel(m, group)
        (la, ga), (lb, gb) = results
        assert torch.equal(la, lb) and torch.equal(ga, gb)
        torch.save({"logits": la, "w1_grad": ga}, f"{out}.{rank}")
        with pytest.raises(ValueError, match="num_experts=3 is not divisible"):
            apply_expert_parallel(_model(num_experts=3), group)
        # a layer it cannot shard, after one it can: refused naming it, before any layer changes (the
        # first layer was sharded, and a second call said "already sharded")
        m = _model()
        m.layers.append(_model(num_experts=3).layers[0])
        with pytest.raises(ValueError, match=r"^layers.1.moe: num_experts=3 is not divisible by the "
                           r"expert-parallel degree 2$"):
            apply_expert_parallel(m, group)
        assert all(isinstance(b.moe.dispatch, LocalExperts) for b in m.layers)
        assert [b.moe.experts.w1.shape[0] for b in m.layers] == [4, 3]
        # a group this rank is not in (what dist.new_group gives the others): said so, not "got int"
        only_0 = dist.new_group([0])
        if rank == 1:
            with pytest.raises(ValueError, match="this process is not a member of group"):
                apply_expert_parallel(_model(), only_0)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_follows_the_experts_recipe_and_matches_one_process(tmp_path):
    out = str(tmp_path / "ep")
    spawn_ranks(_worker, 2, out)
    # one process, every expert, both ranks' tokens as one batch
    m = mxmoe.convert(_model(), RECIPE)
    assert isinstance(m.layers[0].moe.dispatch, LocalExperts)
    logits, w1_grad = _run(m, torch.cat([_tokens(0), _tokens(1)]))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    torch.testing.assert_close(torch.cat([r["logits"] for r in ranks]), logits, rtol=1e-5, atol=1e-5)
    # expert gradients: rank r holds experts 2r, 2r+1; the loss is a mean over each rank's batch,
    # so the one-process gradient (mean over both) is half the sum of the ranks' gradients. The wgrad
    # casts along tokens see other 32-row blocks in the two layouts: equal up to MX rounding.
    ep_grad = torch.cat([r["w1_grad"] for r in ranks]) / 2
    assert float((ep_grad - w1_grad).norm() / w1_grad.norm()) < 0.02


def _compile_worker(rank: int, world: int, port: int) -> None:
    from mxmoe.train.trainer import compile_submodules

    group = _join(rank, port)
    try:
        for mx in (False, True):
            eager, compiled = _model(), _model()
            for m in (eager, compiled):
                apply_expert_parallel(m, group)
                if mx:
                    mxmoe.convert(m, RECIPE)
            compile_submodules(compiled, backend="aot_eager")
            compiled_names = [n for n, mod in compiled.named_modules() if mod._compiled_call_impl is not None]
            # the MoE layer is one region (fullgraph=True): router, dispatch with its all-to-alls
            # (custom ops), experts, combine and shared expert
            assert compiled_names == [
                "layers.0.attention_norm",
                "layers.0.attention",
                "layers.0.ffn_norm",
                "layers.0.moe",
                "norm",
            ], compiled_names
            (le, _), (lc, _) = _run(eager, _tokens(rank)), _run(compiled, _tokens(rank))
            torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=f"mx={mx} {name}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_per_block_compile_takes_the_expert_parallel_moe_whole():
    """`compile.enable` with EP=2 (trainer.compile_submodules): each MoE layer, its exchange
    included, compiles as one graph (fullgraph=True: no graph break); high precision and MX, the
    step matches eager on each rank."""
    spawn_ranks(_compile_worker, 2)


def test_apply_expert_parallel_needs_moe_layers():
    args = model_args("debug_dense", vocab_size=64, max_seq_len=16, n_layers=1)
    with pytest.raises(ValueError, match="has no MoE layer"):
        apply_expert_parallel(Transformer(args), None)


def test_apply_expert_parallel_needs_a_process_group():
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup .* got int"):
        apply_expert_parallel(Transformer(model_args("debug_moe", vocab_size=64, max_seq_len=16)), 2)


# The exchange only (recipe expert_gemm="bf16"): bf16 experts, MXFP8 dispatch and combine gradient.
HP = RECIPE.replace(expert_gemm="bf16")


def _hp_run(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits and the gradients of the expert weights and the embedding, for a loss without the
    router's aux term (so that one process's batch-wide aux does not enter the comparison)."""
    logits, _ = model(tokens)
    logits.float().square().mean().backward()
    ex = model.layers[0].moe.experts
    out = {name: getattr(ex, name).grad.clone() for name in ("w1", "w2", "w3")}
    return {"logits": logits.detach(), "emb": model.tok_embeddings.weight.grad.clone(), **out}


def _hp_worker(rank: int, world: int, port: int, out: str) -> None:
    group = _join(rank, port)
    try:
        m = _model()
        cfg = mxmoe.MXOptions(  # the trainer's --mx.expert_gemm=bf16 --mx.convert_linears=false
            recipe_name="mxfp8",
            mxfp8_dim0_cast_kernel_choice="torch",
            mxfp8_dim1_cast_kernel_choice="torch",
            convert_linears=False,
            expert_gemm="bf16",
        )
        assert cfg.to_recipe() == HP
        mxmoe.convert(m, cfg)
        apply_expert_parallel(m, group)
        assert not any(isinstance(mod, mxmoe.nn.MXLinear) for mod in m.modules())
        experts = m.layers[0].moe.experts
        seen, gemm_rows = [], []
        forward, hp_forward = experts.forward, mxmoe.nn.GroupedExperts.forward

        def spy(x, counts):
            seen.append((type(x), x.scaling_mode))
            return forward(x, counts)

        def spy_gemm(self, x, counts):  # the rows the bf16 grouped GEMMs get
            gemm_rows.append(x.detach().clone())
            return hp_forward(self, x, counts)

        experts.forward = spy
        mxmoe.nn.GroupedExperts.forward = spy_gemm
        try:
            res = _hp_run(m, _tokens(rank))
        finally:
            mxmoe.nn.GroupedExperts.forward = hp_forward
        # the rows crossed as MXFP8 in the recipe's format and reached the GEMMs dequantized, exactly
        assert seen == [(MXTensor, "floor")], seen
        (rows,) = gemm_rows
        assert torch.equal(rows, mxmoe.to_mx(rows, axis=-1, recipe=HP).dequantize())
        torch.save(res, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


class _RefRows(torch.autograd.Function):
    """Reference of the dispatch: to_mx -> dequantize forward, the gradient unchanged backward."""

    @staticmethod
    def forward(ctx, x):
        return mxmoe.to_mx(x, axis=-1, recipe=HP).dequantize()

    @staticmethod
    def backward(ctx, g):
        return g


class _RefGrad(torch.autograd.Function):
    """Reference of the combine: identity forward, to_mx -> dequantize of the gradient backward."""

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return mxmoe.to_mx(g.contiguous(), axis=-1, recipe=HP).dequantize()


def test_exchange_only_matches_bf16_experts_on_rounded_rows(tmp_path):
    """expert_gemm="bf16" at EP=2 (2 gloo ranks) against one process holding every expert as plain
    `GroupedExperts` whose input rows are rounded by to_mx -> dequantize (gradient straight through)
    and whose output gradient is rounded the same way: logits, expert and embedding gradients agree
    to fp32 summation order. The rounding matters: the plain model (no rounding) is further off."""
    out = str(tmp_path / "hp")
    spawn_ranks(_hp_worker, 2, out)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    tokens = torch.cat([_tokens(0), _tokens(1)])
    ep = {k: torch.cat([r[k] for r in ranks]) for k in ("logits", "w1", "w2", "w3")}
    ep["emb"] = ranks[0]["emb"] + ranks[1]["emb"]
    for k in ("w1", "w2", "w3", "emb"):  # each rank's loss is a mean over its half of the batch
        ep[k] = ep[k] / 2

    def one_process(rounded: bool) -> dict[str, torch.Tensor]:
        m = _model()
        ex = m.layers[0].moe.experts
        if rounded:
            fwd = ex.forward
            ex.forward = lambda x, counts: _RefGrad.apply(fwd(_RefRows.apply(x), counts))
        return _hp_run(m, tokens)

    ref, plain = one_process(True), one_process(False)
    for k in ("logits", "w1", "w2", "w3", "emb"):
        torch.testing.assert_close(ep[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    # without the rounding the model is another one (the MoE output is a small part of the logits)
    for k in ("logits", "w1", "w2", "emb"):
        off, near = (float((ep[k] - r[k]).norm() / r[k].norm()) for r in (plain, ref))
        assert off > 1e-5 and off > 100 * near, (k, off, near)
