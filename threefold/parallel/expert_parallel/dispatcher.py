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

A `Dispatch` records what a combine needs to undo its dispatch; it lives for one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from threefold.parallel.collectives import all_gather_single
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    record_collective,
    reduce_scatter_to_sequence_parallel_region,
)


@dataclass
class Dispatch:
    token_ids: torch.Tensor  # [pairs]: the token of each (token, expert) pair, expert-major
    probs: torch.Tensor  # [pairs]: its routing probability
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
    """[EP x rows, ...] from every EP rank's [rows, ...] (no gradient; bools as bytes, which
    every backend takes)."""
    source = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    out = source.new_empty((ep.size * source.shape[0], *source.shape[1:]))
    record_collective("all_gather", out.numel(), out.element_size())
    all_gather_single(out, source.contiguous(), group=ep.group)
    return out.to(tensor.dtype)


class _VariableAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, ep: Group):
        ctx.splits, ctx.ep = (send_splits, recv_splits), ep
        return _all_to_all(x, send_splits, recv_splits, ep)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _all_to_all(grad, recv_splits, send_splits, ctx.ep), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], ep: Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    record_collective("all_to_all", x.numel(), x.element_size())
    dist.all_to_all_single(out, x, recv, send, group=ep.group)
    return out


class AllToAllDispatcher:
    def __init__(self, num_experts: int, ep: Group) -> None:
        self.num_experts, self.ep = num_experts, ep
        self.num_local = num_experts // ep.size

    def dispatch(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, Dispatch]:
        experts, token_ids = _pairs(routing_map)
        pair_probs = probs[token_ids, experts]
        permuted = tokens.index_select(0, token_ids)
        per_expert = routing_map.sum(dim=0)  # [E]
        if self.ep.size == 1:
            counts = per_expert.tolist()
            return permuted, Dispatch(token_ids, pair_probs, tokens.shape[0], counts)
        # Every rank's count per expert: [EP source, E].
        everyone = _all_gather(per_expert.unsqueeze(0), self.ep).view(
            self.ep.size, self.ep.size, self.num_local
        )  # [src, dst, local]
        send = everyone[self.ep.rank].sum(dim=1).tolist()
        mine = everyone[:, self.ep.rank]  # [src, local]: what each source sends here
        recv = mine.sum(dim=1).tolist()
        received = _VariableAllToAll.apply(permuted, send, recv, self.ep)
        # Received in (source, local expert) blocks; the experts need (local expert, source).
        # Each received row's block (source x local + local expert); a stable sort by (local
        # expert, source) groups them by expert with no per-block work on the host.
        blocks = torch.repeat_interleave(
            torch.arange(mine.numel(), device=mine.device), mine.flatten()
        )
        key = (blocks % self.num_local) * self.ep.size + blocks // self.num_local
        order = torch.sort(key, stable=True).indices.to(tokens.device)
        plan = Dispatch(
            token_ids, pair_probs, tokens.shape[0], mine.sum(dim=0).tolist(), send, recv, order
        )
        return received.index_select(0, order), plan

    def combine(self, expert_output: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        if plan.order is not None:
            unsorted = torch.empty_like(expert_output).index_copy(0, plan.order, expert_output)
            expert_output = _VariableAllToAll.apply(
                unsorted, plan.recv_splits, plan.send_splits, self.ep
            )
        return _weighted_sum(expert_output, plan)


class AllGatherDispatcher:
    def __init__(self, num_experts: int, ep: Group) -> None:
        self.num_experts, self.ep = num_experts, ep
        self.num_local = num_experts // ep.size
        self.first = ep.rank * self.num_local

    def dispatch(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, Dispatch]:
        # Gathered in EP-rank order along the token dimension; backward reduce-scatters.
        tokens = gather_from_sequence_parallel_region(tokens, self.ep)
        probs = gather_from_sequence_parallel_region(probs, self.ep)
        if self.ep.size > 1:
            routing_map = _all_gather(routing_map, self.ep)
        local_map = routing_map[:, self.first : self.first + self.num_local]
        experts, token_ids = _pairs(local_map)
        pair_probs = probs[token_ids, experts + self.first]
        counts = local_map.sum(dim=0).tolist()
        plan = Dispatch(token_ids, pair_probs, tokens.shape[0], counts)
        return tokens.index_select(0, token_ids), plan

    def combine(self, expert_output: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        # Each rank's partial sums of all gathered tokens; summed and split back over EP.
        return reduce_scatter_to_sequence_parallel_region(
            _weighted_sum(expert_output, plan), self.ep
        )


def _weighted_sum(expert_output: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    weighted = expert_output * plan.probs.unsqueeze(-1).to(expert_output.dtype)
    out = expert_output.new_zeros(plan.num_tokens, expert_output.shape[-1])
    return out.index_add(0, plan.token_ids, weighted)


def build_dispatcher(kind: str, num_experts: int, ep: Group):
    return (AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher)(num_experts, ep)
