"""Pre-norm transformer layer and the block of layers one pipeline stage holds."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.activation_offload import offload_group
from threefold.model.recompute import OutputDiscardingCheckpoint, checkpoint
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.random import get_rng_tracker
from threefold.parallel.tensor_parallel.sharding import InitMethod

if TYPE_CHECKING:  # (the spec builds Mamba layers, which add their outputs as this module does)
    from threefold.model.spec import LayerSpec


def dropout_add(
    x: torch.Tensor, residual: torch.Tensor, p: float, training: bool, sequence_parallel: bool
) -> torch.Tensor:
    """residual + dropout(x). Under sequence parallelism each TP rank holds a different slice of
    the sequence, so it draws its mask from its own stream; otherwise the activation is
    replicated over TP and the shared default stream keeps the masks equal."""
    if not training or p == 0.0:
        return residual + x
    fork = get_rng_tracker().fork() if sequence_parallel else contextlib.nullcontext()
    with fork:
        return residual + F.dropout(x, p=p, training=True)


def _no_norm(config: ModelConfig, size: int, partial_grads: bool) -> nn.Module:
    del config, size, partial_grads
    return nn.Identity()


class TransformerLayer(nn.Module):
    """norm -> self-attention -> residual, norm -> MLP -> residual (with --post-sublayer-norm a
    norm on each output before its residual; with --parallel-attention-mlp both read the
    layer's input); the parts from `spec`."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        spec: LayerSpec,
        layer_number: int,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # 1-based and global across pipeline stages
        self.hidden_dropout = config.hidden_dropout
        self.residual_multiplier = config.residual_multiplier  # (Granite's)
        self.parallel_attention_mlp = config.parallel_attention_mlp
        sequence_parallel = self.sequence_parallel = parallel.sequence_parallel
        # (--no-sublayer-input-norms: OLMo 2's layer, normed after its sublayers only)
        norm = spec.norm if config.sublayer_input_norms else _no_norm
        self.self_attention = self.mlp = None  # (a hybrid stack's layers have one of them)
        if (attention := spec.attention_of(layer_number)) is not None:
            self.input_layernorm = norm(config, config.hidden_size, sequence_parallel)
            self.self_attention = attention(config, parallel, init_method, output_layer_init_method)
        # (--parallel-attention-mlp-shared-norm: the MLP reads the attention's normed input)
        self.shares_norm = config.parallel_attention_mlp_shared_norm
        self.pre_mlp_layernorm = None
        if (mlp := spec.mlp_of(layer_number)) is not None:
            if not self.shares_norm:  # (before the MLP: the parameters' order is unchanged)
                self.pre_mlp_layernorm = norm(config, config.hidden_size, sequence_parallel)
            self.mlp = mlp(config, parallel, init_method, output_layer_init_method)
        # --post-sublayer-norm (Gemma 2/3): the attention's and the MLP's outputs normed too
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if config.post_sublayer_norm:
            self.post_self_attn_layernorm = spec.norm(config, config.hidden_size, sequence_parallel)
            self.post_mlp_layernorm = spec.norm(config, config.hidden_size, sequence_parallel)
        # Selective recomputation (config/recompute.py): the norms' outputs freed once the
        # attention and MLP have run; the MLP (dense or MoE) kept as its input only.
        self.recompute_layernorm = config.recomputes("layernorm")
        moe = layer_number in spec.moe_layers
        self.recompute_mlp = config.recomputes("moe" if moe else "mlp")
        # Fine-grained activation offloading (model/activation_offload.py): the norms' inputs.
        self.offload_attn_norm = config.offloads("attn_norm")
        self.offload_mlp_norm = config.offloads("mlp_norm")
        self.offload_layer = config.offloads_layers()

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # --cpu-offloading-num-layers: every layer a group (the first N offloaded)
        with offload_group("layer", self.offload_layer):
            return self._forward(hidden_states, rotary, attention_mask)

    def _forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.self_attention is None:  # (a hybrid stack's MLP-only layer)
            return self._mlp_part(hidden_states, hidden_states, None)
        recompute_norm = self.recompute_layernorm and self.training
        norm = OutputDiscardingCheckpoint(recompute_norm)
        with offload_group("attn_norm", self.offload_attn_norm):
            normed = attention_input = norm.checkpoint(self.input_layernorm, hidden_states)
        attention = self.self_attention(normed, rotary, attention_mask)
        norm.discard_output_and_register_recompute(attention)
        if self.post_self_attn_layernorm is not None:
            attention = self.post_self_attn_layernorm(attention)
        if self.residual_multiplier != 1.0:
            attention = attention * self.residual_multiplier
        layer_input = hidden_states
        hidden_states = dropout_add(
            attention, hidden_states, self.hidden_dropout, self.training, self.sequence_parallel
        )
        if self.mlp is None:  # (a hybrid stack's attention-only layer)
            return hidden_states
        # --parallel-attention-mlp (GPT-NeoX): the MLP reads the layer's input too
        mlp_input = layer_input if self.parallel_attention_mlp else hidden_states
        return self._mlp_part(mlp_input, hidden_states, attention_input)

    def _mlp_part(
        self,
        mlp_input: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """norm -> MLP -> residual onto `hidden_states` (`attention_input`: the attention's
        normed input, which --parallel-attention-mlp-shared-norm's MLP reads)."""
        recompute_norm = self.recompute_layernorm and self.training
        norm = OutputDiscardingCheckpoint(recompute_norm)
        if self.shares_norm:  # (config/cohere.py refuses recomputing the norm with it)
            normed = attention_input
        else:
            with offload_group("mlp_norm", self.offload_mlp_norm):
                normed = norm.checkpoint(self.pre_mlp_layernorm, mlp_input)
        if self.recompute_mlp and self.training:
            mlp = checkpoint(self.mlp, normed)
        else:
            mlp = self.mlp(normed)
        norm.discard_output_and_register_recompute(mlp)
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        if self.residual_multiplier != 1.0:
            mlp = mlp * self.residual_multiplier
        return dropout_add(
            mlp, hidden_states, self.hidden_dropout, self.training, self.sequence_parallel
        )


class TransformerBlock(nn.Module):
    """The layers `layer_offset + 1 .. layer_offset + num_layers` of the model, plus the final
    norm when this block ends the model."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        spec: LayerSpec,
        num_layers: int,
        layer_offset: int,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
        final_layernorm: bool,
    ) -> None:
        super().__init__()
        self.layer_offset = layer_offset
        full = config.recompute_granularity == "full"
        self.recompute_method = config.recompute_method if full else None
        self.recompute_num_layers = config.recompute_num_layers
        self.layers = nn.ModuleList(
            (spec.mamba_layer if spec.is_mamba(n) else TransformerLayer)(
                config, parallel, spec, n, init_method, output_layer_init_method
            )
            for n in range(layer_offset + 1, layer_offset + num_layers + 1)
        )
        self.final_layernorm = (
            spec.norm(config, config.hidden_size, parallel.sequence_parallel)
            if final_layernorm
            else None
        )

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, rotary, attention_mask):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, rotary, attention_mask)
            return hidden_states

        return run

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        count, every = len(self.layers), self.recompute_num_layers
        extra = (rotary, attention_mask)
        if not (self.training and self.recompute_method):
            hidden_states = self._run_layers(0, count)(hidden_states, *extra)
        elif self.recompute_method == "uniform":  # groups of `every` layers, each recomputed
            for start in range(0, count, every):
                hidden_states = checkpoint(
                    self._run_layers(start, start + every), hidden_states, *extra
                )
        else:  # "block": the first `every` layers recomputed, the others kept
            for index in range(count):
                run = self._run_layers(index, index + 1)
                hidden_states = (
                    checkpoint(run, hidden_states, *extra)
                    if index < every
                    else run(hidden_states, *extra)
                )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
