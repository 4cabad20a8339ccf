"""Mamba-2, the M layers of a hybrid model (megatron-core's `MambaLayer` and `MambaMixer`;
Nemotron-H's), built from --hybrid-layer-pattern (config/hybrid.py):

    hidden ─ norm ─ in_proj ─┬─ x, B, C ─ causal conv1d ─ SiLU ─┐
                             ├─ dt ─ softplus(dt + dt_bias) ────┤ SSD scan, + D x (kernels/ssd.py)
                             │       A = -exp(A_log) ───────────┘
                             └─ z ───────── norm(y x SiLU(z)), by group ─ out_proj ─ + hidden

`in_proj` holds megatron-core's sections [z; x; B; C; dt] in its full weight; each is split
over the TP ranks by heads or groups (`partition_sizes`), so every rank projects, convolves and
scans for its own heads, and `out_proj` is row-parallel, as attention's are. The gated norm
is an RMSNorm over each group's share of the heads (megatron-core's `RMSNormGated`, its
eps 1e-5, the gate applied before the norm). It has no linear biases; the convolution has
one. Packed documents (the attention's mask) are convolved and scanned each alone, as
megatron-core's packed sequences are. Under context parallelism each rank scans a share of
the heads over the whole sequence (model/sequence_mixing.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.config.hybrid import MAMBA_CONV_KERNEL
from threefold.kernels.ssd import chunk_ssd
from threefold.model.activation_offload import offload_group
from threefold.model.recompute import checkpoint
from threefold.model.sequence_mixing import (
    A_INIT_RANGE,
    causal_conv1d,
    cp_share,
    depthwise_conv,
    document_ids,
    gather_heads,
    in_projection,
    out_projection,
    split_vector,
)
from threefold.model.transformer import dropout_add
from threefold.parallel.context_parallel.attention import scatter_sequence
from threefold.parallel.parallel_context import ParallelContext
from threefold.parallel.tensor_parallel.sharding import InitMethod, constant_init, log_uniform_init

# megatron-core's MambaMixer: step sizes softplus(dt_bias) log-uniform in [0.001, 0.1], at
# least 1e-4 (its decay rates as the gated delta net's: A_INIT_RANGE); the gated norm's eps
DT_RANGE, DT_FLOOR = (1e-3, 1e-1), 1e-4
GATED_NORM_EPS = 1e-5


def _dt_bias_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """softplus^-1 of a step size drawn log-uniformly from DT_RANGE."""
    low, high = (math.log(x) for x in DT_RANGE)
    dt = torch.rand(tensor.shape, generator=generator) * (high - low) + low
    dt = dt.exp().clamp(min=DT_FLOOR)
    tensor.copy_(dt + torch.log(-torch.expm1(-dt)))


class MambaMixer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        tp, self.cp = parallel.tp.size, parallel.cp
        sections = config.mamba_sections()
        inner, states, heads = sections[1], sections[2], sections[4]
        self.head_dim, self.state_dim = config.mamba_head_dim, config.mamba_state_dim
        # what this rank scans: its TP rank's heads and groups, of those its CP rank's share
        self.heads = heads // tp // self.cp.size
        self.groups = config.mamba_num_groups // tp // self.cp.size
        self.tp_sections = [size // tp for size in sections]  # in_proj's output on this rank
        self.local_sections = [size // self.cp.size for size in self.tp_sections]
        self.in_proj = in_projection(config, parallel, sections, init_method)
        # Depthwise over x, B and C, with a bias
        self.conv1d = depthwise_conv((inner, states, states), MAMBA_CONV_KERNEL, tp, bias=True)
        for name, init in (
            ("dt_bias", _dt_bias_init),
            ("A_log", log_uniform_init(*A_INIT_RANGE)),
            ("D", constant_init(1.0)),
        ):
            setattr(self, name, split_vector(heads, tp, init))
        self.norm = nn.Module()  # (megatron-core's `mixer.norm.weight`)
        self.norm.weight = split_vector(inner, tp, constant_init(1.0))
        self.out_proj = out_projection(inner, config, parallel, output_layer_init_method)

    def linear_layers(self) -> list[nn.Module]:
        """The layer's linear layers (those FP8 runs: model/fp8.py)."""
        return [self.in_proj, self.out_proj]

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm(y x SiLU(z)) over each group's channels, in fp32; [b, s, channels]."""
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (self.groups, -1))
        normed = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + GATED_NORM_EPS)
        weight = cp_share(self.norm.weight, [self.norm.weight.shape[0]], self.cp)
        return (normed.flatten(-2) * weight.float()).to(y.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del rotary  # no positions: the convolution and the scan are causal
        documents = document_ids(attention_mask)  # (packed: each convolved and scanned alone)
        projected = self.in_proj(hidden_states)  # [s, b, this TP rank's sections]
        projected = gather_heads(projected, self.tp_sections, self.cp)  # (CP: all tokens)
        z, x, B, C, dt = projected.split(self.local_sections, dim=-1)
        conv = self.tp_sections[1:4]
        weight, bias = (cp_share(t, conv, self.cp) for t in (self.conv1d.weight, self.conv1d.bias))
        x, B, C = causal_conv1d(torch.cat((x, B, C), dim=-1), weight, bias, documents).split(
            self.local_sections[1:4], dim=-1
        )
        per_head = (self.dt_bias, self.A_log, self.D)
        dt_bias, a_log, skip = (cp_share(t, [t.shape[0]], self.cp) for t in per_head)
        dt = F.softplus(dt.transpose(0, 1).float() + dt_bias.float())  # [b, s, heads]
        scan = (
            x.unflatten(-1, (self.heads, self.head_dim)),
            dt,
            -a_log.float().exp(),
            B.unflatten(-1, (self.groups, self.state_dim)),
            C.unflatten(-1, (self.groups, self.state_dim)),
            skip.float(),
            documents,
        )
        # The scan's per-chunk blocks (three fp32 C x C a head) and padded copies are
        # recomputed in backward from its inputs, as mamba_ssm's kernels recompute theirs:
        # kept, they were 5.9 GB a layer at Nemotron-H 8B's shape and 8,192 tokens.
        y = checkpoint(chunk_ssd, *scan) if torch.is_grad_enabled() else chunk_ssd(*scan)
        y = self._gated_norm(y.flatten(2), z.transpose(0, 1)).transpose(0, 1)
        if self.cp.size > 1:
            y = scatter_sequence(y, self.cp)
        return self.out_proj(y)


class MambaLayer(nn.Module):
    """norm -> Mamba mixer -> residual (megatron-core's `MambaLayer`: its `norm` and `mixer`)."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        spec,
        layer_number: int,
        init_method: InitMethod,
        output_layer_init_method: InitMethod,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # 1-based and global across pipeline stages
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = parallel.sequence_parallel
        self.norm = spec.norm(config, config.hidden_size, self.sequence_parallel)
        self.mixer = MambaMixer(config, parallel, init_method, output_layer_init_method)
        self.offload_layer = config.offloads_layers()
        self.residual_multiplier = config.residual_multiplier  # (Granite 4.0's)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with offload_group("layer", self.offload_layer):
            mixed = self.mixer(self.norm(hidden_states), rotary, attention_mask)
            if self.residual_multiplier != 1.0:
                mixed = mixed * self.residual_multiplier
            return dropout_add(
                mixed, hidden_states, self.hidden_dropout, self.training, self.sequence_parallel
            )
