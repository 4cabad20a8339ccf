"""Data-parallel gradients: a contiguous fp32 gradient buffer and its reduction.

As in Megatron's DistributedDataParallel, every parameter's gradient accumulates into
`param.main_grad`, a view into one flat fp32 buffer, over all micro-batches of a global batch.
`finalize_model_grads` then makes the gradients complete and equal everywhere, once per step:
1. the buffer is averaged over the data-parallel group (PyTorch DDP semantics: the mean of the
   replicas' gradients), in buckets so no single message is huge, and with
   --overlap-grad-reduce each bucket as soon as backward has finished it; under the
   distributed optimizer it is reduce-scattered instead, each DP rank keeping its shard;
2. sequence-parallel replicated parameters (norms, row-parallel biases) saw only their rank's
   slice of the sequence: their gradients are summed over the TP group;
3. tied embeddings split over the first and last pipeline stage: summed over both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from threefold.parallel import state


class GradientBuffer:
    """`flat_parameters=True` also moves the parameters into one flat buffer of the same layout
    (the distributed optimizer all-gathers it), and `pad_to_multiple` pads both so they split
    into equal data-parallel shards.

    Buckets are runs of whole parameters of at least `bucket_size` elements (Megatron's
    --ddp-bucket-size). With `overlap_grad_reduce`, a parameter's gradient is final once its
    hook has fired for every micro-batch of the step; when all of a bucket's gradients are
    final its all-reduce is launched asynchronously, overlapping the rest of the backward pass.
    """

    def __init__(self, params: list[nn.Parameter], bucket_size: int = 40_000_000,
                 pad_to_multiple: int = 1, flat_parameters: bool = False,
                 overlap_grad_reduce: bool = False) -> None:
        self.params = [p for p in params if p.requires_grad]
        device = self.params[0].device
        numel = sum(p.numel() for p in self.params)
        numel = -(-numel // pad_to_multiple) * pad_to_multiple
        self.buffer = torch.zeros(numel, dtype=torch.float32, device=device)
        self.param_buffer = (torch.zeros(numel, dtype=self.params[0].dtype, device=device)
                             if flat_parameters else None)
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[tuple[int, int]] = []  # [start, end) of each bucket in the buffer
        self._bucket_of: dict[nn.Parameter, int] = {}
        offset = bucket_start = 0
        # Reverse order, as Megatron lays the buffer out: backward produces the last layers'
        # gradients first, so their buckets complete first.
        for param in reversed(self.params):
            end = offset + param.numel()
            self.ranges[param] = (offset, end)
            self._bucket_of[param] = len(self.buckets)
            param.main_grad = self.buffer[offset:end].view_as(param)
            if self.param_buffer is not None:
                self.param_buffer[offset:end].copy_(param.data.view(-1))
                param.data = self.param_buffer[offset:end].view_as(param)
            offset = end
            if end - bucket_start >= bucket_size:
                self.buckets.append((bucket_start, end))
                bucket_start = end
            param.register_post_accumulate_grad_hook(self._accumulate)
        if bucket_start < numel or not self.buckets:
            self.buckets.append((bucket_start, numel))  # the last bucket holds the padding
        self.overlap_grad_reduce = overlap_grad_reduce
        self.start_step(num_microbatches=1)

    def start_step(self, num_microbatches: int) -> None:
        """Zero the gradients and arm the per-bucket countdown for a step."""
        self.buffer.zero_()
        self._expected_calls = num_microbatches
        self._calls = dict.fromkeys(self.params, 0)
        self._pending = [0] * len(self.buckets)
        for param in self.params:
            self._pending[self._bucket_of[param]] += 1
        self._handles: dict[int, object] = {}

    def _accumulate(self, param: torch.Tensor) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.overlap_grad_reduce:
            return
        self._calls[param] += 1
        if self._calls[param] == self._expected_calls:
            bucket = self._bucket_of[param]
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0:
                self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        world = state.data_parallel_world_size()
        if world == 1 or bucket in self._handles:
            return
        start, end = self.buckets[bucket]
        self.buffer[start:end].div_(world)
        self._handles[bucket] = dist.all_reduce(
            self.buffer[start:end], group=state.data_parallel_group(), async_op=True)

    def all_reduce_data_parallel(self) -> None:
        """Mean over DP replicas: wait for the buckets launched during backward (overlap), and
        reduce the others now."""
        for bucket in range(len(self.buckets)):
            self._launch(bucket)
        for handle in self._handles.values():
            handle.wait()
        self._handles = {}

    def shard_range(self) -> tuple[int, int]:
        """This DP rank's slice of the buffers under the distributed optimizer."""
        size = self.buffer.numel() // state.data_parallel_world_size()
        start = state.data_parallel_rank() * size
        return start, start + size

    def reduce_scatter_data_parallel(self) -> None:
        """Mean gradients, but only this rank's shard of them is complete afterwards."""
        world = state.data_parallel_world_size()
        if world == 1:
            return
        self.buffer.div_(world)
        start, end = self.shard_range()
        shard = torch.empty(end - start, dtype=self.buffer.dtype, device=self.buffer.device)
        dist.reduce_scatter_tensor(shard, self.buffer, group=state.data_parallel_group())
        self.buffer[start:end].copy_(shard)

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """Every DP rank updated its shard of the parameters: share them."""
        if state.data_parallel_world_size() == 1:
            return
        start, end = self.shard_range()
        local = self.param_buffer[start:end].clone()
        dist.all_gather_into_tensor(self.param_buffer, local, group=state.data_parallel_group())


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


def finalize_model_grads(grad_buffer: GradientBuffer, reduce_scatter: bool = False) -> None:
    # The DP reduction comes first: with --overlap-grad-reduce it is already in flight on the
    # buffer, and the TP and embedding sums below commute with the DP mean.
    if reduce_scatter:  # the distributed optimizer needs only its shard
        grad_buffer.reduce_scatter_data_parallel()
    else:
        grad_buffer.all_reduce_data_parallel()
    all_reduce_sequence_parallel_grads(grad_buffer.params)
    all_reduce_embedding_grads(grad_buffer.params)
