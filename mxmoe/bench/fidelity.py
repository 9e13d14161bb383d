"""`mxmoe bench fidelity`: each MX variant's gradient and loss error vs fp32 at bf16-trained weights.

What a user asks before a long A/B: does MX hurt *this* model, and which GEMMs carry the error?

    mxmoe bench fidelity --config moe_2b --steps 150 --variants bf16,mx,mx_fwd_only

The model of the config trains `--steps` bf16 steps (its optimizer, lr schedule, batch and data);
then, on `--batches` fixed batches, every variant computes the loss and the gradients at those
same weights, and each is compared with fp32's (no autocast): per parameter group, the relative
error ||g - g_fp32|| / ||g_fp32|| over the batches, and the loss difference in %. bf16's own error
is the yardstick: a variant at a few times bf16's error adds rounding noise; one at bf16's error
of ~1 (as on a model trained at the edge of stability) means the gradients there are dominated by
directions that any rounding changes.

Variants (all in the config's mixed precision, except fp32):
  bf16             the high-precision model
  mx               mxmoe.convert with the config's [mx] options (default recipe mxfp8_rceil)
  mx_floor         the same with FLOOR scales (recipe mxfp8)
  mx_experts_only  only the routed experts MX
  mx_linears_only  only the linears MX (experts bf16)
  mx_wgrad_with_hp recipe mxfp8_rceil_wgrad_with_hp (torchao's): MX forward and input gradients,
                   the weight-gradient GEMMs in high precision on the unquantized operands
  mx_fwd_only      MX forward values, every gradient from high-precision operands (straight-through)
  mx_fwd_wgrad_only  MX forward and weight gradients; input gradients from high-precision operands
  mx_gemm_fp32     mx with the emulated GEMM in fp32 instead of bf16 (rules the emulation out)
The two straight-through variants (mx_fwd_only, mx_fwd_wgrad_only) run each MX module twice (its MX
and its high-precision form) and take each value or gradient from the one the variant names: a
measurement device, not a recipe.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mxmoe.cli import ArgumentParser, comma_list, positive_int

VARIANTS = (
    "bf16",
    "mx",
    "mx_floor",
    "mx_experts_only",
    "mx_linears_only",
    "mx_wgrad_with_hp",
    "mx_fwd_only",
    "mx_fwd_wgrad_only",
    "mx_gemm_fp32",
)
RENAMED_VARIANTS = {"mx_hp_wgrad": "mx_wgrad_with_hp", "mx_hp_dgrad": "mx_fwd_wgrad_only"}
"""Old variant names -> the new ones (mx_hp_wgrad, a straight-through stand-in, is now the recipe)."""
GROUPS = ("tok_embeddings", "attention.", "router", "experts.", "shared_expert", "norm", "output")
_NOT_EXPERTS = ["output", "router", "attention", "shared_expert", "feed_forward"]


class _Mixed(nn.Module):
    """An MX module's forward value with gradients from its high-precision form where `mode` says.

    mode "fwd": all gradients high precision; "fwd_wgrad": weight gradients MX, input gradient high
    precision."""

    def __init__(self, mx: nn.Module, ref: nn.Module, mode: str):
        super().__init__()
        self.mx, self.mode = mx, mode
        self._ref = [ref]  # not a submodule: it shares mx's parameters

    def forward(self, x: Tensor, *rest) -> Tensor:
        ref = self._ref[0]
        if self.mode == "fwd":
            h = ref(x, *rest)
            return h + (self.mx(x, *rest) - h).detach()
        # "fwd_wgrad": the weights' gradients from the MX form, x's from the reference form
        y = self.mx(x.detach(), *rest)
        with _frozen_params(self.mx):
            h = ref(x, *rest)
        return y + (h - h.detach())


class _frozen_params:  # noqa: N801 - used as a context manager
    """Within the block, `module`'s parameters are seen as constants (requires_grad False)."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)


def _reference_form(m: nn.Module) -> nn.Module:
    """The high-precision module computing what MX module `m` computes, on m's parameters."""
    from mxmoe.nn.experts import GroupedExperts
    from mxmoe.nn.linear import MXLinear

    if isinstance(m, MXLinear):
        return _ReferenceLinear(m)
    ref = GroupedExperts.__new__(GroupedExperts)
    nn.Module.__init__(ref)
    ref.dim, ref.hidden_dim, ref.num_experts = m.dim, m.hidden_dim, m.num_experts
    ref.w1, ref.w2, ref.w3 = m.w1, m.w2, m.w3
    return ref


class _ReferenceLinear(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self._m = [m]

    def forward(self, x: Tensor) -> Tensor:
        m = self._m[0]
        return F.linear(x, m.weight, m.bias)


def _build(variant: str, cfg, margs, state: dict, device: torch.device) -> nn.Module:
    import mxmoe
    from mxmoe.models.moe import Transformer
    from mxmoe.nn.linear import MXLinear
    from mxmoe.nn.mx_experts import MXGroupedExperts
    from mxmoe.options import MXOptions

    with torch.device(device):
        model = Transformer(margs)
    model.load_state_dict(state)
    if variant == "bf16":
        return model
    mx = cfg.mx
    opts = dict(
        recipe_name=mx.recipe_name,
        filter_fqns=list(mx.filter_fqns),
        mxfp8_dim0_cast_kernel_choice=mx.mxfp8_dim0_cast_kernel_choice,
        mxfp8_dim1_cast_kernel_choice=mx.mxfp8_dim1_cast_kernel_choice,
    )
    if variant == "mx_floor":
        opts["recipe_name"] = "mxfp8"
    elif variant == "mx_wgrad_with_hp":
        opts["recipe_name"] = "mxfp8_rceil_wgrad_with_hp"
    elif variant == "mx_experts_only":
        opts["filter_fqns"] = sorted(set(opts["filter_fqns"]) | set(_NOT_EXPERTS))
    elif variant == "mx_linears_only":
        opts["convert_grouped_experts"] = False
    elif variant == "mx_gemm_fp32":
        opts["gemm_dtype"] = "float32"
    mxmoe.convert(model, MXOptions(**opts))
    mode = {"mx_fwd_only": "fwd", "mx_fwd_wgrad_only": "fwd_wgrad"}.get(variant)
    if mode is not None:
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, (MXLinear, MXGroupedExperts)):
                    setattr(parent, name, _Mixed(child, _reference_form(child), mode))
    return model


def _group(name: str) -> str:
    return next((g.strip(".") for g in GROUPS if g in name), "other")


def measure(cfg, steps: int, n_batches: int, variants: list[str], device: torch.device) -> dict:
    """{variant: {"loss": mean loss, "dloss_pct": vs fp32, group: relative gradient error}} (fp32:
    its loss only) after `steps` bf16 training steps of `cfg`'s model."""
    from mxmoe.models.moe import Transformer
    from mxmoe.train.data import VOCAB_SIZE, PackedDataset, load_tokens
    from mxmoe.train.trainer import build_model_args, build_optimizer, lr_lambda

    t = cfg.training
    torch.manual_seed(cfg.debug.seed)
    margs = build_model_args(cfg)
    with torch.device(device):
        model = Transformer(margs)
    d = cfg.data
    train_tokens, _ = load_tokens(d.path, d.val_fraction, d.max_files, d.extensions)
    ds = PackedDataset(train_tokens, t.seq_len)
    gen = torch.Generator().manual_seed(cfg.debug.seed)

    def batch():
        idx = torch.randint(len(ds), (t.local_batch_size,), generator=gen)
        return tuple(a.to(device) for a in ds.batch(idx))

    amp_on = device.type == "cuda" and t.mixed_precision == "bf16"

    def loss_of(m, x, y, amp: bool):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits, aux = m(x)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), y.reshape(-1)), aux

    opt = build_optimizer(model, cfg, distributed=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    coef = margs.aux_loss_coef if margs.load_balance == "aux_loss" else 0.0
    for _ in range(steps):
        ce, aux = loss_of(model, *batch(), amp_on)
        (ce + coef * aux).backward()
        if t.max_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model, opt
    batches = [batch() for _ in range(n_batches)]

    def run(variant: str, ref: list[dict] | None):
        """The variant's per-batch losses; its per-batch gradients (fp32) when ref is None, else
        the (squared error, squared reference) sums per group against ref, batch by batch (one
        batch's gradients alive at a time besides the reference's)."""
        m = _build("bf16" if variant == "fp32" else variant, cfg, margs, state, device)
        losses, kept, err = [], [], {}
        for i, (x, y) in enumerate(batches):
            ce, _ = loss_of(m, x, y, amp_on and variant != "fp32")
            ce.backward()
            losses.append(float(ce.detach()))
            named = m.named_parameters()
            grads = {n.replace(".mx.", "."): p.grad.float() for n, p in named if p.grad is not None}
            if ref is None:
                kept.append({n: g.clone() for n, g in grads.items()})
            else:
                for n, g in grads.items():
                    e = err.setdefault(_group(n), [0.0, 0.0])
                    e[0] += float(((g - ref[i][n]) ** 2).sum())
                    e[1] += float((ref[i][n] ** 2).sum())
            m.zero_grad(set_to_none=True)
        del m
        return losses, (kept if ref is None else err)

    ref_losses, ref = run("fp32", None)
    out = {"fp32": {"loss": sum(ref_losses) / len(ref_losses)}}
    for v in variants:
        losses, err = run(v, ref)
        row = {"loss": sum(losses) / len(losses), "dloss_pct": 100 * (sum(losses) / sum(ref_losses) - 1)}
        row.update({k: rel_error(a, b) for k, (a, b) in err.items()})
        out[v] = row
    return out


def rel_error(diff_sq: float, ref_sq: float) -> float:
    """||g - g_fp32|| / ||g_fp32|| from the two sums of squares. Where the fp32 gradient is zero: 0
    if the variant's is zero too, else inf (no bounded relative error; never a 0.0 that reads as
    exact)."""
    if ref_sq > 0:
        return math.sqrt(diff_sq / ref_sq)
    return math.inf if diff_sq > 0 else 0.0


def format_table(res: dict) -> str:
    """A markdown table of `measure`'s result."""
    groups = [g.strip(".") for g in GROUPS if any(g.strip(".") in r for r in res.values())]
    head = "| variant | loss | vs fp32 | " + " | ".join(groups) + " |"
    lines = [head, "|" + "---|" * (3 + len(groups))]
    for v, r in res.items():
        cells = [f"{r[g]:.3f}" if g in r else "" for g in groups]
        d = f"{r['dloss_pct']:+.3f} %" if "dloss_pct" in r else ""
        lines.append(f"| {v} | {r['loss']:.4f} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mxmoe bench fidelity",
        description="Gradient and loss error of MX variants vs fp32 at bf16-trained weights "
        "(relative gradient error per parameter group; see the module docstring).",
    )
    p.add_argument(
        "--config",
        default="debug_moe",
        help="the trainer config whose model, data and optimizer are measured: a name (mxmoe config list) "
        "or a TOML file (default debug_moe)",
    )
    p.add_argument("--steps", type=int, default=150, help="bf16 training steps before measuring (>= 0)")
    p.add_argument("--batches", type=positive_int, default=4, help="batches the errors are measured on")
    p.add_argument(
        "--variants", type=comma_list(choices=VARIANTS, renamed=RENAMED_VARIANTS), default=list(VARIANTS),
        help=f"comma-separated, of: {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device to train and measure on (default: cuda if available, else cpu)",
    )
    p.add_argument("--json", help="also write the result to this JSON file")
    p.epilog = "Other --section.key=value options override the config, as for `mxmoe train`."
    return p


def _device(p: argparse.ArgumentParser, text: str) -> torch.device:
    """The device --device names; p.error naming it unless it is cpu or a CUDA device present here."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        p.error(f"--device={text!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device={text!r}: no CUDA GPU is available here; pass --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        p.error(f"--device={text!r}: {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def main(argv: list[str]) -> int:
    p = build_parser()
    a, overrides = p.parse_known_args(argv)
    if a.steps < 0:
        p.error(f"--steps={a.steps}: expected an integer >= 0")
    from mxmoe.bench.timing import check_json

    check_json(p, a.json)
    from mxmoe.train.build import check_bench_values, check_cast_kernels
    from mxmoe.train.config import ConfigError, parse_args

    device = _device(p, a.device)
    try:
        cfg = parse_args(["--config", a.config, *overrides], prog="mxmoe bench fidelity")
        check_bench_values(cfg)
        if any(v.startswith("mx") for v in a.variants):
            check_cast_kernels(cfg, device)
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    res = measure(cfg, a.steps, a.batches, a.variants, device)
    print(format_table(res))
    if a.json:  # the results with what they were measured on: the model, its training, the machine
        from mxmoe.bench.timing import environment

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"bench": "fidelity", "config": cfg.to_dict(), "steps": a.steps, "batches": a.batches,
                   "device": str(device), "environment": environment(), "results": res}
        with open(a.json, "w") as f:
            json.dump(payload, f, indent=1, default=str)
    return 0
