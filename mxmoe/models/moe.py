"""A decoder-only transformer with mixture-of-experts FFNs (or dense FFNs), readable in one sitting.

Tokens (B, S) int64 -> logits (B, S, vocab) in the compute dtype. Blocks are pre-norm:
`h = h + attention(norm(h)); h = h + ffn(norm(h))` where ffn is a SwiGLU MLP (dense) or `MoE`.

The MoE layer routes each token to `top_k` of `num_experts` SwiGLU experts held in one
`mxmoe.nn.experts.GroupedExperts` (the grouped GEMM), plus optional always-on shared experts.
Load balancing (`load_balance`):
  - "aux_loss": the Switch/GShard auxiliary loss `E * sum_e f_e * P_e` (f_e: fraction of the k*T
    assignments that went to expert e, P_e: mean router probability of e); 1.0 when balanced.
    The model returns it (summed over layers); the trainer adds `aux_loss_coef` times it.
  - "bias": auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias, added to the scores
    only to *choose* experts, is nudged by `bias_update_rate * sign(mean_load - load_e)` after each
    optimizer step (`Transformer.update_router_bias`); the gate weights are the unbiased scores.
  - "none".
Expert parallelism is applied from outside (`mxmoe.models.apply_expert_parallel(model, group)`):
it installs a token dispatcher in each MoE layer (`MoE.dispatch`, the seam of
`mxmoe.token_dispatch`), after which the experts module holds only this rank's `num_experts // ep`
experts and tokens travel to them by all-to-all (mxmoe.models.expert_parallel). The MoE layer
itself does not know how it is parallelized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mxmoe.models.routing import LocalExperts, expert_counts, routed_experts
from mxmoe.nn.experts import GroupedExperts
from mxmoe.nn.linear import project

LOAD_BALANCE = ("aux_loss", "bias", "none")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class ModelArgs:
    """Architecture of a `Transformer`. num_experts == 0 builds the dense variant."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    max_seq_len: int = 256
    ffn_hidden_dim: int = 192
    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 64
    num_shared_experts: int = 1
    score_func: str = "softmax"
    load_balance: str = "aux_loss"
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelArgs.{name}={v!r}: expected a positive int")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"ModelArgs.dim={self.dim} must be divisible by n_heads={self.n_heads} into an even head dim"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"ModelArgs.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.num_experts < 0:
            raise ValueError(f"ModelArgs.num_experts={self.num_experts}: expected >= 0 (0 = dense)")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"ModelArgs.top_k={self.top_k}: expected 1..num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"ModelArgs.score_func={self.score_func!r}: expected one of {SCORE_FUNCS}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"ModelArgs.load_balance={self.load_balance!r}: expected one of {LOAD_BALANCE}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_kv_heads, or n_heads when None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def num_params(self) -> tuple[int, int]:
        """(total, active per token) parameter counts, embeddings and output head included."""
        d, L = self.dim, self.n_layers
        hd = d // self.n_heads
        attn = d * hd * (self.n_heads * 2 + self.kv_heads * 2) + 2 * d
        if self.is_moe:
            expert = 3 * d * self.moe_hidden_dim
            ffn_total = self.num_experts * expert + self.num_shared_experts * expert + d * self.num_experts
            ffn_active = (self.top_k + self.num_shared_experts) * expert + d * self.num_experts
        else:
            ffn_total = ffn_active = 3 * d * self.ffn_hidden_dim
        emb = 2 * self.vocab_size * d + d
        return emb + L * (attn + ffn_total), emb + L * (attn + ffn_active)


# Named sizes. Hidden dims are multiples of 32 so that every GEMM dim is an MX block multiple.
PRESETS: dict[str, ModelArgs] = {
    # CPU-sized: trains in a couple of minutes on 2 cores.
    "debug_moe": ModelArgs(dim=64, n_layers=2, n_heads=4, num_experts=8, top_k=2, moe_hidden_dim=64),
    "debug_dense": ModelArgs(dim=64, n_layers=2, n_heads=4, num_experts=0, ffn_hidden_dim=192),
    # ~0.12B total, ~46M active.
    "moe_small": ModelArgs(dim=512, n_layers=8, n_heads=8, num_experts=8, top_k=2, moe_hidden_dim=1024),
    # ~0.68B total, ~0.15B active: one H200.
    "moe_1b": ModelArgs(
        dim=1024, n_layers=12, n_heads=16, n_kv_heads=8, num_experts=16, top_k=2, moe_hidden_dim=1024
    ),
    # ~1.9B total, ~0.7B active, expert GEMMs 2048 -> 4096 -> 2048: one H200.
    "moe_2b": ModelArgs(
        dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, num_experts=8, top_k=2, moe_hidden_dim=4096
    ),
    "dense_1b": ModelArgs(dim=2048, n_layers=16, n_heads=16, num_experts=0, ffn_hidden_dim=5632),
}


def model_args(name: str, **overrides) -> ModelArgs:
    """The preset `name` with fields replaced by the non-None `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"model name={name!r} is not a preset; expected one of {sorted(PRESETS)}")
    valid = {f.name for f in fields(ModelArgs)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise ValueError(f"unknown ModelArgs field(s) {bad}; expected some of {sorted(valid)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


class RMSNorm(nn.Module):
    """x (..., dim) -> x / rms(x) * weight, computed in fp32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def rope_cache(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin (max_seq_len, head_dim // 2) fp32 for rotary embeddings."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, S, hd): rotate interleaved pairs (x[2i], x[2i+1]) by position; cos/sin (S, hd/2)."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head (grouped-query) attention with rotary positions, via SDPA."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q, k, v = project(x, self.wq, self.wk, self.wv)  # MX layers: one cast of x for the three
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: x (..., dim) -> w2(silu(w1 x) * w3 x) (..., dim)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        g, u = project(x, self.w1, self.w3)  # MX layers: one cast of x for the two
        return self.w2(F.silu(g) * u)


class Router(nn.Module):
    """Top-k token-choice router.

    forward(x (T, dim)) -> (expert_idx (T, k) int64, weights (T, k) fp32, aux_loss () fp32).
    weights are the chosen experts' scores (renormalized to sum 1 over the k choices for softmax
    scores with k > 1). With load_balance="bias" the buffer `expert_bias` shifts the choice only,
    and `tokens_per_expert` counts assignments since the last `update_bias`.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.load_balance = args.score_func, args.load_balance
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.gate(x).float()  # (T, E)
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.load_balance == "bias" else scores
        idx = choose.topk(self.top_k, dim=-1).indices  # (T, k)
        w = scores.gather(-1, idx)
        if (self.top_k > 1 and self.score_func == "softmax") or self.score_func == "sigmoid":
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        counts = expert_counts(idx, self.num_experts).float()  # no host sync (bincount syncs on CUDA)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        if self.load_balance == "aux_loss":
            probs = scores / scores.sum(-1, keepdim=True) if self.score_func == "sigmoid" else scores
            frac = counts / idx.numel()  # f_e, no gradient
            aux = self.num_experts * (frac * probs.mean(0)).sum()
        else:
            aux = logits.new_zeros(())
        return idx, w, aux

    @torch.no_grad()
    def update_bias(self, rate: float, group=None) -> None:
        """Nudge `expert_bias` towards balance from the counts since the last call (summed over
        `group` if given), then reset the counts."""
        counts = self.tokens_per_expert
        if self.load_balance != "bias":
            counts.zero_()
            return
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)
        if counts.sum() > 0:
            self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))
        counts.zero_()


class MoE(nn.Module):
    """Routed SwiGLU experts (+ shared experts). forward(x (B, S, dim)) -> (out (B, S, dim), aux ())."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.router = Router(args)
        self.experts = GroupedExperts(args.dim, args.moe_hidden_dim, args.num_experts)
        self.shared_expert = (
            FeedForward(args.dim, args.moe_hidden_dim * args.num_shared_experts)
            if args.num_shared_experts
            else None
        )
        self.dispatch = LocalExperts()
        """The token dispatcher (`mxmoe.token_dispatch.TokenDispatcher`): `LocalExperts` (all here)
        or an `ExpertParallel` installed by `apply_expert_parallel`."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, S, D = x.shape
        xt = x.reshape(B * S, D)
        idx, w, aux = self.router(xt)
        out = routed_experts(xt, idx, w, self.experts, self.num_experts, self.dispatch)
        if self.shared_expert is not None:
            out = out + self.shared_expert(xt)
        return out.view(B, S, D), aux


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.moe = MoE(args) if args.is_moe else None
        self.feed_forward = None if args.is_moe else FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        h = h + self.attention(self.attention_norm(h), cos, sin)
        if self.moe is not None:
            f, aux = self.moe(self.ffn_norm(h))
        else:
            f, aux = self.feed_forward(self.ffn_norm(h)), h.new_zeros((), dtype=torch.float32)
        return h + f, aux


class Transformer(nn.Module):
    """forward(tokens (B, S) int64) -> (logits (B, S, vocab), aux_loss () fp32 summed over layers)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cache(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.args.init_std
        out_std = std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.trunc_normal_(m.weight, std=out_std if last in ("wo", "w2") else std)
            elif isinstance(m, GroupedExperts):
                for wn in ("w1", "w3"):
                    nn.init.trunc_normal_(getattr(m, wn), std=std)
                nn.init.trunc_normal_(m.w2, std=out_std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
        nn.init.trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        ok = isinstance(tokens, Tensor) and tokens.ndim == 2 and tokens.dtype in (torch.int64, torch.int32)
        if not ok:
            got = type(tokens).__name__
            if isinstance(tokens, Tensor):
                got = f"{tuple(tokens.shape)} {tokens.dtype}"
            raise ValueError(f"tokens: expected a (batch, seq) int64 tensor of token ids, got {got}")
        S = tokens.shape[1]
        if S > self.args.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len={self.args.max_seq_len}")
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        h = self.tok_embeddings(tokens)
        aux = h.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            h, a = layer(h, cos, sin)
            aux = aux + a
        return self.output(self.norm(h)), aux

    def moe_layers(self) -> list[MoE]:
        return [blk.moe for blk in self.layers if blk.moe is not None]

    def update_router_bias(self, group=None) -> None:
        """After an optimizer step: bias-based balancing update of every router (no-op otherwise)."""
        for moe in self.moe_layers():
            moe.router.update_bias(self.args.bias_update_rate, group)

    def router_bias_finite(self) -> bool:
        """Whether every router's `expert_bias` is finite (true without bias balancing): the bias
        moves outside the optimizer, past the loss and gradient checks."""
        if self.args.load_balance != "bias" or not self.moe_layers():
            return True
        return bool(torch.isfinite(torch.cat([m.router.expert_bias for m in self.moe_layers()])).all())
