"""LayerNorm and RMSNorm, computed in fp32 whatever the activation dtype (as fused kernels do),
by the kernels chosen at start-up (`threefold.kernels.dispatch`); the L2 norm of Llama 4's
queries and keys, an RMSNorm without a weight; OLMo 2's query and key norms over all heads
together, and Command R+'s over each head with a weight of its own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce

from threefold.kernels.dispatch import KERNELS
from threefold.parallel.parallel_context import Group
from threefold.parallel.tensor_parallel.sharding import (
    constant_init,
    mark_replicated,
    mark_tensor_parallel,
)


class Norm(nn.Module):
    """`normalization` is Megatron's flag value: LayerNorm (weight and bias) or RMSNorm (weight).

    Under sequence parallelism each TP rank normalizes its own slice of the sequence, so the
    weights' gradients are partial sums: they are marked for an all-reduce over the TP group
    (`partial_grads`; also for query/key norms, whose heads are split over the TP ranks).

    `zero_centered_gamma` (--apply-layernorm-1p): the weight starts at 0 and scales by
    (1 + weight). `bias` False (--no-layernorm-bias): a LayerNorm of a weight only (Cohere's).
    """

    def __init__(
        self,
        hidden_size: int,
        normalization: str,
        eps: float,
        partial_grads: bool = False,
        zero_centered_gamma: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.normalization = normalization
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = mark_replicated(
            nn.Parameter(torch.empty(hidden_size)),
            constant_init(0.0 if zero_centered_gamma else 1.0),
            partial_grads,
        )
        if normalization == "LayerNorm" and bias:
            self.bias = mark_replicated(
                nn.Parameter(torch.empty(hidden_size)), constant_init(0.0), partial_grads
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        if self.normalization == "LayerNorm":
            return KERNELS.layer_norm(x, weight, self.bias, self.eps)
        return KERNELS.rms_norm(x, weight, self.eps)


class L2Norm(nn.Module):
    """x scaled to unit RMS over its last dimension, in fp32, with no weight (megatron-core's
    `L2Norm`, --qk-l2-norm)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class AcrossHeadsRMSNorm(nn.Module):
    """RMSNorm of a projection's heads together, [s, b, heads, d] over heads x d (OLMo 2's
    query and key norms, --qk-layernorm-across-heads). Under TP each rank holds its heads and
    their share of the weight (split like the projection's rows); the squares' sum is summed
    over the TP group, in both directions of autograd (every rank's output depends on every
    rank's input)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp: Group) -> None:
        super().__init__()
        self.eps, self.tp, self.width = eps, tp, heads * head_dim
        local = heads // tp.size * head_dim
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(local)), 0, constant_init(1.0), (self.width,)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = all_reduce(squares, group=self.tp.group)
        normed = flat * torch.rsqrt(squares / self.width + self.eps) * self.weight.float()
        return normed.to(x.dtype).view_as(x)


class PerHeadNorm(nn.Module):
    """A norm of each head of a projection, [s, b, heads, d] over d, with a weight (and a
    LayerNorm's bias) of its own for each head (Command R+'s query and key norms,
    --qk-layernorm-per-head). Under TP each rank holds its heads' rows, split like the
    projection's; a head's statistics are its own, so nothing is summed over TP. The
    weights are kept flat, [heads x d]: norm weights, which weight decay and Muon leave alone
    as they leave every vector."""

    def __init__(self, heads: int, head_dim: int, config, tp: Group) -> None:
        super().__init__()
        self.normalization, self.eps, self.head_dim = (
            config.normalization,
            config.norm_epsilon,
            head_dim,
        )
        local, width = heads // tp.size * head_dim, heads * head_dim
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(local)), 0, constant_init(1.0), (width,)
        )
        self.bias = None
        if config.normalization == "LayerNorm" and config.layernorm_bias:
            self.bias = mark_tensor_parallel(
                nn.Parameter(torch.empty(local)), 0, constant_init(0.0), (width,)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.head_dim,)
        if self.normalization == "LayerNorm":
            normed = F.layer_norm(x.float(), shape, eps=self.eps)
        else:
            normed = F.rms_norm(x.float(), shape, eps=self.eps)
        normed = normed * self.weight.float().view(-1, self.head_dim)
        if self.bias is not None:
            normed = normed + self.bias.float().view(-1, self.head_dim)
        return normed.to(x.dtype)


def build_norm(config, size: int, partial_grads: bool = False) -> Norm:
    """The model's kind of norm (`--normalization`, `--norm-epsilon`, `--apply-layernorm-1p`,
    `--no-layernorm-bias`) over `size` features."""
    return Norm(
        size,
        config.normalization,
        config.norm_epsilon,
        partial_grads,
        config.apply_layernorm_1p,
        config.layernorm_bias,
    )
