"""--tp-comm-overlap: a sequence-parallel linear layer's collective cut into TP steps around a
ring, each step's transfer overlapped with the GEMM of the piece already there (the "collective
matmul" decomposition; Megatron-LM overlaps the same pairs through Transformer Engine's
userbuffers).

    column-parallel  fwd: all-gather x, then x A       ->  each arriving slice's GEMM while the
                          next slice travels
                     bwd: dgrad, then reduce-scatter   ->  each destination's partial dgrad
                                                           added to the running sum that
                                                           travels on
    row-parallel     fwd: x A, then reduce-scatter     ->  the same ring of partial sums
                     bwd: all-gather dy, then dy A^T   ->  the all-gather ring again

A rank sends to the next TP rank and receives from the previous one (non-blocking P2P), so one
slice is in flight while the GEMM of another runs; on a GPU the transfer runs on the
communicator's stream beside the compute. The results are those of the plain collectives up
to the order of the reduce-scatter's additions. The weight gradient is one GEMM over the whole
gathered sequence (into `main_grad` with --gradient-accumulation-fusion), as without overlap;
with --delay-wgrad-compute it waits, as a plain layer's, for the combined step's next
exchange (delayed_wgrad.py), the ring's input gradient leaving at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.delayed_wgrad import when_due
from threefold.parallel.tensor_parallel.mappings import COLLECTIVE_COUNTS, record_collective
from threefold.parallel.tensor_parallel.weight_grad import add_weight_grad_product, placeholder_grad


def _start_ring_exchange(send: torch.Tensor, receive: torch.Tensor, tp: Group) -> list:
    """`send` to the next TP rank, `receive` from the previous one, both in flight."""
    ranks = dist.get_process_group_ranks(tp.group)
    ahead, behind = ranks[(tp.rank + 1) % tp.size], ranks[(tp.rank - 1) % tp.size]
    operations = [
        dist.P2POp(dist.isend, send, ahead, tp.group),
        dist.P2POp(dist.irecv, receive, behind, tp.group),
    ]
    return dist.batch_isend_irecv(operations)


def gathered_products(local: torch.Tensor, product, tp: Group) -> tuple[list, list]:
    """The ring all-gather of `local` (this rank's slice of the sequence) with `product` of
    each slice computed while the next one travels: (the slices, their products), both in
    sequence order."""
    slices, products = [None] * tp.size, [None] * tp.size
    current = local.contiguous()
    for step in range(tp.size):
        source = (tp.rank - step) % tp.size
        slices[source] = current
        pending = []
        if step < tp.size - 1:
            arriving = torch.empty_like(current)
            pending = _start_ring_exchange(current, arriving, tp)
        products[source] = product(current)
        for work in pending:
            work.wait()
        if pending:
            current = arriving
    record_collective("all_gather", local.numel() * tp.size, local.element_size())
    COLLECTIVE_COUNTS["in_ring_steps"] += 1  # (the tests tell the overlapped path by it)
    return slices, products


def reduce_scattered(partial, tp: Group, numel: int, element_size: int) -> torch.Tensor:
    """The ring reduce-scatter of `partial(c)` (this rank's contribution to slice c of the
    output): at each step the next destination's partial is computed, the running sum from the
    previous rank added, and the sum passed on; the last step's is this rank's slice."""
    received, pending = None, []
    for step in range(tp.size):
        destination = (tp.rank - step - 1) % tp.size
        total = partial(destination)
        for work in pending:
            work.wait()
        if received is not None:
            total = total + received
        if step == tp.size - 1:
            record_collective("reduce_scatter", numel, element_size)
            COLLECTIVE_COUNTS["in_ring_steps"] += 1
            return total
        received = torch.empty_like(total)
        pending = _start_ring_exchange(total, received, tp)
    raise AssertionError("unreachable")


class _AllGatherLinear(torch.autograd.Function):
    """Column-parallel: F.linear(all-gather(x), weight, bias), the gather overlapped."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp, accumulate, delay):
        slices, outputs = gathered_products(x, lambda part: F.linear(part, weight, bias), tp)
        ctx.save_for_backward(torch.cat(slices), weight)
        ctx.tp, ctx.accumulate, ctx.delay, ctx.has_bias = tp, accumulate, delay, bias is not None
        ctx.param = weight  # its main_grad (a saved tensor comes back as another object)
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad_output):
        gathered, weight = ctx.saved_tensors
        tp, grad_output = ctx.tp, grad_output.contiguous()
        pieces = grad_output.chunk(tp.size)
        grad_x = reduce_scattered(
            lambda c: pieces[c] @ weight, tp, gathered.numel(), gathered.element_size()
        )
        return (grad_x, *_weight_and_bias_grads(ctx, grad_output, gathered), None, None, None)


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel: reduce-scatter(F.linear(x, weight)) over the sequence, overlapped."""

    @staticmethod
    def forward(ctx, x, weight, tp, accumulate, delay):
        x = x.contiguous()
        pieces = x.chunk(tp.size)
        out_numel = x.numel() // x.shape[-1] * weight.shape[0]
        output = reduce_scattered(
            lambda c: F.linear(pieces[c], weight), tp, out_numel, x.element_size()
        )
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.accumulate, ctx.delay, ctx.has_bias = tp, accumulate, delay, False
        ctx.param = weight
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        slices, grads_x = gathered_products(grad_output, lambda part: part @ weight, ctx.tp)
        grad_weight, _ = _weight_and_bias_grads(ctx, torch.cat(slices), x)
        return torch.cat(grads_x), grad_weight, None, None, None


def _weight_and_bias_grads(ctx, grad_output: torch.Tensor, inputs: torch.Tensor) -> tuple:
    """The weight gradient over the whole sequence (into main_grad when accumulating; when due
    where it may be delayed) and the bias gradient."""
    grads = grad_output.reshape(-1, grad_output.shape[-1])
    inputs = inputs.reshape(-1, inputs.shape[-1])
    grad_bias = grads.sum(dim=0) if ctx.has_bias else None
    if not ctx.needs_input_grad[1]:
        return None, grad_bias

    def weight_grad() -> torch.Tensor:
        if ctx.accumulate:
            add_weight_grad_product(ctx.param.main_grad, grads, inputs, traced=False)
            return placeholder_grad(ctx.param)
        return grads.t() @ inputs

    return (when_due(ctx.param, weight_grad) if ctx.delay else weight_grad()), grad_bias


# Eager between compiled graphs (--compile-layers), as the plain collectives are: traced, the
# P2P calls would hang.
@torch.compiler.disable
def all_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tp: Group,
    accumulate: bool = False,
    delay: bool = False,
) -> torch.Tensor:
    """A column-parallel layer's output from this rank's slice `x` of the sequence: the
    all-gather overlapped with the GEMM (module doc); `accumulate`: the weight gradient goes
    into `weight.main_grad`; `delay`: it may wait for the next exchange (--delay-wgrad-compute)."""
    return _AllGatherLinear.apply(x, weight, bias, tp, accumulate, delay)


@torch.compiler.disable
def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, tp: Group, accumulate: bool = False, delay: bool = False
) -> torch.Tensor:
    """A row-parallel layer's output (no bias), reduce-scattered over the sequence, the
    reduce-scatter overlapped with the GEMM (module doc); `accumulate` and `delay` as
    `all_gather_linear`'s."""
    return _LinearReduceScatter.apply(x, weight, tp, accumulate, delay)
