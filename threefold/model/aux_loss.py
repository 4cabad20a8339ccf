"""Losses that train the model beside the language-model loss without being added to it:
MoE's auxiliary losses, multi-token prediction's, DeepSeek sparse attention's indexer loss.

Like megatron-core's MoEAuxLossAutoScaler (and its MTP and DSA twins), `attach_losses` hangs
them on an activation the layer returns: its backward gives each loss the gradient `scale`,
the factor the schedule applies to the language-model loss (1 / micro-batches, times the fp16
loss scale, times CP), set by the trainer each step. That reaches every pipeline stage, which
the last stage's loss could not.
"""

from __future__ import annotations

import torch


class _AttachLosses(torch.autograd.Function):
    """Identity on `tensor`; in backward, each loss receives the gradient `scale`."""

    @staticmethod
    def forward(ctx, tensor, scale: float, *losses):
        ctx.scale = scale
        ctx.like = [(loss.dtype, loss.device) for loss in losses]
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        scales = [torch.full((), ctx.scale, dtype=d, device=v) for d, v in ctx.like]
        return grad, None, *scales


def attach_losses(tensor: torch.Tensor, scale: float, *losses: torch.Tensor) -> torch.Tensor:
    """`tensor`, unchanged, carrying `losses` (scalars) into backward with gradient `scale`."""
    return _AttachLosses.apply(tensor, scale, *losses)
