"""--delay-wgrad-compute (with --overlap-moe-expert-parallel-comm): in the backward pass of a
combined 1F1B step, a linear layer's weight-gradient GEMM waits until the pass starts its next
all-to-all, and runs while that exchange travels, instead of before it starts. The exchange
leaves one GEMM sooner per layer it follows: the experts' weight gradients no longer hold up
the dispatch's gradient exchange, nor the attention's the next layer's combine.

A layer marked `delay_wgrad_compute` (set at build from the flag) computes its input gradient
in its backward as always, and its weight gradient through `when_due`: at once, or, while a
combined step's backward collects (`collecting`), at the next flush. `flush` runs what was
deferred and gives the gradients to autograd through the weights' own accumulators
(`torch.autograd.backward` on the parameters), so the gradient buffer's hooks see each as they
see any other, gradient-accumulation fusion's placeholders included. The combined step flushes
at every exchange of its backward pass, after starting it, and when the pass ends. Outside a
combined step (the last micro-batch's backward, alone) nothing is deferred.

Megatron-LM delays the weight gradients of Transformer Engine's layers and calls each node's
`backward_dw` at fixed points of its schedule; here the points are the exchanges themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

_pending: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] | None = None


def collecting() -> bool:
    """Whether a combined step's backward pass is collecting weight gradients now."""
    return _pending is not None


def when_due(weight: torch.Tensor, gradient: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """A layer backward's answer for `weight`: `gradient()` (the weight's gradient, or
    gradient-accumulation fusion's placeholder once it has added into main_grad) computed now,
    or, while a combined step's backward collects, None, with `gradient()` computed at the next
    `flush` and reaching the weight through its own accumulator."""
    if _pending is None:
        return gradient()
    _pending.append((weight, gradient))
    return None


def flush() -> None:
    """The deferred weight gradients computed and accumulated, in the order deferred."""
    if not _pending:
        return
    deferred = list(_pending)
    _pending.clear()
    weights = [weight for weight, _ in deferred]
    with torch.no_grad():  # (at the end of a pass, outside autograd's engine)
        gradients = [gradient() for _, gradient in deferred]
    torch.autograd.backward(weights, gradients)


@contextlib.contextmanager
def collected() -> Iterator[None]:
    """A backward pass whose weight gradients are deferred until `flush`, and flushed at its
    end."""
    global _pending
    _pending = []
    try:
        yield
        flush()
    finally:
        _pending = None


class DelayableLinear(torch.autograd.Function):
    """`F.linear` whose weight gradient is deferred while a combined step's backward collects
    (a layer's GEMM where no other path, FP8 or accumulation fusion, holds it)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        # The parameter itself: a saved tensor can come back as another object (offloading).
        ctx.weight, ctx.has_bias = weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grads = grad_output.reshape(-1, grad_output.shape[-1])
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad
        grad_x = (grads @ weight).view(x.shape) if needs_x else None
        grad_bias = grads.sum(dim=0) if needs_bias and ctx.has_bias else None
        grad_weight = None
        if needs_weight:
            grad_weight = when_due(weight, lambda: grads.t() @ x.reshape(-1, x.shape[-1]))
        return grad_x, grad_weight, grad_bias
