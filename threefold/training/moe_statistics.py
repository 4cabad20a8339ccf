"""What the MoE layers routed, over a log window: Megatron's `load_balancing_loss` (and
`seq_load_balancing_loss`, `z_loss`) for the log line, and the tokens each expert received.

Each MoE layer sums its statistics over the micro-batches of an iteration
(model/moe/layer.py); after every iteration they are moved here, the losses divided by the
number of micro-batches, all without communication. A report reduces the window once, as
megatron-core's tracker does each iteration: summed over the tensor- and context-parallel
ranks (each routes a slice of the sequence) and the pipeline stages (each holds its own
layers), averaged over data-parallel replicas; the log line shows the mean over the MoE layers
per iteration (`global_load_balancing_loss` is summed over the replicas, whose shares make up
the global batch's loss). Token counts are summed over data-parallel replicas too: the global
batch's tokens per expert.

The step's counts are also what --moe-router-enable-expert-bias balances: as they arrive,
each such layer's router updates its biases from them (its own reduction over the stage's
ranks, every iteration; the router owns the biases and how they move).
"""

from __future__ import annotations

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.model.moe import MoELayer
from threefold.model.transformer import TransformerLayer
from threefold.parallel.parallel_context import ParallelContext


def tracked_losses(config: ModelConfig) -> list[str]:
    """The auxiliary losses the config computes, under megatron-core's names."""
    names = []
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type == "aux_loss":
        names.append("load_balancing_loss")
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type == "seq_aux_loss":
        names.append("seq_load_balancing_loss")
    if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type == "global_aux_loss":
        names.append("global_load_balancing_loss")
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


class MoEStatistics:
    def __init__(
        self, model_chunks: list[nn.Module], config: ModelConfig, parallel: ParallelContext
    ) -> None:
        self.parallel = parallel
        self.layers = [
            (module.layer_number, module.mlp)
            for chunk in model_chunks
            for module in chunk.modules()
            if isinstance(module, TransformerLayer) and isinstance(module.mlp, MoELayer)
        ]
        # Multi-token prediction layers follow the decoder's, each of the last one's kind
        # (model/mtp.py), and count as Megatron-LM counts them: among the MoE layers.
        pattern = config.layer_pattern_with_mtp()
        self.moe_layer_numbers = [i + 1 for i, moe in enumerate(pattern) if moe]
        self.names = tracked_losses(config)
        self.num_layers, self.num_experts = len(pattern), config.num_experts
        self._reset()

    def _reset(self) -> None:
        self.iterations = 0
        self.losses = torch.zeros(len(self.names), self.num_layers, dtype=torch.float64)
        self.tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)

    def after_iteration(self, num_microbatches: int) -> None:
        for number, layer in self.layers:
            statistics = layer.take_statistics()
            for row, name in enumerate(self.names):
                if name in statistics:
                    value = statistics[name].double().cpu() / num_microbatches
                    self.losses[row, number - 1] += value
            if "tokens_per_expert" in statistics:
                self.tokens[number - 1] += statistics["tokens_per_expert"].double().cpu()
                if layer.router.expert_bias is not None:  # the step's counts balance it
                    layer.router.update_expert_bias(statistics["tokens_per_expert"])
        self.iterations += 1

    def report(
        self, device: torch.device, reset: bool = True
    ) -> tuple[dict[str, float], torch.Tensor]:
        """({loss name: mean over MoE layers and iterations}, tokens per expert per iteration
        [layers, experts]) of the window, reduced over all ranks; every rank must call it. The
        window goes on unless `reset`."""
        parallel = self.parallel
        losses = self.losses.to(device)
        tokens = self.tokens.to(device)
        # The ranks that route slices of one sequence (TP under sequence parallelism, CP).
        parallel.tp_cp.all_reduce(losses)
        parallel.tp_cp.all_reduce(tokens)
        parallel.pp.all_reduce(losses)
        parallel.pp.all_reduce(tokens)
        parallel.dp.all_reduce(losses)
        parallel.dp.all_reduce(tokens)
        iterations = max(self.iterations, 1)
        # Averaged over replicas, except the global loss, whose replicas' shares sum to it
        # (megatron-core's reduce_group_has_dp).
        replicas = torch.tensor(
            [1 if name == "global_load_balancing_loss" else parallel.dp.size for name in self.names]
        )
        losses = losses.cpu() / replicas[:, None] / iterations
        tokens = tokens.cpu() / iterations
        layers = [n - 1 for n in self.moe_layer_numbers]
        means = {name: losses[row, layers].mean().item() for row, name in enumerate(self.names)}
        if reset:
            self._reset()
        return means, tokens[layers]
