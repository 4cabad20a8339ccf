"""The feed-forward block: column-parallel up-projection, activation, row-parallel down."""

from __future__ import annotations

import torch
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from threefold.parallel.tensor_parallel.sharding import InitMethod


class MLP(nn.Module):
    """GELU (or squared-ReLU) MLP, or SwiGLU with gate and up projections stacked in
    `linear_fc1` as megatron-core stores them ([gate; up] in the full weight; each TP rank
    holds its slice of both)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
        ffn_hidden_size: int | None = None,
    ) -> None:
        """`ffn_hidden_size`: other than the config's (an MoE layer's shared expert)."""
        super().__init__()
        self.swiglu = config.swiglu
        self.squared_relu = config.squared_relu
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        fc1_size = ffn_hidden_size * (2 if self.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_size,
            parallel=parallel,
            bias=config.add_bias_linear,
            init_method=init_method,
            partition_stride=2 if self.swiglu else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size,
            config.hidden_size,
            parallel=parallel,
            bias=config.add_bias_linear,
            init_method=output_layer_init_method,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activated(hidden_states))

    def activated(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The activation of fc1's output: fc2's input."""
        fc1 = self.linear_fc1
        if self.swiglu and fc1.fp8 is not None:
            # An FP8 GEMM's backward casts its output's whole gradient: SwiGLU writes the two
            # blocks' gradients into one tensor (`swiglu_stacked`), not autograd's chunk.
            return KERNELS.swiglu_stacked(fc1(hidden_states))
        if self.swiglu:
            return KERNELS.swiglu(*fc1.forward_blocks(hidden_states))
        if self.squared_relu:
            return KERNELS.squared_relu(fc1(hidden_states))
        return KERNELS.gelu(fc1(hidden_states), self.gelu_approximation)
