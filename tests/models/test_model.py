"""The MoE transformer: shapes, causality, routing vs a per-token reference, load balancing."""

import pytest
import torch
from torch import nn

from mxmoe.models import PRESETS, Router, Transformer, expert_major_index, model_args, routed_experts
from mxmoe.models.moe import ModelArgs
from mxmoe.nn.experts import GroupedExperts


def tiny(**kw) -> ModelArgs:
    base = dict(dim=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, moe_hidden_dim=32, max_seq_len=16)
    base.update(kw)
    return model_args("debug_moe", **base)


@pytest.mark.parametrize("name", ["debug_moe", "debug_dense"])
def test_forward_shapes_and_param_count(name):
    torch.manual_seed(0)
    args = model_args(name, max_seq_len=16)
    model = Transformer(args)
    logits, aux = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32
    assert aux.shape == () and torch.isfinite(aux)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()[0]
    if name == "debug_dense":
        assert aux.item() == 0.0 and not model.moe_layers()


@pytest.mark.parametrize(
    "name, low, high", [("moe_1b", 0.5e9, 1.1e9), ("dense_1b", 0.5e9, 1.1e9), ("moe_2b", 1.5e9, 2.5e9)]
)
def test_preset_param_counts_on_meta(name, low, high):
    with torch.device("meta"):
        model = Transformer(PRESETS[name])
    n = sum(p.numel() for p in model.parameters())
    assert n == PRESETS[name].num_params()[0]
    assert low < n < high


def test_causal():
    torch.manual_seed(0)
    model = Transformer(tiny())
    a = torch.randint(0, 256, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 256
    la, _ = model(a)
    lb, _ = model(b)
    torch.testing.assert_close(la[0, :10], lb[0, :10], rtol=0, atol=0)
    assert not torch.equal(la[0, 10:], lb[0, 10:])


def test_seq_len_limit():
    model = Transformer(tiny())
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "tokens", [torch.zeros(8, dtype=torch.long), torch.zeros(1, 8), torch.zeros(1, 8, 1, dtype=torch.long)]
)
def test_tokens_not_batch_by_seq_ids_are_refused(tokens):
    with pytest.raises(ValueError, match="tokens: expected a \\(batch, seq\\) int64 tensor of token ids"):
        Transformer(tiny())(tokens)


def test_bad_args_name_the_field():
    with pytest.raises(ValueError, match="top_k=5"):
        tiny(top_k=5)
    with pytest.raises(ValueError, match="load_balance='x'"):
        tiny(load_balance="x")
    with pytest.raises(ValueError, match="preset"):
        model_args("nope")


def test_routed_experts_matches_per_token_reference():
    torch.manual_seed(0)
    T, D, E, k = 24, 32, 4, 2
    experts = GroupedExperts(D, 32, E)
    x = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.rand(T, k)
    out = routed_experts(x, idx, w, experts, E)
    ref = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            h = torch.nn.functional.silu(x[t] @ experts.w1[e].T) * (x[t] @ experts.w3[e].T)
            ref[t] += w[t, j] * (h @ experts.w2[e].T)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_routed_experts_gradients_match_per_token_reference_and_repeat_exactly():
    """top-3 of 5: forward and the gradients of x, the gate weights and the expert weights match
    the per-token loop; under torch.use_deterministic_algorithms two calls give the same bits."""
    torch.manual_seed(0)
    T, D, E, k = 20, 32, 5, 3
    experts = GroupedExperts(D, 32, E)
    x0 = torch.randn(T, D)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w0 = torch.rand(T, k)
    g = torch.randn(T, D)

    def run(fn):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        (fn(x, w) * g).sum().backward()
        return [x.grad, w.grad] + [p.grad.clone() for p in (experts.w1, experts.w2, experts.w3)]

    def reference(x, w):
        rows = []
        for t in range(T):
            acc = torch.zeros(D)
            for j in range(k):
                e = int(idx[t, j])
                h = torch.nn.functional.silu(x[t] @ experts.w1[e].T) * (x[t] @ experts.w3[e].T)
                acc = acc + w[t, j] * (h @ experts.w2[e].T)
            rows.append(acc)
        return torch.stack(rows)

    ref = run(reference)
    torch.use_deterministic_algorithms(True)
    try:
        got = run(lambda x, w: routed_experts(x, idx, w, experts, E))
        again = run(lambda x, w: routed_experts(x, idx, w, experts, E))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b, r in zip(got, again, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_repeat_bit_for_bit_on_cuda_without_deterministic_mode(dtype):
    """The permutation gathers and the fixed-order top-k sum need no deterministic mode: top-4 of 8
    over 8192 tokens (many rows per token, where an atomic index_add would vary), forward and the
    gradients of x, the gate weights and the expert weights, three times, the same bits."""
    from conftest import assert_same_bits

    assert not torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(0)
    T, D, E, k = 8192, 256, 8, 4
    experts = GroupedExperts(D, 256, E).cuda().to(dtype)
    x0 = torch.randn(T, D, device="cuda", dtype=dtype)
    idx = torch.rand(T, E, device="cuda").argsort(-1)[:, :k]
    w0 = torch.rand(T, k, device="cuda")
    g = torch.randn(T, D, device="cuda", dtype=dtype)

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        out = routed_experts(x, idx, w, experts, E)
        (out.float() * g.float()).sum().backward()
        return [out, x.grad, w.grad] + [p.grad.clone() for p in (experts.w1, experts.w2, experts.w3)]

    first = run()
    for _ in range(2):
        for i, (a, b) in enumerate(zip(first, run(), strict=True)):
            assert_same_bits(a, b, f"output {i}")


def test_expert_major_index():
    g = torch.Generator().manual_seed(1)
    recv = torch.randint(0, 4, (3, 5), generator=g)  # (ep sources, local experts)
    idx = expert_major_index(recv)
    # reference: label every received row with (source, expert), then sort expert-major
    labels = [(s, e) for s in range(3) for e in range(5) for _ in range(int(recv[s, e]))]
    want = sorted(range(len(labels)), key=lambda i: (labels[i][1], labels[i][0], i))
    assert idx.tolist() == want


def test_aux_loss_is_one_for_uniform_router():
    args = tiny(num_experts=8, top_k=2)
    r = Router(args)
    nn.init.zeros_(r.gate.weight)  # uniform probabilities -> aux = sum_e f_e = 1
    _, w, aux = r(torch.randn(64, 32))
    torch.testing.assert_close(aux, torch.tensor(1.0))
    torch.testing.assert_close(w.sum(-1), torch.ones(64))


def test_aux_loss_gradient_pushes_to_balance():
    torch.manual_seed(0)
    r = Router(tiny(num_experts=4, top_k=1))
    with torch.no_grad():
        r.gate.weight.zero_()
        r.gate.weight[0] = 1.0  # expert 0 favoured for x with positive sum
    x = torch.rand(128, 32)
    _, _, aux = r(x)
    aux.backward()
    # descending the aux loss lowers the favoured expert's logit weight
    assert r.gate.weight.grad[0].sum() > 0


def test_bias_balancing_evens_out_load():
    torch.manual_seed(0)
    r = Router(tiny(num_experts=4, top_k=1, load_balance="bias"))
    with torch.no_grad():
        r.gate.weight.normal_(std=0.2)
    x = torch.randn(256, 32) + 1

    def counts():
        idx, _, _ = r(x)
        return torch.bincount(idx.flatten(), minlength=4)

    first = counts()
    for _ in range(60):
        r.update_bias(rate=0.01)
        counts()
    last = counts()
    assert first.max() >= 100  # unbalanced to start with (ideal: 64 each)
    assert last.max() <= 72 and last.min() >= 56
    assert r.expert_bias[first.argmax()] < 0 and r.expert_bias[first.argmin()] > 0
    assert "expert_bias" in r.state_dict() and "tokens_per_expert" not in r.state_dict()


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    model = Transformer(tiny(num_experts=2, top_k=2))
    logits, aux = model(torch.randint(0, 256, (2, 16)))
    (logits.float().logsumexp(-1).mean() + aux).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
