"""The MX ops under activation checkpointing (`torch.utils.checkpoint`, non-reentrant, as
torchtitan's `--activation_checkpoint.mode full` and selective AC run them): the same outputs and
gradients, bit for bit, as without it. (Each op's backward reads its saved tensors once: a second
read under non-reentrant checkpointing raises CheckpointError.)"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_bits
from torch.utils.checkpoint import checkpoint

from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_shared, mx_grouped_swiglu_mlp, mx_mm, mx_mm_shared
from tests.ops.recipes import CPU, CPU_BF16


def rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).requires_grad_()


def dense_mm(x, w1, w2):
    return mx_mm(x, w1.t(), CPU).sum(-1, keepdim=True) * mx_mm(x, w2.t(), CPU)


def dense_shared(x, w1, w2):
    a, b = mx_mm_shared(x, [w1.t(), w2.t()], CPU)
    return a * b


OFFS = torch.tensor([32, 32, 96], dtype=torch.int32)  # an empty group; rows after the last


def grouped(x, w1, w2):
    t = lambda w: w.transpose(-2, -1)  # noqa: E731
    return mx_grouped_mm(x, t(w1), OFFS, CPU) * mx_grouped_mm(x, t(w2), OFFS, CPU)


def grouped_shared(x, w1, w2):
    a, b = mx_grouped_mm_shared(x, [w1.transpose(-2, -1), w2.transpose(-2, -1)], OFFS, CPU)
    return a * b


def swiglu(x, w1, w3, w2):
    t = lambda w: w.transpose(-2, -1)  # noqa: E731
    return mx_grouped_swiglu_mlp(x, t(w1), t(w3), t(w2), OFFS, CPU_BF16)


CASES = {
    "mx_mm": (dense_mm, [(64, 64), (32, 64), (32, 64)], torch.float32),
    "mx_mm_shared": (dense_shared, [(64, 64), (32, 64), (32, 64)], torch.float32),
    "mx_grouped_mm": (grouped, [(128, 64), (3, 32, 64), (3, 32, 64)], torch.float32),
    "mx_grouped_mm_shared": (grouped_shared, [(128, 64), (3, 32, 64), (3, 32, 64)], torch.float32),
    "mx_grouped_swiglu_mlp": (swiglu, [(128, 64), (3, 32, 64), (3, 32, 64), (3, 64, 32)], torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_checkpointed_equals_plain(name):
    fn, shapes, dtype = CASES[name]
    results = []
    for ckpt in (False, True):
        inputs = [rand(s, seed, dtype) for seed, s in enumerate(shapes)]
        out = checkpoint(fn, *inputs, use_reentrant=False) if ckpt else fn(*inputs)
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in inputs)])
    for i, (got, want) in enumerate(zip(results[1], results[0], strict=True)):
        assert_same_bits(got, want, f"{name} output/grad {i}")
