"""The mixture-of-experts MLP: router -> dispatch -> experts -> combine, plus a shared expert.

It replaces the dense `MLP` in the layer spec (model/spec.py) of the layers --moe-layer-freq
picks, with the same call: hidden states [sequence, batch, hidden] in (this TP rank's slice of
the sequence under sequence parallelism), the same shape out.

The auxiliary losses are not returned: like megatron-core's MoEAuxLossAutoScaler they are
attached to the routing probabilities (model/aux_loss.py), whose backward adds each loss's
gradient scaled by `aux_loss_scale`, the factor the schedule applies to the language-model
loss (1 / micro-batches, times the fp16 loss scale); the trainer sets it each step
(`start_aux_losses`). That works on every pipeline stage, which the loss of the last stage
cannot reach. Each layer also keeps
what it routed for the log: the losses without their coefficients (Megatron's
`load_balancing_loss`, `z_loss`) and the tokens routed to each expert, summed over the
micro-batches until `take_statistics`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.aux_loss import attach_losses
from threefold.model.mlp import MLP
from threefold.model.moe.experts import Experts
from threefold.model.moe.router import TopKRouter
from threefold.model.recompute import checkpoint, is_recomputing
from threefold.parallel.expert_parallel import build_dispatcher
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import DuplicatedLinear
from threefold.parallel.tensor_parallel.sharding import InitMethod, mark_replicated


class SharedExpertMLP(MLP):
    """The shared expert every token passes through: an MLP of
    --moe-shared-expert-intermediate-size, with --moe-shared-expert-gate its output scaled per
    token by sigmoid(x . gate_weight) (Qwen2-MoE's and Qwen3-Next's gate, megatron-core's
    `gate_weight`)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__(
            config,
            parallel,
            init_method,
            output_layer_init_method,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
        )
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            # Each rank gates its own tokens: under sequence parallelism its slice of the
            # sequence, the weight's gradient then summed over TP.
            self.gate_weight = mark_replicated(
                nn.Parameter(torch.empty(1, config.hidden_size)),
                init_method,
                partial_grads=parallel.sequence_parallel,
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.finish(self.activated(hidden_states), hidden_states)

    def finish(self, intermediate: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """fc2 of `activated`'s output, gated per token of `hidden_states` (the input)."""
        output = self.linear_fc2(intermediate)
        if self.gate_weight is None:
            return output
        return output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))


class MoELayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        self.router = TopKRouter(config, parallel, init_method)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if config.moe_latent_size is not None:
            # --moe-latent-size: the routed experts' tokens go down to the latent width before
            # the dispatch and come back up after the combine (megatron-core's projections,
            # Transformer Engine's duplicated linears: whole on every TP rank, each projecting
            # its own tokens); the all-to-alls and the experts then move and multiply
            # latent/hidden of what they would. The router and shared expert read the hidden
            # states as they are.
            def projection(inputs: int, outputs: int, init: InitMethod) -> DuplicatedLinear:
                return DuplicatedLinear(
                    inputs,
                    outputs,
                    parallel=parallel,
                    init_method=init,
                    bias=config.add_bias_linear,
                )

            latent, hidden = config.moe_latent_size, config.hidden_size
            self.fc1_latent_proj = projection(hidden, latent, init_method)
            self.fc2_latent_proj = projection(latent, hidden, output_layer_init_method)
        self.experts = Experts(config, parallel, init_method, output_layer_init_method)
        self.dispatcher = build_dispatcher(
            config.moe_token_dispatcher_type,
            config.num_experts,
            parallel.expert_tp_ep,
            parallel.expert_tp.size,
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(
                config, parallel, init_method, output_layer_init_method
            )
        self.recompute_shared_experts = config.recomputes("shared_experts")
        self.shared_expert_overlap = config.moe_shared_expert_overlap
        # The overlap calls the shared expert's halves, not its forward, so its forward
        # pre-hook (--overlap-param-gather's wait for its buckets) never fires: this layer's
        # waits for all of its weights instead
        self.reads_descendant_weights = self.shared_expert_overlap
        self.coefficients = {
            "load_balancing_loss": config.moe_aux_loss_coeff,
            "seq_load_balancing_loss": config.moe_aux_loss_coeff,
            "global_load_balancing_loss": config.moe_aux_loss_coeff,
            "z_loss": config.moe_z_loss_coeff,
        }
        self.apply_probs_on_input = config.moe_apply_probs_on_input
        self.aux_loss_scale = 1.0
        self._statistics: dict[str, torch.Tensor] = {}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        sequence, batch, hidden = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden)
        probs, routing_map, losses = self.router(tokens, batch)
        if losses:
            probs = attach_losses(probs, self.aux_loss_scale, *losses.values())
        if self.training and not is_recomputing():
            self._record(losses, routing_map)
        if self.fc1_latent_proj is not None:
            tokens = self.fc1_latent_proj(tokens)
        if self.apply_probs_on_input:
            tokens, probs = probs_on_input(tokens, probs, routing_map)
        shared = self.shared_experts
        if self.shared_expert_overlap:
            # --moe-shared-expert-overlap: fc1 and the activation while the tokens travel to
            # their experts, fc2 while the experts' outputs travel back.
            expert_input, plan, intermediate = self.dispatcher.dispatch(
                tokens, probs, routing_map, beside=lambda: shared.activated(hidden_states)
            )
            expert_output = self.experts(expert_input, plan.counts)
            output, shared_output = self.dispatcher.combine(
                expert_output, plan, beside=lambda: shared.finish(intermediate, hidden_states)
            )
            return self._hidden(output).view(sequence, batch, hidden) + shared_output
        expert_input, plan, _ = self.dispatcher.dispatch(tokens, probs, routing_map)
        expert_output = self.experts(expert_input, plan.counts)
        output = self._hidden(self.dispatcher.combine(expert_output, plan)[0])
        output = output.view(sequence, batch, hidden)
        if self.shared_experts is not None:
            if self.recompute_shared_experts and self.training:
                output = output + checkpoint(self.shared_experts, hidden_states)
            else:
                output = output + self.shared_experts(hidden_states)
        return output

    def _hidden(self, combined: torch.Tensor) -> torch.Tensor:
        """The experts' combined output [T, latent or hidden] at the hidden size."""
        if self.fc2_latent_proj is None:
            return combined
        return self.fc2_latent_proj(combined)

    @torch.no_grad()
    def _record(self, losses: dict[str, torch.Tensor], routing_map: torch.Tensor) -> None:
        values = {name: loss.detach() / self.coefficients[name] for name, loss in losses.items()}
        values["tokens_per_expert"] = routing_map.sum(dim=0).float()
        for name, value in values.items():
            previous = self._statistics.get(name)
            self._statistics[name] = value if previous is None else previous + value

    def take_statistics(self) -> dict[str, torch.Tensor]:
        """What this layer routed since the last call, summed over micro-batches on this rank:
        the auxiliary losses (without coefficients) and `tokens_per_expert` [experts]."""
        statistics, self._statistics = self._statistics, {}
        return statistics


def probs_on_input(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """--moe-apply-probs-on-input (Llama 4's): each token scaled by its routing weight, in the
    tokens' dtype, before it goes to its expert (top-1: a row's one weight is its sum; a token
    dropped over capacity has none), and weights of 1 for the combine, as megatron-core's
    experts reset them. The scale keeps the weights' graph: the router learns through it."""
    weight = probs.sum(dim=-1, keepdim=True)
    return (weight * tokens).to(tokens.dtype), routing_map.to(probs.dtype)


def start_aux_losses(model_chunks: list[nn.Module], scale: float) -> None:
    """A schedule's run begins: the gradient the auxiliary losses get (the schedule's factor
    on the main loss), and the global auxiliary loss's counts start over."""
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.aux_loss_scale = scale
                module.router.start_step()
