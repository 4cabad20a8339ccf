"""What the layers that mix a sequence by a recurrence share (Gated DeltaNet's,
model/gated_delta_net.py, and Mamba's, model/mamba.py): the causal depthwise convolution
before the recurrence, and the exchange that gives each context-parallel rank the whole
sequence for a share of the heads.

Under context parallelism a rank holds two chunks of the sequence, but the convolution and the
recurrence run along all of it: as megatron-core does, the input projection's output is sent
all-to-all over CP, each rank receiving the whole sequence for 1/CP of its heads (Ulysses's
exchange, back in position order), and the output is sent back before the output projection.
Each rank uses its heads' rows of the per-head parameters (`cp_share`); their gradients are
summed over CP with the rest (the DP x CP gradient reduction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from threefold.parallel.context_parallel.attention import gather_sequence
from threefold.parallel.parallel_context import Group


def cp_share(tensor: torch.Tensor, sections: list[int], cp: Group) -> torch.Tensor:
    """This CP rank's heads' rows of a parameter split by heads (each of its `sections`)."""
    if cp.size == 1:
        return tensor
    parts = tensor.split(sections)
    return torch.cat([part.chunk(cp.size)[cp.rank] for part in parts])


def gather_heads(projected: torch.Tensor, sections: list[int], cp: Group) -> torch.Tensor:
    """[s, b, sum(sections)] this rank's tokens, each section split by heads -> [CP x s, b,
    sum(sections) / CP]: this CP rank's share of every section's heads for the whole
    sequence."""
    if cp.size == 1:
        return projected
    parts = projected.split(sections, dim=-1)
    parts = torch.cat([t.unflatten(-1, (cp.size, -1)) for t in parts], dim=-1)
    return gather_sequence(parts, cp)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x [s, b, channels] (weight [channels, 1,
    kernel]: each token sees itself and the kernel - 1 before it) as [b, s, channels]."""
    s = x.shape[0]
    x = F.conv1d(
        x.permute(1, 2, 0), weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0]
    )
    return F.silu(x[..., :s]).transpose(1, 2)
