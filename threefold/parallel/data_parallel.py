"""Data-parallel gradients: a contiguous fp32 gradient buffer and its reduction.

As in Megatron's DistributedDataParallel, every parameter's gradient accumulates into
`param.main_grad`, a view into one flat fp32 buffer, over all micro-batches of a global batch.
`finalize_model_grads` then makes the gradients complete and equal everywhere, once per step:
1. sequence-parallel replicated parameters (norms, row-parallel biases) saw only their rank's
   slice of the sequence: their gradients are summed over the TP group;
2. the buffer is averaged over the data-parallel group (PyTorch DDP semantics: the mean of the
   replicas' gradients), in buckets so no single message is huge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.parallel import state


class GradientBuffer:
    def __init__(self, params: list[nn.Parameter], bucket_size: int = 40_000_000) -> None:
        self.params = [p for p in params if p.requires_grad]
        device = self.params[0].device
        numel = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(numel, dtype=torch.float32, device=device)
        self.bucket_size = bucket_size
        offset = 0
        # Reverse order, as Megatron lays the buffer out: backward produces the last layers'
        # gradients first, so their buckets complete first.
        for param in reversed(self.params):
            param.main_grad = self.buffer[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
            param.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None

    def zero(self) -> None:
        self.buffer.zero_()

    def all_reduce_data_parallel(self) -> None:
        world = state.data_parallel_world_size()
        if world == 1:
            return
        self.buffer.div_(world)
        group = state.data_parallel_group()
        for start in range(0, self.buffer.numel(), self.bucket_size):
            dist.all_reduce(self.buffer[start:start + self.bucket_size], group=group)


def all_reduce_sequence_parallel_grads(params: list[nn.Parameter]) -> None:
    grads = [p.main_grad for p in params if getattr(p, "sequence_parallel", False)]
    if not grads or state.tensor_model_parallel_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=state.tensor_model_parallel_group())
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def all_reduce_embedding_grads(params: list[nn.Parameter]) -> None:
    """Tied embeddings under pipeline parallelism: the first stage's word embeddings and the
    last stage's output layer are two copies of one weight. Summing their gradients over
    megatron-core's embedding group (first and last stage) keeps the copies identical."""
    if state.pipeline_model_parallel_world_size() == 1:
        return
    for param in params:
        if getattr(param, "shared_embedding", False):
            dist.all_reduce(param.main_grad, group=state.embedding_group())


def finalize_model_grads(grad_buffer: GradientBuffer) -> None:
    all_reduce_sequence_parallel_grads(grad_buffer.params)
    all_reduce_embedding_grads(grad_buffer.params)
    grad_buffer.all_reduce_data_parallel()
