"""Cross-entropy over vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds logits for its slice of the (padded) vocabulary. The loss needs three sums
over the whole vocabulary, each one all-reduce of a [sequence, batch] tensor: the maximum (for
stability), the target's logit (only its owner contributes), and the sum of exponentials.
Columns past the real vocabulary are padding: they are masked to -inf so they never change the
loss or receive gradient, whatever the padding (Megatron-LM once shipped without this).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from threefold.parallel.parallel_context import ONE_DEVICE, Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: Group):
        input_dtype = logits.dtype
        partition = logits.shape[-1]
        vocab_start = tp.rank * partition
        logits = logits.float()
        padding_start = vocab_size - vocab_start
        if padding_start < partition:
            logits = logits.clone()
            logits[..., max(padding_start, 0) :] = float("-inf")

        logits_max = logits.max(dim=-1).values
        tp.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + partition)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        tp.all_reduce(target_logit)

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        tp.all_reduce(sum_exp)
        loss = sum_exp.log() - target_logit

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.input_dtype = input_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        owned = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int, tp: Group = ONE_DEVICE
) -> torch.Tensor:
    """Per-token loss [sequence, batch] from logits [sequence, batch, padded_vocab / TP] (fp32),
    the vocabulary split over the ranks of `tp`."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, tp)
