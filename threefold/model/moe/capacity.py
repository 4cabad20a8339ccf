"""Token dropping: `--moe-expert-capacity-factor` keeps at most ceil(T x k / E x factor)
tokens per expert of a micro-batch's T tokens, the most probable ones (`--moe-token-drop-policy
probs`) or the first in one device's token order (`position`: sequence-major, as the layer
flattens its [sequence, batch] input), and `--moe-pad-expert-input-to-capacity` fills every
expert to exactly that many.

The choice is made over the whole micro-batch. Where ranks each route a slice of its sequences
(TP under sequence parallelism, CP), their probabilities, routing maps and the tokens' places
in one device's order are gathered over those ranks, each decides for all T tokens as one
device does, and keeps its own rows: every layout drops the tokens one device drops.
megatron-core decides within each rank's slice (a capacity of T/(TP x CP) x k / E x factor
there), so its runs drop different tokens at each layout; a checkpoint is the same either way.
"""

from __future__ import annotations

import math

import torch

from threefold.config import ModelConfig
from threefold.parallel.context_parallel.sequence import local_positions
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.mappings import _all_gather


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    return math.ceil(num_tokens * topk / num_experts * factor)


def keep_within_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
    policy: str,
    pad: bool,
    places: torch.Tensor | None = None,
) -> torch.Tensor:
    """The [T, E] mask of the tokens each expert takes: at most `capacity` of those routed to
    it, by probability ("probs") or by place ("position": `places`, each token's in one
    device's order, default the rows' order); with `pad` exactly `capacity`, the unrouted
    among them at probability 0."""
    tokens = probs.shape[0]
    if capacity >= tokens:
        keep = torch.ones_like(routing_map)
    else:
        if policy == "probs":
            order = probs
        else:
            # Routed tokens before the others, earlier before later (a top-k of the 0/1 map
            # alone, as megatron-core takes it, leaves the choice among ties to the kernel).
            if places is None:
                places = torch.arange(tokens, device=probs.device)
            ramp = (places.to(torch.float64) / tokens)[:, None]  # 0 rising to below 1
            order = routing_map.double() * (2.0 - ramp)
        indices = order.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, indices, True)
    return keep if pad else routing_map & keep


class Capacity:
    """A router's token dropping over the ranks that route slices of one micro-batch."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        self.factor = config.moe_expert_capacity_factor
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.policy = config.moe_token_drop_policy
        self.pad = config.moe_pad_expert_input_to_capacity
        # The ranks holding slices of the micro-batch's sequences: CP's, and TP's under
        # sequence parallelism (without it, as the tools run, TP ranks hold the same tokens)
        self.parallel = parallel
        self.group = parallel.tp_cp if parallel.sequence_parallel else parallel.cp

    def __call__(
        self, probs: torch.Tensor, routing_map: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing probabilities and map [T, E] of this rank's tokens (sequence-major),
        less the tokens dropped."""
        group, tokens = self.group, probs.shape[0]
        if group.size == 1:
            capacity = expert_capacity(tokens, self.num_experts, self.topk, self.factor)
            keep = keep_within_capacity(
                probs.detach(), routing_map, capacity, self.policy, self.pad
            )
            return probs * keep, keep
        with torch.no_grad():
            experts = self.num_experts
            places = self._places(tokens, batch_size, probs.device).double()[:, None]
            mine = torch.cat([probs.double(), routing_map.double(), places], dim=1)
            every = _all_gather(mine, 0, group)  # [group x T, 2E + 1], rank by rank
            capacity = expert_capacity(every.shape[0], experts, self.topk, self.factor)
            keep = keep_within_capacity(
                every[:, :experts],
                every[:, experts : 2 * experts].bool(),
                capacity,
                self.policy,
                self.pad,
                every[:, -1].long(),
            ).narrow(0, group.rank * tokens, tokens)
        return probs * keep, keep

    def _places(self, tokens: int, batch_size: int, device: torch.device) -> torch.Tensor:
        """Each of this rank's tokens' place in one device's sequence-major order: its
        sequence's chunks are CP's (parallel/context_parallel/sequence.py), and of those
        positions, under sequence parallelism, TP rank r holds the r-th slice."""
        parallel, sequence = self.parallel, tokens // batch_size
        tp = parallel.tp.size if parallel.sequence_parallel else 1
        whole = sequence * tp * parallel.cp.size
        if parallel.cp.size > 1:
            positions = local_positions(whole, parallel.cp, device)
        else:
            positions = torch.arange(whole, device=device)
        if tp > 1:
            positions = positions[parallel.tp.rank * sequence : (parallel.tp.rank + 1) * sequence]
        batch = torch.arange(batch_size, device=device)
        return (positions[:, None] * batch_size + batch[None, :]).reshape(-1)
