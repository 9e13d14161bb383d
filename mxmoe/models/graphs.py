"""`GraphedStep`: a training step's forward and backward captured once in a CUDA graph, then replayed.

A replay launches the whole step's kernels with one call, so the host's per-op cost (Python,
dispatch, kernel launches: what makes small MX casts slow) is paid once, at capture. It needs a
step with static shapes and no host synchronization: the MoE model at EP=1 qualifies (routing
keeps the row count at tokens x top_k; counts are scatter-adds; the MX grouped GEMM pads groups to
a static size). Expert parallelism (its splits come to the host) and FSDP (its collectives and
hooks) do not.

The optimizer step stays outside the graph (eager, or compiled separately): parameters keep their
addresses, so the graph reads the updated weights on the next replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn


def _first(out) -> Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class GraphedStep:
    """`step_fn(*batch)`'s forward and the backward of its (first) output, as one CUDA graph.

    step_fn: (*batch) -> loss (0-dim tensor) or a tuple whose first element is the loss to
        backpropagate (the others, e.g. metrics, are returned too). Static shapes, no host syncs.
    params: the parameters whose gradients the step produces (e.g. model.parameters()).
    example_batch: CUDA tensors of the shapes and dtypes every later batch has; they are copied into
        static input buffers.
    warmup: eager runs (forward + backward) on a side stream before capture, as torch.cuda.graph
        requires (lazy initialization, autotuning, compiled graphs). They do touch buffers (e.g. the
        router's load counters) but not parameters.

    `step(*batch)` copies the batch into the static inputs, replays, points every parameter's
    `.grad` at the graph's gradient buffer (written, not accumulated, so `zero_grad` may set grads
    to None between steps) and returns step_fn's outputs, which live in the graph's memory pool and
    are overwritten by the next replay: read them before the next call. Autocast inside step_fn
    must run with cache_enabled=False.
    """

    def __init__(
        self,
        step_fn: Callable[..., Tensor | Sequence[Tensor]],
        params: Iterable[nn.Parameter],
        example_batch: Sequence[Tensor],
        warmup: int = 3,
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep captures a CUDA graph and needs a CUDA GPU")
        if not all(isinstance(b, Tensor) and b.is_cuda for b in example_batch):
            raise ValueError(
                "GraphedStep: example_batch must be CUDA tensors, got "
                f"{[(type(b).__name__, getattr(b, 'device', None)) for b in example_batch]}"
            )
        if warmup < 1:
            raise ValueError(f"GraphedStep: warmup={warmup}; expected >= 1 (capture needs a warm run)")
        self.params = [p for p in params if p.requires_grad]
        self.static = [b.clone() for b in example_batch]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                _first(step_fn(*self.static)).backward()
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:
            p.grad = None  # the captured backward allocates the gradients in the graph's pool
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = step_fn(*self.static)
            _first(self.out).backward()
        self.grads = [(p, p.grad) for p in self.params if p.grad is not None]

    def __call__(self, *batch: Tensor):
        if len(batch) != len(self.static):
            raise ValueError(f"GraphedStep: got {len(batch)} batch tensors, captured with {len(self.static)}")
        for dst, src in zip(self.static, batch, strict=True):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(
                    f"GraphedStep: batch tensor {tuple(src.shape)} {src.dtype} differs from the captured "
                    f"{tuple(dst.shape)} {dst.dtype}; a CUDA graph replays static shapes"
                )
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        for p, g in self.grads:
            p.grad = g
        return self.out
