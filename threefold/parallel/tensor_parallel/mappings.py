"""Tensor- and sequence-parallel communication as autograd functions.

Each region boundary of Megatron's tensor parallelism is one function whose backward is the
dual of its forward, written next to it:

    copy_to_tensor_parallel_region          fwd: identity          bwd: all-reduce
    reduce_from_tensor_parallel_region      fwd: all-reduce        bwd: identity
    scatter_to_tensor_parallel_region       fwd: split last dim    bwd: all-gather last dim
    gather_from_tensor_parallel_region      fwd: all-gather last   bwd: split last dim
    scatter_to_sequence_parallel_region     fwd: split first dim   bwd: all-gather first dim
    gather_from_sequence_parallel_region    fwd: all-gather first  bwd: reduce-scatter first
    reduce_scatter_to_sequence_parallel_region  fwd: reduce-scatter first  bwd: all-gather first

Every function takes the tensor-parallel `Group` it communicates over (threefold/parallel/
context.py). Activations are laid out [sequence, batch, hidden], so "first dim" is the sequence.
Every collective goes through `_all_reduce`, `_all_gather` or `_reduce_scatter`, which count
calls and bytes in `COLLECTIVE_COUNTS` so tests can check Megatron's communication accounting.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from threefold.parallel.collectives import all_gather_single, reduce_scatter_single
from threefold.parallel.parallel_context import Group

# (operation name) -> number of calls, and (operation name + ":bytes") -> bytes communicated
# per rank (the size of the full, unsharded tensor).
COLLECTIVE_COUNTS: Counter = Counter()


def record_collective(op: str, full_tensor_numel: int, element_size: int) -> None:
    COLLECTIVE_COUNTS[op] += 1
    COLLECTIVE_COUNTS[op + ":bytes"] += full_tensor_numel * element_size


def _all_reduce(tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    record_collective("all_reduce", tensor.numel(), tensor.element_size())
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, group=tp.group)
    return tensor


def _all_gather(tensor: torch.Tensor, dim: int, tp: Group) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    # all_gather_into_tensor concatenates along dim 0; move `dim` there and back.
    moved = tensor.movedim(dim, 0).contiguous()
    output = torch.empty(
        (tp.size * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    record_collective("all_gather", output.numel(), output.element_size())
    all_gather_single(output, moved, group=tp.group)
    return output.movedim(0, dim).contiguous()


def _reduce_scatter(tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    """Sum over TP ranks and keep this rank's slice of the first dimension."""
    if tp.size == 1:
        return tensor
    tensor = tensor.contiguous()
    output = torch.empty(
        (tensor.shape[0] // tp.size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    record_collective("reduce_scatter", tensor.numel(), tensor.element_size())
    reduce_scatter_single(output, tensor, group=tp.group)
    return output


def all_gather_along_first_dim(tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    """Every TP rank's `tensor` concatenated along the first dimension (no autograd: for
    functions that write their own backward, as FP8's sequence-parallel gather)."""
    return _all_gather(tensor, 0, tp)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, tp: Group) -> torch.Tensor:
    """`tensor` summed over the TP ranks, this rank's slice of the first dimension kept (no
    autograd)."""
    return _reduce_scatter(tensor, tp)


def _split(tensor: torch.Tensor, dim: int, tp: Group) -> torch.Tensor:
    if tp.size == 1:
        return tensor
    size = tensor.shape[dim]
    if size % tp.size:
        raise ValueError(f"dimension {dim} of size {size} does not split over {tp.size} TP ranks")
    return tensor.chunk(tp.size, dim=dim)[tp.rank].contiguous()


# Each region: forward(ctx, input_, tp) and backward(ctx, grad) -> (grad of input_, None).
class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.tp), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        return _all_reduce(input_.clone(), tp)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return _split(input_, -1, tp)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather(grad_output, -1, ctx.tp), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return _all_gather(input_, -1, tp)

    @staticmethod
    def backward(ctx, grad_output):
        return _split(grad_output, -1, ctx.tp), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return _split(input_, 0, tp)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather(grad_output, 0, ctx.tp), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return _all_gather(input_, 0, tp)

    @staticmethod
    def backward(ctx, grad_output):
        # The gathered activation fed a tensor-parallel matmul on every rank: each rank holds a
        # partial gradient of the full sequence, so sum them and keep this rank's slice.
        return _reduce_scatter(grad_output, ctx.tp), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_, tp):
        ctx.tp = tp
        return _reduce_scatter(input_, tp)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_gather(grad_output, 0, ctx.tp), None


def _apply(region: type[torch.autograd.Function], x: torch.Tensor, tp: Group) -> torch.Tensor:
    """Without tensor parallelism every region boundary is the identity: skip the autograd node,
    which would cost a Python call in forward and in backward (and the reduction its copy)."""
    if tp.size == 1:
        return x
    return _communicate(region, x, tp)


# Inside a layer compiled whole (--compile-layers) each collective runs eager between compiled
# graphs: traced into a graph, the gloo/NCCL calls of these autograd functions would hang.
@torch.compiler.disable
def _communicate(region: type[torch.autograd.Function], x: torch.Tensor, tp: Group) -> torch.Tensor:
    return region.apply(x, tp)


def copy_to_tensor_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_CopyToTensorParallelRegion, x, tp)


def reduce_from_tensor_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_ReduceFromTensorParallelRegion, x, tp)


def scatter_to_tensor_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_ScatterToTensorParallelRegion, x, tp)


def gather_from_tensor_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_GatherFromTensorParallelRegion, x, tp)


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_ScatterToSequenceParallelRegion, x, tp)


def gather_from_sequence_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_GatherFromSequenceParallelRegion, x, tp)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: Group) -> torch.Tensor:
    return _apply(_ReduceScatterToSequenceParallelRegion, x, tp)
