"""The feed-forward block: column-parallel up-projection, activation, row-parallel down."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.kernels.dispatch import KERNELS
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from threefold.parallel.tensor_parallel.sharding import InitMethod


@dataclass(frozen=True)
class GLU:
    """A GLU MLP's activation of fc1's two halves (megatron-core's unfused `glu`): SwiGLU,
    silu(gate) * up, with --geglu gelu(gate) * up (Gemma's), or with --quick-geglu
    quick_gelu(gate) * (up + offset), the gate clamped to at most `clamp` and the linear half
    to [-clamp, clamp] (GPT-OSS's)."""

    quick: bool = False
    offset: float = 0.0
    clamp: float | None = None
    gelu: str | None = None  # --geglu: gelu(gate) with this approximation ("tanh" or "none")

    @classmethod
    def of(cls, config: ModelConfig) -> GLU | None:
        """The config's GLU, None for an MLP that is not one."""
        if not config.gated_linear_unit:
            return None
        gelu = ("tanh" if config.openai_gelu else "none") if config.geglu else None
        return cls(
            config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value, gelu
        )

    @property
    def swiglu(self) -> bool:
        """Plain SwiGLU: the kernels' (fused under --bias-swiglu-fusion)."""
        return not self.quick and self.gelu is None and self.offset == 0.0 and self.clamp is None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return KERNELS.swiglu(gate, up)
        if self.clamp is not None:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
        if self.gelu is not None:
            activated = F.gelu(gate, approximate=self.gelu)
        else:
            activated = gate * torch.sigmoid(1.702 * gate) if self.quick else F.silu(gate)
        return activated * (up + self.offset)


class MLP(nn.Module):
    """GELU (or squared-ReLU) MLP, or a GLU (SwiGLU, quick GeGLU) with gate and up
    projections stacked in `linear_fc1` as megatron-core stores them ([gate; up] in the full
    weight; each TP rank holds its slice of both)."""

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
        self.glu = GLU.of(config)
        self.squared_relu = config.squared_relu
        self.gelu_approximation = "tanh" if config.openai_gelu else "none"
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        fc1_size = ffn_hidden_size * (2 if self.glu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_size,
            parallel=parallel,
            bias=config.mlp_bias,
            init_method=init_method,
            partition_stride=2 if self.glu else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size,
            config.hidden_size,
            parallel=parallel,
            bias=config.mlp_bias,
            init_method=output_layer_init_method,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activated(hidden_states))

    def activated(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The activation of fc1's output: fc2's input."""
        fc1 = self.linear_fc1
        if self.glu and self.glu.swiglu and fc1.fp8 is not None:
            # An FP8 GEMM's backward casts its output's whole gradient: SwiGLU writes the two
            # blocks' gradients into one tensor (`swiglu_stacked`), not autograd's chunk.
            return KERNELS.swiglu_stacked(fc1(hidden_states))
        if self.glu:
            return self.glu(*fc1.forward_blocks(hidden_states))
        if self.squared_relu:
            return KERNELS.squared_relu(fc1(hidden_states))
        return KERNELS.gelu(fc1(hidden_states), self.gelu_approximation)
