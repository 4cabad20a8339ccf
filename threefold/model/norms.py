"""LayerNorm and RMSNorm, computed in fp32 whatever the activation dtype (as fused kernels do),
by the kernels chosen at start-up (`threefold.kernels.dispatch`)."""

from __future__ import annotations

import torch
from torch import nn

from threefold.kernels.dispatch import KERNELS
from threefold.parallel.sharding import constant_init, mark_replicated


class Norm(nn.Module):
    """`normalization` is Megatron's flag value: LayerNorm (weight and bias) or RMSNorm (weight).

    Under sequence parallelism each TP rank normalizes its own slice of the sequence, so the
    weights' gradients are partial sums: they are marked for an all-reduce over the TP group.
    """

    def __init__(self, hidden_size: int, normalization: str, eps: float,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.weight = mark_replicated(nn.Parameter(torch.empty(hidden_size)), constant_init(1.0),
                                      sequence_parallel)
        if normalization == "LayerNorm":
            self.bias = mark_replicated(nn.Parameter(torch.empty(hidden_size)),
                                        constant_init(0.0), sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalization == "LayerNorm":
            return KERNELS.layer_norm(x, self.weight, self.bias, self.eps)
        return KERNELS.rms_norm(x, self.weight, self.eps)
