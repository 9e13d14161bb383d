"""What the MX step runs besides the bf16 step: the aten ops of one forward + backward of the MoE
model (debug_moe) with the MX converter against the same model without it, under CPU bf16
autocast (which the model follows as it follows CUDA autocast: the bf16 step of the H200 runs),
counted outside the quantizer.

The quantizer's own ops are left out: the MX ops call the qdq body directly in eager mode (the
`mxmoe::qdq` custom op is one dispatched call only while torch.compile traces or autograd records
its input), so the count marks the calls of `mxmoe.quant.qdq._qdq_impl` and skips the ops inside
them. Likewise the MX ops call `mxmoe::grouped_mm`'s body directly in eager mode: a direct call
of `mxmoe.ops.gemm._grouped_mm_impl` counts as the one GEMM `grouped_mm` it stands for (what
the bf16 experts dispatch), the ops inside it skipped. What is left is what the MX modules do
around the quantizer: copies, elementwise ops and GEMMs, each keyed by op, phase (forward /
backward), operand shapes and dtypes, output dtype.

Counts on this model (2 x 64 tokens): copies outside the quantizer per step, bf16 120, MX 88 (94
before q/k/v and the SwiGLU w1/w3 shared one cast of their input, 98 before the experts cast their
input once; 96 before the ops followed autocast, 34 of those copies of activations and their
gradients between fp32 and bf16, which the bf16 step does not make); elementwise 228 and GEMMs 69
in both, the MX step's elementwise ops plus the routed experts' silu recomputed in backward (one
per layer, `mx_grouped_swiglu_mlp`; on CUDA minus their forward silu and mul and their backward's
silu_backward and two muls, formed in the cuda kernels' registers). Quantizer calls
per step (weights cast at each use, no cast cache) with attention MX too: 72, 80 before the
shared casts (`test_mx_step_shares_input_casts`; 44 with attention high precision, the default).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

import mxmoe.nn.linear as linear_mod
import mxmoe.nn.mx_experts as experts_mod
import mxmoe.ops.gemm as gemm_mod
import mxmoe.quant.qdq as qdq_mod
from mxmoe.models.moe import Transformer, model_args
from mxmoe.nn.converter import convert
from mxmoe.ops import mx_grouped_mm, mx_grouped_mm_swiglu, mx_mm
from mxmoe.options import DEFAULT_FILTER_FQNS, MXOptions
from mxmoe.quant import cuda_cast

COPIES = {"_to_copy", "copy_", "clone"}  # .contiguous() / .reshape() copies dispatch as clone
GEMMS = {"mm", "addmm", "bmm", "_grouped_mm", "grouped_mm"}
QDQ_IMPL = qdq_mod._qdq_impl
GROUPED_IMPL = gemm_mod._grouped_mm_impl


class StepOps(TorchDispatchMode):
    """Counts copies, elementwise ops and GEMMs outside the quantizer, keyed by (category, phase,
    op, operand (shape, dtype)s, output dtype); `weight_copies`: copies that read the storage of
    one of `weights`; `qdq_calls`, `qdq_ops`: quantizer calls and the ops inside them (skipped)."""

    def __init__(self, weights):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.phase = "fwd"
        self.depth = 0
        self.inside_gemm = 0  # in a direct call of grouped_mm's body (recorded as the op)
        self.qdq_calls = self.qdq_ops = self.weight_copies = 0
        self.weight_storages = {w.untyped_storage().data_ptr() for w in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth:
            self.qdq_ops += 1
            return out
        if self.inside_gemm:
            return out
        self.record(func.overloadpacket.__name__, func.tags, args, out)
        return out

    def record(self, name: str, tags, args, out) -> None:
        if name in COPIES:
            cat = "copy"
        elif name in GEMMS:
            cat = "gemm"
        elif torch.Tag.pointwise in tags:
            cat = "elementwise"
        else:  # views, factories, reductions, indexing: no extra data movement to audit here
            return
        ts = [a for a in args if isinstance(a, torch.Tensor)]
        if cat == "copy" and ts[-1].untyped_storage().data_ptr() in self.weight_storages:
            self.weight_copies += 1
        key = tuple((tuple(t.shape), t.dtype) for t in ts)
        self.ops[(cat, self.phase, name, key, out.dtype if isinstance(out, torch.Tensor) else None)] += 1

    def of(self, cat: str) -> collections.Counter:
        return collections.Counter({k: v for k, v in self.ops.items() if k[0] == cat})


def one_step(model, fqns: list[str], monkeypatch) -> StepOps:
    """Ops of one forward + backward (cross-entropy + aux loss) under bf16 autocast on the model's
    device; weight copies: of the parameters of the modules `fqns`."""
    log = StepOps([p for f in fqns for p in model.get_submodule(f).parameters()])

    def marked(*args, **kw):
        log.depth += 1
        log.qdq_calls += 1
        try:
            return QDQ_IMPL(*args, **kw)
        finally:
            log.depth -= 1

    def grouped_body(a, b, offs):
        # called from the op's own body while the mode dispatches the op (then the mode is off and
        # has counted the op): no second count
        if _get_current_dispatch_mode() is not log:
            return GROUPED_IMPL(a, b, offs)
        log.inside_gemm += 1
        try:
            out = GROUPED_IMPL(a, b, offs)
        finally:
            log.inside_gemm -= 1
        log.record("grouped_mm", (), (a, b, offs), out)
        return out

    monkeypatch.setattr(qdq_mod, "_qdq_impl", marked)
    monkeypatch.setattr(gemm_mod, "_grouped_mm_impl", grouped_body)
    dev = next(model.parameters()).device
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(dev)
    # autocast's weight-cast cache off, as the trainer's CUDA-graph step runs it
    with log, torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False):
        logits, aux = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + aux
        log.phase = "bwd"
        loss.backward()
    return log


def _options(device: str, **kw) -> MXOptions:
    """The MX options of these tests on `device` (kw: other fields, e.g. filter_fqns)."""
    if device == "cpu":  # the recipe as on the H200 (bf16 GEMM operands), CPU cast kernels
        torch_casts = {"mxfp8_dim0_cast_kernel_choice": "torch", "mxfp8_dim1_cast_kernel_choice": "torch"}
        kw.update(torch_casts, gemm_dtype="bfloat16")
    # else the default recipe: the Triton qdq, bf16 GEMMs (torch.mm, torch._grouped_mm)
    return MXOptions(**kw)


def _convert(bf16: Transformer, **kw) -> tuple[Transformer, Transformer, list[str]]:
    mx = convert(copy.deepcopy(bf16), _options(next(bf16.parameters()).device.type, **kw))
    fqns = [f for kind in mx.mx_conversion.converted.values() for f in kind]  # the MX modules
    return bf16, mx, fqns


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def models(request):
    torch.manual_seed(0)
    return _convert(Transformer(model_args("debug_moe")).to(request.param))


@pytest.fixture(scope="module")
def attention_mx(models):
    """`models` with attention MX too (the default filter, DEFAULT_FILTER_FQNS, keeps it high
    precision): q, k, v share one cast of their input."""
    bf16, mx, fqns = _convert(models[0], filter_fqns=[f for f in DEFAULT_FILTER_FQNS if f != "attention"])
    assert any(".attention." in f for f in fqns) and not any(".attention." in f for f in models[2])
    return bf16, mx, fqns


def test_mx_step_copies_no_more_than_bf16(models, monkeypatch):
    """Every copy the MX step makes outside the quantizer, the bf16 step makes too (same op,
    phase, shapes and dtypes), and no MX module copies its weights.

    Copies both steps make (allowed, not extra): the autocast casts of activations entering a GEMM
    (mx_mm / mx_grouped_mm cast their input as torch.mm under autocast does; the experts once for
    w1 and w3), their gradients cast back, each weight gradient cast from the GEMM's bf16 to the
    fp32 parameter (the MX ops' gemm(..., out_dtype=param dtype), bf16's ToCopyBackward of its
    weight cast), the model's own fp32 islands (router, RoPE, RMSNorm, the routed sum) and the
    attention reshapes. Extra copies justified for MX: none.
    Copies only the bf16 step makes: the weight casts fp32 -> bf16 (MX quantizes the fp32 master
    weights directly, once per optimizer step in a cast-cache scope) and, for the experts, the
    gradient's layout copy (the MX wgrad writes the gradient in the parameter's layout).
    """
    bf16, mx, fqns = models
    b, m = one_step(bf16, fqns, monkeypatch), one_step(mx, fqns, monkeypatch)
    assert m.qdq_calls and m.qdq_ops and not b.qdq_calls  # the quantizer ran and was left out
    extra = m.of("copy") - b.of("copy")
    assert not extra, f"copies the MX step makes and the bf16 step does not: {dict(extra)}"
    assert m.weight_copies == 0, "an MX module copies its weight (it should quantize it from fp32)"
    # where the bf16 step casts each of those weights to bf16 once (the router gates and the output
    # head stay high precision in both steps: autocast casts their weights in both)
    assert b.weight_copies == sum(1 for f in fqns for _ in mx.get_submodule(f).parameters()) > 0
    assert sum(m.of("copy").values()) < sum(b.of("copy").values())


def test_mx_step_elementwise_and_gemms_as_bf16(models, monkeypatch):
    """Outside the quantizer the MX step runs the bf16 step's elementwise ops exactly (same ops on
    the same shapes and dtypes: no elementwise work in fp32 where bf16 runs bf16, no extra pass)
    and its GEMMs (on CPU the same calls; on CUDA as many per phase: the experts' grouped GEMMs are
    mxmoe::grouped_mm there, around torch._grouped_mm, its wgrad in the parameter's layout).
    One exception, the routed experts' SwiGLU (`mx_grouped_swiglu_mlp`): its backward recomputes
    F.silu(g) (it keeps g and u, not F.silu(g) and h; under torch.compile inductor fuses the
    recompute into the backward's elementwise kernel), and on CUDA its forward runs no silu and no
    mul (h is formed inside the fused cast; on CPU the torch reference forms it with both ops) and
    its backward no silu, silu_backward and muls (dg and du are formed inside the fused cast)."""
    bf16, mx, fqns = models
    b, m = one_step(bf16, fqns, monkeypatch), one_step(mx, fqns, monkeypatch)
    got, want = m.of("elementwise"), b.of("elementwise")
    extra, missing = got - want, want - got
    n_layers = len(mx.layers)
    assert want
    if not missing:  # the torch reference (and the Triton qdq) forms h, dg and du with torch's ops
        assert len(extra) == 1, (dict(extra), dict(missing))
        ((cat, phase, op, key, dtype), n), = extra.items()
        assert (phase, op, n, dtype) == ("bwd", "silu", n_layers, torch.bfloat16), extra
    else:  # the cuda kernels (the default recipe where the extension builds): none of them
        assert next(mx.parameters()).is_cuda and not extra, (dict(extra), dict(missing))
        key = next(k[3] for k in missing if k[1:3] == ("fwd", "silu"))
        fused = collections.Counter({
            ("elementwise", phase, name, k, torch.bfloat16): n * n_layers
            for phase, name, k, n in (("fwd", "silu", key, 1), ("fwd", "mul", key * 2, 1),
                                      ("bwd", "mul", key * 2, 2), ("bwd", "silu_backward", key * 2, 1))
        })
        assert missing == fused, dict(missing)
    got, want = m.of("gemm"), b.of("gemm")
    assert want
    if next(mx.parameters()).is_cuda:
        phases = [collections.Counter(k[1] for k in c.elements()) for c in (got, want)]
        assert phases[0] == phases[1], phases
    else:
        assert got == want, (dict(got - want), dict(want - got))


def test_mx_step_shares_input_casts(attention_mx, monkeypatch):
    """q, k, v (`mxmoe.nn.project`) and each SwiGLU's w1, w3 (the routed experts' and the shared
    expert's) cast their common input once: per layer the forward makes 2 + 1 + 1 quantizer calls
    fewer than with one single op per weight (the casts of x along K and along M, one fused call
    each), 8 on this model (2 layers): 52 calls per step instead of 60 on CPU (each weight cast
    along K and N from one read in the forward, `cast_weight`: 20 fewer than casting the 20 MX
    weights again in the backward). The backward's casts (each dy) are unchanged, except on CUDA the
    routed experts' casts of dg and du (`mx_grouped_swiglu_mlp`: the cuda kernel, no qdq call; 2 per
    layer). Same loss bits both ways.
    Attention MX here (`attention_mx`), so that q, k, v share their cast."""
    bf16, mx, fqns = attention_mx
    mx.zero_grad(set_to_none=True)  # the other tests' steps left theirs
    shared = one_step(mx, fqns, monkeypatch)
    grads = [p.grad.clone() for p in mx.parameters() if p.grad is not None]
    mx.zero_grad(set_to_none=True)
    monkeypatch.setattr(linear_mod, "mx_mm_shared", lambda x, bs, c: tuple(mx_mm(x, b, c) for b in bs))
    monkeypatch.setattr(
        experts_mod,
        "mx_grouped_swiglu_mlp",
        lambda x, w1_t, w3_t, w2_t, offs, c: mx_grouped_mm_swiglu(
            mx_grouped_mm(x, w1_t, offs, c), mx_grouped_mm(x, w3_t, offs, c), w2_t, offs, c
        ),
    )
    single = one_step(mx, fqns, monkeypatch)
    grads_single = [p.grad.clone() for p in mx.parameters() if p.grad is not None]
    mx.zero_grad(set_to_none=True)
    n_layers = len(mx.layers)
    assert n_layers == 2
    bwd_fused = 2 * n_layers if next(mx.parameters()).is_cuda and cuda_cast.ops_loaded else 0
    assert single.qdq_calls - shared.qdq_calls == n_layers * (2 + 1 + 1) + bwd_fused
    if not next(mx.parameters()).is_cuda:
        assert (shared.qdq_calls, single.qdq_calls) == (52, 60)
    assert len(grads) == len(grads_single) > 0
    for g, h in zip(grads, grads_single, strict=True):  # the same gradients, bit for bit
        assert torch.equal(g.view(-1).view(torch.uint8), h.view(-1).view(torch.uint8))
