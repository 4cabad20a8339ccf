"""Token dispatch to the experts' ranks and back (--moe-token-dispatcher-type).

Both dispatchers start from a rank's tokens [T, hidden] with their routing probabilities and
map [T, E], hand the experts their tokens grouped by local expert (with a count per local
expert), and combine the experts' outputs into [T, hidden] as the probability-weighted sum
over each token's experts.

    alltoall   each rank sorts its (token, expert) pairs by expert and sends every EP rank the
               pairs of its experts: one all-to-all with variable splits each way (the counts
               travel first, in an all-gather of the per-expert counts)
    allgather  every rank gathers all EP ranks' tokens, keeps the pairs of its own experts,
               and the partial outputs are summed back by a reduce-scatter

Both run over expert-TP x EP (`expert_tp_ep`). Under expert tensor parallelism each expert is
split over ETP ranks, each returning a partial sum of its output: alltoall sends a pair to each
of the ETP ranks of its expert's EP rank and the combine adds the partial sums it gets back
like any other expert's; allgather gathers over all ETP x EP ranks and its reduce-scatter adds
them. With ETP 1 the group is the EP group.

A `Dispatch` records what a combine needs to undo its dispatch; it lives for one forward.

Both calls take `beside`, work computed while the call's all-to-all travels (the alltoall
dispatcher; allgather runs it first): --moe-shared-expert-overlap's shared expert. The
exchange starts, `beside()` runs, the exchange is awaited; on a GPU the transfer runs on the
communicator's stream beside that compute. Backward exchanges the gradients in turn.

Under --overlap-moe-expert-parallel-comm every exchange, the gradients' too, hands the turn to
the other pass of a combined 1F1B step while it travels (pipeline_parallel/combined_1f1b.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from threefold.parallel.collectives import all_gather_single
from threefold.parallel.parallel_context import Group
from threefold.parallel.pipeline_parallel import combined_1f1b
from threefold.parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    record_collective,
    reduce_scatter_to_sequence_parallel_region,
)


@dataclass
class Dispatch:
    token_ids: torch.Tensor  # [pairs]: the token of each (token, expert) pair, expert-major
    probs: torch.Tensor  # [pairs]: its routing probability (alltoall: a pair once per ETP rank)
    num_tokens: int  # tokens combined into (the gathered ones under allgather)
    counts: list[int]  # tokens per local expert
    send_splits: list[int] | None = None  # alltoall: pairs sent to each EP rank ...
    recv_splits: list[int] | None = None  # ... and received from each
    order: torch.Tensor | None = None  # alltoall: received pairs -> grouped by local expert


def _pairs(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) of every routed pair, sorted by expert then token."""
    experts, tokens = routing_map.t().nonzero(as_tuple=True)
    return experts, tokens


def _all_gather(tensor: torch.Tensor, ep: Group) -> torch.Tensor:
    """[size x rows, ...] from every rank's [rows, ...] in `ep` (no gradient; bools as bytes,
    which every backend takes)."""
    source = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    out = source.new_empty((ep.size * source.shape[0], *source.shape[1:]))
    record_collective("all_gather", out.numel(), out.element_size())
    all_gather_single(out, source.contiguous(), group=ep.group)
    return out.to(tensor.dtype)


class _VariableAllToAll(torch.autograd.Function):
    """`_all_to_all` of `x` (or what it `received`, exchanged already outside autograd, beside
    other work); backward exchanges the gradient the other way."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, ep: Group, received: list | None = None):
        ctx.splits, ctx.ep = (send_splits, recv_splits), ep
        return received[0] if received else _all_to_all(x, send_splits, recv_splits, ep)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        if not combined_1f1b.in_progress():
            return _all_to_all(grad, recv_splits, send_splits, ctx.ep), None, None, None, None
        # --overlap-moe-expert-parallel-comm: the forward pass runs while the gradient travels
        out, work = _all_to_all(grad, recv_splits, send_splits, ctx.ep, async_op=True)
        combined_1f1b.hand_over("backward")
        work.wait()
        return out, None, None, None, None


def _all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], ep: Group, async_op: bool = False
):
    """`x`'s rows exchanged over `ep` (with `async_op`: and the pending work)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    record_collective("all_to_all", x.numel(), x.element_size())
    work = dist.all_to_all_single(out, x, recv, send, group=ep.group, async_op=async_op)
    return (out, work) if async_op else out


def _exchange(
    x: torch.Tensor, send: list[int], recv: list[int], ep: Group, beside: Callable | None
) -> tuple[torch.Tensor, Any]:
    """`_VariableAllToAll` of `x`, and `beside()` (None: nothing) computed while it travels,
    then the other pass of a combined 1F1B step if one is in progress (after it, inside a
    compiled layer: the graph orders them itself)."""
    overlapped = beside is not None or combined_1f1b.in_progress()
    if not overlapped or torch.compiler.is_compiling():
        received = _VariableAllToAll.apply(x, send, recv, ep)
        return received, beside() if beside is not None else None
    received, work = _all_to_all(x.detach(), send, recv, ep, async_op=True)
    result = beside() if beside is not None else None
    combined_1f1b.hand_over("forward")
    work.wait()
    return _VariableAllToAll.apply(x, send, recv, ep, [received]), result


class AllToAllDispatcher:
    def __init__(self, num_experts: int, group: Group, expert_tp_size: int) -> None:
        self.num_experts, self.group, self.etp = num_experts, group, expert_tp_size
        self.ep_size, self.ep_rank = group.size // expert_tp_size, group.rank // expert_tp_size
        self.num_local = num_experts // self.ep_size

    def dispatch(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        beside: Callable | None = None,
    ) -> tuple[torch.Tensor, Dispatch, Any]:
        experts, token_ids = _pairs(routing_map)
        pair_probs = probs[token_ids, experts]
        per_expert = routing_map.sum(dim=0)  # [E]
        if self.group.size == 1:
            counts = per_expert.tolist()
            permuted = tokens.index_select(0, token_ids)
            result = beside() if beside is not None else None
            return permuted, Dispatch(token_ids, pair_probs, tokens.shape[0], counts), result
        # The pairs of each EP rank's experts are contiguous (expert-major); each block goes to
        # every ETP rank of that EP rank, in the group's order (EP rank x ETP + ETP rank).
        per_ep = per_expert.view(self.ep_size, self.num_local).sum(dim=1).tolist()
        if self.etp > 1:
            token_ids = _repeat_blocks(token_ids, per_ep, self.etp)
            pair_probs = _repeat_blocks(pair_probs, per_ep, self.etp)
        send = [count for count in per_ep for _ in range(self.etp)]
        # Every rank's count per expert: [source, EP rank, local expert].
        everyone = _all_gather(per_expert.unsqueeze(0), self.group).view(
            self.group.size, self.ep_size, self.num_local
        )
        mine = everyone[:, self.ep_rank]  # [src, local]: what each source sends here
        recv = mine.sum(dim=1).tolist()
        permuted = tokens.index_select(0, token_ids)
        received, result = _exchange(permuted, send, recv, self.group, beside)
        # Received in (source, local expert) blocks; the experts need (local expert, source).
        # Each received row's block (source x local + local expert); a stable sort by (local
        # expert, source) groups them by expert with no per-block work on the host.
        blocks = torch.repeat_interleave(
            torch.arange(mine.numel(), device=mine.device), mine.flatten()
        )
        key = (blocks % self.num_local) * self.group.size + blocks // self.num_local
        order = torch.sort(key, stable=True).indices.to(tokens.device)
        plan = Dispatch(
            token_ids, pair_probs, tokens.shape[0], mine.sum(dim=0).tolist(), send, recv, order
        )
        return received.index_select(0, order), plan, result

    def combine(
        self, expert_output: torch.Tensor, plan: Dispatch, beside: Callable | None = None
    ) -> tuple[torch.Tensor, Any]:
        result = None
        if plan.order is not None:
            unsorted = torch.empty_like(expert_output).index_copy(0, plan.order, expert_output)
            expert_output, result = _exchange(
                unsorted, plan.recv_splits, plan.send_splits, self.group, beside
            )
        elif beside is not None:
            result = beside()
        # Under ETP a pair comes back once per ETP rank: the weighted sum adds the partials.
        return _weighted_sum(expert_output, plan), result


class AllGatherDispatcher:
    def __init__(self, num_experts: int, group: Group, expert_tp_size: int) -> None:
        self.num_experts, self.group = num_experts, group
        self.num_local = num_experts // (group.size // expert_tp_size)
        self.first = group.rank // expert_tp_size * self.num_local

    def dispatch(
        self,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        routing_map: torch.Tensor,
        beside: Callable | None = None,
    ) -> tuple[torch.Tensor, Dispatch, Any]:
        result = beside() if beside is not None else None
        # Gathered in group-rank order along the token dimension; backward reduce-scatters.
        tokens = gather_from_sequence_parallel_region(tokens, self.group)
        probs = gather_from_sequence_parallel_region(probs, self.group)
        if self.group.size > 1:
            routing_map = _all_gather(routing_map, self.group)
        local_map = routing_map[:, self.first : self.first + self.num_local]
        experts, token_ids = _pairs(local_map)
        pair_probs = probs[token_ids, experts + self.first]
        counts = local_map.sum(dim=0).tolist()
        plan = Dispatch(token_ids, pair_probs, tokens.shape[0], counts)
        return tokens.index_select(0, token_ids), plan, result

    def combine(
        self, expert_output: torch.Tensor, plan: Dispatch, beside: Callable | None = None
    ) -> tuple[torch.Tensor, Any]:
        result = beside() if beside is not None else None
        # Each rank's partial sums of all gathered tokens; summed and split back.
        summed = reduce_scatter_to_sequence_parallel_region(
            _weighted_sum(expert_output, plan), self.group
        )
        return summed, result


def _weighted_sum(expert_output: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Each token's experts' outputs weighted by their probabilities and summed, in the wider
    of the two dtypes (the probabilities' under --moe-router-dtype), returned in the outputs'."""
    dtype = torch.promote_types(expert_output.dtype, plan.probs.dtype)
    return _WeightedSum.apply(expert_output, plan.probs, plan.token_ids, plan.num_tokens, dtype)


class _WeightedSum(torch.autograd.Function):
    """`_weighted_sum`, keeping for backward the experts' outputs and the probabilities only.
    Written with autograd's own operations (a product, then index_add) it also kept the
    weighted products, one more [pairs, hidden] tensor a layer (in the wider dtype: twice the
    outputs' bytes in a bf16 run under --moe-router-dtype fp32, beside their fp32 copy):
    index_add's backward saves its source though it reads only its shape. The gradients are
    the same operations in the same order, so bit for bit the same."""

    @staticmethod
    def forward(ctx, expert_output, probs, token_ids, num_tokens, dtype):
        ctx.save_for_backward(expert_output, probs, token_ids)
        ctx.dtype = dtype
        weighted = expert_output.to(dtype) * probs.unsqueeze(-1).to(dtype)
        out = weighted.new_zeros(num_tokens, expert_output.shape[-1])
        return out.index_add_(0, token_ids, weighted).to(expert_output.dtype)

    @staticmethod
    def backward(ctx, grad):
        expert_output, probs, token_ids = ctx.saved_tensors
        grad = grad.to(ctx.dtype).index_select(0, token_ids)
        grad_output = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_output = (grad * probs.unsqueeze(-1).to(ctx.dtype)).to(expert_output.dtype)
        if ctx.needs_input_grad[1]:
            grad_probs = (grad * expert_output.to(ctx.dtype)).sum(-1).to(probs.dtype)
        return grad_output, grad_probs, None, None, None


def _repeat_blocks(values: torch.Tensor, sizes: list[int], times: int) -> torch.Tensor:
    """Each consecutive block of `values` (of `sizes`) repeated `times` in place."""
    return torch.cat([block for block in values.split(sizes) for _ in range(times)])


def build_dispatcher(kind: str, num_experts: int, expert_tp_ep: Group, expert_tp_size: int):
    """The --moe-token-dispatcher-type over expert-TP x EP (`expert_tp_ep`)."""
    dispatcher = AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher
    return dispatcher(num_experts, expert_tp_ep, expert_tp_size)
