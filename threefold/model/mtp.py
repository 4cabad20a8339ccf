"""Multi-token prediction (Megatron-LM's --mtp-num-layers; DeepSeek-V3's MTP): D depths after
the decoder, each predicting one token further than the one before.

Depth k (1-based) takes h_{k-1}, the decoder's normalized output for k = 1, and the embeddings
of the input shifted left by k (the last k positions hold token 0 and leave the loss):

    h_k = final_layernorm(transformer_layer(eh_proj([enorm(embeddings); hnorm(h_{k-1})])))

and the shared output layer turns h_k into logits for the labels shifted by k. As in
megatron-core: the positions shift with the tokens (learned position embeddings see them),
RoPE's do not; `eh_proj` is column-parallel, its output gathered over TP (and split again
along the sequence under sequence parallelism); the transformer layer is the last decoder
layer's kind (MoE when that one is). Names are megatron-core's: `mtp.layers.{k-1}.enorm`, ...
In a hybrid model (config/hybrid.py) a depth's layers are the pattern's after `/`, a stack in
place of the transformer layer (megatron-core's HybridStack, `mtp_model_layer.layers.{j}`),
numbered after the decoder's and the earlier depths'.

The loss of depth k is its mean over the shifted loss mask (its sum under
--calculate-per-token-loss). It is not returned: it is attached to the main hidden states,
whose backward gives it the gradient (--mtp-loss-scaling-factor / D) times the schedule's factor
on the main loss (`aux_loss_scale`, as the MoE auxiliary losses get, model/moe/layer.py), as
megatron-core's MTPLossAutoScaler does. Each depth's value is kept for the log (`mtp_1 loss`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.model.aux_loss import attach_losses
from threefold.model.spec import LayerSpec
from threefold.model.transformer import TransformerBlock, TransformerLayer
from threefold.parallel.context_parallel.sequence import shift_left
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear
from threefold.parallel.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from threefold.parallel.tensor_parallel.sharding import InitMethod


class MultiTokenPredictionLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        spec: LayerSpec,
        depth: int,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        hidden, sequence_parallel = config.hidden_size, parallel.sequence_parallel
        self.tp, self.sequence_parallel = parallel.tp, sequence_parallel
        self.enorm = spec.norm(config, hidden, sequence_parallel)
        self.hnorm = spec.norm(config, hidden, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(
            2 * hidden, hidden, parallel=parallel, bias=False, init_method=init_method
        )
        last = config.num_layers
        self.transformer_layer = self.mtp_model_layer = None
        if config.hybrid:  # (the layers' kinds are in the spec: model/spec.py)
            count = len(config.hybrid_mtp_layers())
            self.mtp_model_layer = TransformerBlock(
                config,
                parallel,
                spec,
                count,
                last + (depth - 1) * count,
                init_method,
                output_layer_init_method,
                final_layernorm=False,
            )
        else:
            number = last + depth  # megatron-core numbers the MTP layers after the decoder's
            if last in spec.moe_layers:  # the last decoder layer's kind
                spec = dataclasses.replace(spec, moe_layers=spec.moe_layers | {number})
            self.transformer_layer = TransformerLayer(
                config, parallel, spec, number, init_method, output_layer_init_method
            )
        self.final_layernorm = spec.norm(config, hidden, sequence_parallel)

    def forward(
        self,
        embeddings: torch.Tensor,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        both = torch.cat([self.enorm(embeddings), self.hnorm(hidden_states)], dim=-1)
        hidden_states = gather_from_tensor_parallel_region(self.eh_proj(both), self.tp)
        if self.sequence_parallel:
            hidden_states = scatter_to_sequence_parallel_region(hidden_states, self.tp)
        layers = self.transformer_layer
        if layers is None:  # (a hybrid depth's stack)
            layers = self.mtp_model_layer
        return self.final_layernorm(layers(hidden_states, rotary, attention_mask))

    def inner_layers(self) -> list[nn.Module]:
        """The depth's transformer layer, or its hybrid stack's layers."""
        if self.transformer_layer is not None:
            return [self.transformer_layer]
        return list(self.mtp_model_layer.layers)


class MultiTokenPredictionBlock(nn.Module):
    """The --mtp-num-layers depths, on the last pipeline stage."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        spec: LayerSpec,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        # (--mtp-use-repeated-layer: the first depth's layer runs for every depth)
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(
                config, parallel, spec, depth, init_method, output_layer_init_method
            )
            for depth in range(1, config.mtp_depths_built() + 1)
        )
        self.depths = config.mtp_num_layers
        self.weight = config.mtp_loss_scaling_factor / config.mtp_num_layers
        self.vocab_size, self.tp, self.cp = config.vocab_size, parallel.tp, parallel.cp
        # Set by the trainer each step (training/mtp_losses.py).
        self.aux_loss_scale, self.per_token_loss = 1.0, False
        self._losses: torch.Tensor | None = None  # per depth, summed over micro-batches

    def forward(
        self,
        hidden_states: torch.Tensor,
        batch: dict[str, torch.Tensor | None],
        embedding: nn.Module,
        output_layer,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The main hidden states, with each depth's loss attached for the backward pass.
        `batch`: the micro-batch's `tokens`, `labels`, and `loss_mask`, `position_ids`,
        `attention_mask` or None (all ones; 0..s-1; causal). Per-document positions and
        attention apply to every depth, and the shift runs over document boundaries, as in
        megatron-core without packed-sequence parameters."""
        input_ids, labels = batch["tokens"], batch["labels"]
        positions, loss_mask = batch.get("position_ids"), batch.get("loss_mask")
        if positions is None:
            sequence = input_ids.shape[1]
            positions = torch.arange(sequence, device=input_ids.device).expand_as(input_ids)
        loss_mask = torch.ones_like(labels) if loss_mask is None else loss_mask
        main, depth_hidden, losses = hidden_states, hidden_states, []
        cp = self.cp
        for depth in range(self.depths):
            layer = self.layers[min(depth, len(self.layers) - 1)]
            input_ids, positions, labels, loss_mask = shift_left(
                [input_ids, positions, labels, loss_mask], cp
            )
            embeddings = embedding(input_ids, positions)
            depth_hidden = layer(embeddings, depth_hidden, rotary, batch.get("attention_mask"))
            per_token = KERNELS.cross_entropy(
                output_layer(depth_hidden), labels.t(), self.vocab_size, self.tp
            ).t()
            total = (per_token.float() * loss_mask).sum()
            # Under CP this rank's share of the micro-batch's loss: a mean over the whole
            # micro-batch's tokens (megatron-core divides by each rank's own count), which
            # `aux_loss_scale` multiplies by CP as the main loss is (training/trainer.py).
            whole = cp.all_reduce(torch.stack((total.detach(), loss_mask.sum().float())))
            count = whole[1].clamp(min=1)
            loss = total if self.per_token_loss else total / count
            main = attach_losses(main, self.weight * self.aux_loss_scale, loss)
            losses.append(whole[0] / count)  # logged as a mean in either case, as Megatron
        values = torch.stack(losses)
        self._losses = values if self._losses is None else self._losses + values
        return main

    def take_losses(self) -> torch.Tensor | None:
        """Each depth's loss summed over the micro-batches since the last call (on this rank)."""
        losses, self._losses = self._losses, None
        return losses
