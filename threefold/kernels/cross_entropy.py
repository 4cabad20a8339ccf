"""Fused vocabulary-parallel cross-entropy: the loss and its gradient in chunks of tokens.

The reference (`threefold.parallel.tensor_parallel.cross_entropy`) casts the whole [tokens,
vocab / TP] logits to fp32 and keeps the fp32 softmax for backward: with bf16 logits that is
three times the logits' memory at the peak. Here each chunk of tokens is cast, reduced and
turned into its gradient (softmax - one_hot) on its own, and the gradient is kept in the logits'
dtype: no fp32 tensor larger than a chunk exists. Backward only scales it by the incoming
gradient.

At TP=1 one pass per chunk does everything, with the reference's operations in the
reference's order (the results are bitwise equal in fp32). Under tensor parallelism the ranks
first agree on each token's max and then on its sum of exponentials (two all-reduces, the
second also carrying the target logits), and the gradient pass follows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from threefold.parallel.parallel_context import ONE_DEVICE, Group


def softmax_gradient(
    part: torch.Tensor,
    row_max: torch.Tensor,
    local_target: torch.Tensor,
    owned: torch.Tensor,
    out: torch.Tensor,
    sum_exp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write softmax(part) - one_hot(target) into `out` (the logits' dtype), computing in fp32;
    returns the sums of exp(part - row_max) it divided by (computed here when not given)."""
    work = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
    torch.sub(part, row_max.unsqueeze(-1), out=work)
    work.exp_()
    if sum_exp is None:
        sum_exp = work.sum(dim=-1)
    work.div_(sum_exp.unsqueeze(-1))
    work.scatter_add_(-1, local_target.unsqueeze(-1), -owned.unsqueeze(-1))
    if work is not out:
        out.copy_(work)
    return sum_exp


def sum_of_exponentials(part: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    return (part.float() - row_max.unsqueeze(-1)).exp().sum(dim=-1)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_size: int,
        chunk: int,
        gradient: Callable,
        sums: Callable,
        tp: Group,
    ):
        partition = logits.shape[-1]
        vocab_start = tp.rank * partition
        valid = min(max(vocab_size - vocab_start, 0), partition)  # columns before the padding
        flat = logits.reshape(-1, partition)
        tokens = flat.shape[0]
        target = target.reshape(-1)
        outside = (target < vocab_start) | (target >= vocab_start + valid)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        owned = (~outside).float()
        chunks = [slice(start, start + chunk) for start in range(0, tokens, chunk)]
        real = flat[:, :valid]
        grad = torch.empty_like(flat)
        grad[:, valid:] = 0  # padding columns: no loss, no gradient

        row_max = torch.full((tokens,), float("-inf"), device=flat.device)
        sum_exp = torch.zeros(tokens, device=flat.device)
        tensor_parallel = tp.size > 1
        for rows in chunks if valid else ():
            row_max[rows] = real[rows].max(dim=-1).values
            if not tensor_parallel:
                sum_exp[rows] = gradient(
                    real[rows], row_max[rows], local_target[rows], owned[rows], grad[rows, :valid]
                )
        target_logit = flat.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float()
        if tensor_parallel:
            tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
            for rows in chunks if valid else ():
                sum_exp[rows] = sums(real[rows], row_max[rows])
        target_logit = (target_logit - row_max).masked_fill(outside, 0.0)
        if tensor_parallel:
            reduced = torch.stack((sum_exp, target_logit))
            tp.all_reduce(reduced)  # one all-reduce for both sums
            sum_exp, target_logit = reduced
            for rows in chunks if valid else ():
                gradient(
                    real[rows],
                    row_max[rows],
                    local_target[rows],
                    owned[rows],
                    grad[rows, :valid],
                    sum_exp[rows],
                )
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(grad)
        ctx.logits_shape = logits.shape
        return loss.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        grad.mul_(grad_loss.reshape(-1, 1).to(grad.dtype))  # in place: backward runs once
        return grad.view(ctx.logits_shape), None, None, None, None, None, None


def fused_vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp: Group = ONE_DEVICE,
    chunk_tokens: int = 4096,
    gradient: Callable = softmax_gradient,
    sums: Callable = sum_of_exponentials,
) -> torch.Tensor:
    """Per-token loss [sequence, batch] (fp32) from vocabulary-parallel logits [sequence, batch,
    padded_vocab / TP] of any dtype. `gradient` and `sums` are the per-chunk kernels above, or
    their torch.compile'd versions."""
    return _FusedVocabParallelCrossEntropy.apply(
        logits, target, vocab_size, chunk_tokens, gradient, sums, tp
    )
