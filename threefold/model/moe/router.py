"""The top-k router of an MoE layer and its auxiliary losses, as megatron-core computes them.

    logits   = tokens @ weight.T (+ bias)                      [tokens, experts]
               (the bias unless --disable-bias-linear, as megatron-core's)
               (--moe-router-dtype fp32/fp64: computed in that dtype, and so are the
               probabilities and the experts' weighted sum, parallel/expert_parallel/
               dispatcher.py; megatron-core's router_gating_linear)
    softmax  : softmax over the top-k logits (or, --moe-router-pre-softmax, top-k of the
               softmax over all experts); sigmoid: top-k sigmoid scores, renormalized if k > 1
    capacity : --moe-expert-capacity-factor keeps at most ceil(tokens x k / experts x factor)
               tokens per expert of the micro-batch, by probability or by position
               (--moe-token-drop-policy; capacity.py: over the whole micro-batch, where
               megatron-core decides within each rank's slice of it)

`--moe-router-load-balancing-type sinkhorn` (Megatron's, as in BASE layers) balances by the
choice itself: in training the top-k experts of each token are those of the Sinkhorn-normalized
exp(logits) (rows and columns scaled until each expert receives an equal share of the
micro-batch), weighted by the sigmoid (k = 1) or softmax of the plain logits; in evaluation the
plain top-k. The normalization runs over the whole micro-batch's tokens (gathered from the
ranks that each route a slice of its sequences), so every layout routes as one device does.

The load-balancing loss (Switch Transformer) over the tokens of a micro-batch is

    aux = coeff x E / (k T^2) x sum_e (sum_t p_te) (sum_t routed_te)

with p the scores over all experts and `routed` a fresh top-k of them; T and the routed counts
are the whole sequence's, summed over the ranks that each route a slice of it (TP under
sequence parallelism, and CP), while the probabilities are this rank's: the losses of those
ranks add up to the loss of the whole micro-batch. `seq_aux_loss` is the same per sequence,
averaged over the micro-batch. `global_aux_loss` (megatron-core's) counts the routed tokens of
every rank's micro-batch (T and the counts summed over the data-parallel replicas too),
averaged over the micro-batches of the step so far: a run's balance is its global batch's, and
its strength depends on the layout by design (its gradient, like every loss's, is averaged
over the replicas: DP2 with one micro-batch each computes one process's loss over both at
half the coefficient). The z-loss is coeff x mean_t logsumexp(logits_t)^2 (each rank
its share of the mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.moe.capacity import Capacity
from threefold.parallel.data_parallel.torch_native import add_replicated
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.mappings import _all_gather, record_collective
from threefold.parallel.tensor_parallel.random import get_rng_tracker
from threefold.parallel.tensor_parallel.sharding import InitMethod, constant_init, mark_replicated

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Scores are computed in fp32, or in fp64 where the logits are (--moe-router-dtype)."""
    return logits if logits.dtype == torch.float64 else logits.float()


class _GatingLinear(torch.autograd.Function):
    """tokens @ weight.T (+ bias) in `dtype`, the operands saved in their own dtypes (no fp32
    copy of the tokens kept for backward), the gradients computed in `dtype` and returned in
    theirs."""

    @staticmethod
    def forward(ctx, tokens, weight, bias, dtype: torch.dtype):
        ctx.save_for_backward(tokens, weight)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias is None else bias.dtype
        logits = tokens.to(dtype) @ weight.to(dtype).t()
        return logits if bias is None else logits + bias.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        tokens, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        grad_tokens = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_tokens = (grad @ weight.to(ctx.dtype)).to(tokens.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad.t() @ tokens.to(ctx.dtype)).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0).to(ctx.bias_dtype)
        return grad_tokens, grad_weight, grad_bias, None


def group_limited_top_k(
    scores: torch.Tensor, k: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of `scores` [T, E] within each token's `group_topk` best groups of experts
    (E / num_groups consecutive experts each; a group scores the sum of its top k /
    group_topk), megatron-core's group_limited_topk."""
    grouped = scores.unflatten(-1, (num_groups, -1))
    group_scores = grouped.topk(k // group_topk, dim=-1)[0].sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    masked = scores.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).flatten(1), float("-inf"))
    return masked.topk(k, dim=-1)


def top_k(
    logits: torch.Tensor,
    k: int,
    score_function: str,
    pre_softmax: bool,
    groups: tuple[int, int] | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [T, k], expert indices [T, k]) of each token's k experts; `groups`
    (number of groups, groups per token): group-limited routing; `scaling_factor`: times the
    probabilities; `expert_bias` (sigmoid scores): added to the scores that choose the experts,
    not to their weights (megatron-core's topk_routing_with_score_function)."""

    def choose(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return group_limited_top_k(scores, k, *groups) if groups else scores.topk(k, dim=-1)

    if score_function == "softmax":
        if pre_softmax:
            probs, indices = choose(torch.softmax(_at_least_fp32(logits), dim=-1))
        else:
            top, indices = choose(logits)
            probs = torch.softmax(_at_least_fp32(top), dim=-1)
    else:
        scores = torch.sigmoid(_at_least_fp32(logits))
        if expert_bias is None:
            probs, indices = choose(scores)
        else:
            indices = choose(scores + expert_bias.float())[1]
            probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    return (probs * scaling_factor if scaling_factor else probs), indices


def sinkhorn(cost: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """exp(cost) [tokens, experts] scaled by row and column factors until the column factors
    settle, as megatron-core's `sinkhorn` (same iteration, same stopping rule)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    d1 = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tolerance:
        d0 = (1 / d0.shape[0]) / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.shape[0]) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Every expert's score of every token, summing to 1 per token."""
    if score_function == "softmax":
        return torch.softmax(_at_least_fp32(logits), dim=-1)
    scores = torch.sigmoid(_at_least_fp32(logits))
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


class _RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing (megatron-core's RandomSTE): standard normal logits in
    place of the router's, drawn from the model-parallel stream (each TP rank routes its own
    slice of the sequence; a recomputation redraws the same), the gradient passed straight
    through to the router's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        with get_rng_tracker().fork():
            return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TopKRouter(nn.Module):
    """Routes each token to `--moe-router-topk` experts; the weight is Megatron's
    `router.weight` [experts, hidden], the same on every TP rank, and unless
    --disable-bias-linear a `router.bias` [experts] beside it (megatron-core's, GPT-OSS's),
    initialized as the weight is."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, init: InitMethod) -> None:
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        groups = (config.moe_router_num_groups, config.moe_router_group_topk)
        self.groups = groups if groups[0] is not None else None
        self.scaling_factor = config.moe_router_topk_scaling_factor
        # --moe-router-enable-expert-bias: fp32 state, not trained by the optimizer, nudged
        # after each step from the step's token counts over all ranks of the stage
        self.expert_bias, self.bias_update_rate = None, config.moe_router_bias_update_rate
        self.count_groups = (parallel.tp_cp, parallel.dp)
        if config.moe_router_enable_expert_bias:
            bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
            self.expert_bias = mark_replicated(bias, constant_init(0.0))
        self.load_balancing = config.moe_router_load_balancing_type
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        self.capacity = None
        if config.moe_expert_capacity_factor is not None:
            self.capacity = Capacity(config, parallel)
        self.router_dtype = ROUTER_DTYPES.get(config.moe_router_dtype)
        self.force_load_balancing = config.moe_router_force_load_balancing
        # The ranks that route slices of one sequence: TP under sequence parallelism (required
        # with MoE when TP > 1) and CP.
        self.sequence_group = parallel.tp_cp
        # global_aux_loss: the step's counts so far, over all ranks of the stage
        self.data_parallel, self.global_steps = parallel.dp, 0
        self.register_buffer("global_counts", torch.zeros(config.num_experts), persistent=False)
        weight = torch.empty(config.num_experts, config.hidden_size)
        # Under sequence parallelism each TP rank's gradient covers its slice of the tokens.
        self.weight = mark_replicated(nn.Parameter(weight), init, parallel.sequence_parallel)
        self.bias = None
        if config.add_bias_linear:
            bias = nn.Parameter(torch.empty(config.num_experts))
            self.bias = mark_replicated(bias, init, parallel.sequence_parallel)

    def forward(
        self, tokens: torch.Tensor, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """tokens [T, hidden], sequence-major (T = local sequence x `batch_size`). Returns the
        routing probabilities [T, E] (0 where not routed), the routing map [T, E] and the
        auxiliary losses {name: loss with its coefficient}, when training with gradients."""
        if self.router_dtype is None:
            logits = F.linear(tokens, self.weight, self.bias)
        else:
            logits = _GatingLinear.apply(tokens, self.weight, self.bias, self.router_dtype)
        if self.force_load_balancing:
            logits = _RandomLogits.apply(logits)
        if self.load_balancing == "sinkhorn":
            probs, indices = self._sinkhorn_top_k(logits)
        else:
            probs, indices = top_k(
                logits,
                self.topk,
                self.score_function,
                self.pre_softmax,
                self.groups,
                self.scaling_factor,
                self.expert_bias,
            )
        probs = probs.to(logits.dtype)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
        if self.capacity is not None:
            routing_probs, routing_map = self.capacity(routing_probs, routing_map, batch_size)
        losses = {}
        if self.training and torch.is_grad_enabled():
            losses = self._auxiliary_losses(logits, batch_size)
        return routing_probs, routing_map, losses

    def _apply(self, fn, recurse: bool = True):
        """As nn.Module's, but the expert bias stays fp32 when the model is cast (megatron-core
        keeps it fp32 too: bf16 could not hold its small steps)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()
        return self

    def start_step(self) -> None:
        """A step's micro-batches begin: the global auxiliary loss counts them afresh."""
        self.global_counts.zero_()
        self.global_steps = 0

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """After a step: this rank's routed-token counts summed over the stage's ranks, and
        each expert's bias moved by the rate towards an even load (megatron-core's
        get_updated_expert_bias)."""
        counts = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        for group in self.count_groups:
            counts = group.all_reduce(counts)
        deficit = counts.mean() - counts
        add_replicated(self.expert_bias, torch.sign(deficit) * self.bias_update_rate)

    def _sinkhorn_top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.topk == 1:
            scores = torch.sigmoid(_at_least_fp32(logits))
        else:
            scores = torch.softmax(_at_least_fp32(logits), dim=-1)
        if not self.training:
            return scores.topk(self.topk, dim=-1)
        with torch.no_grad():
            group = self.sequence_group
            scored = _at_least_fp32(logits)
            whole = _all_gather(scored, 0, group) if group.size > 1 else scored
            balanced = sinkhorn(whole)
            if group.size > 1:  # this rank's tokens: its block of the gathered rows
                balanced = balanced.narrow(0, group.rank * logits.shape[0], logits.shape[0])
            indices = balanced.topk(self.topk, dim=-1).indices
        return scores.gather(1, indices), indices

    def _auxiliary_losses(self, logits: torch.Tensor, batch_size: int) -> dict[str, torch.Tensor]:
        losses = {}
        ranks = self.sequence_group.size
        if self.z_loss_coeff:
            # The mean over the whole sequence: this rank's part of it.
            z = torch.logsumexp(_at_least_fp32(logits), dim=-1).square().mean() / ranks
            losses["z_loss"] = z * self.z_loss_coeff
        if self.load_balancing in ("none", "sinkhorn") or not self.aux_loss_coeff:
            return losses
        scores = scores_for_aux_loss(logits, self.score_function)
        routed = torch.zeros_like(scores).scatter(1, scores.topk(self.topk, dim=-1).indices, 1.0)
        coeff = self.aux_loss_coeff * self.num_experts / self.topk
        if self.load_balancing == "aux_loss":
            counts = self._over_sequence(routed.sum(dim=0))
            tokens = logits.shape[0] * ranks
            losses["load_balancing_loss"] = (scores.sum(dim=0) * counts).sum() * (coeff / tokens**2)
        elif self.load_balancing == "global_aux_loss":
            counts = self._over_sequence(routed.sum(dim=0))
            if self.data_parallel.size > 1:
                record_collective("all_reduce", counts.numel(), counts.element_size())
                counts = self.data_parallel.all_reduce(counts.contiguous())
            self.global_counts += counts.float()
            self.global_steps += 1
            average = (self.global_counts / self.global_steps).to(scores.dtype)
            tokens = logits.shape[0] * ranks * self.data_parallel.size
            losses["global_load_balancing_loss"] = (scores.sum(dim=0) * average).sum() * (
                coeff / tokens**2
            )
        else:  # seq_aux_loss: [local sequence, batch, experts]
            counts = self._over_sequence(routed.unflatten(0, (-1, batch_size)).sum(dim=0))
            sequence = logits.shape[0] // batch_size * ranks
            per_sequence = scores.unflatten(0, (-1, batch_size)).sum(dim=0) * counts
            losses["seq_load_balancing_loss"] = per_sequence.sum(dim=1).mean() * (
                coeff / sequence**2
            )
        return losses

    def _over_sequence(self, counts: torch.Tensor) -> torch.Tensor:
        """Routed-token counts of the whole sequence from each TP rank's slice."""
        if self.sequence_group.size > 1:
            record_collective("all_reduce", counts.numel(), counts.element_size())
            counts = self.sequence_group.all_reduce(counts.contiguous())
        return counts
