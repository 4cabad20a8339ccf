"""What the layers that mix a sequence by a recurrence share (Gated DeltaNet's,
model/gated_delta_net.py, and Mamba's, model/mamba.py): their projections and parameters split
over TP by heads, the causal depthwise convolution before the recurrence, and the exchange
that gives each context-parallel rank the whole sequence for a share of the heads.

Under context parallelism a rank holds two chunks of the sequence, but the convolution and the
recurrence run along all of it: as megatron-core does, the input projection's output is sent
all-to-all over CP, each rank receiving the whole sequence for 1/CP of its heads (Ulysses's
exchange, back in position order), and the output is sent back before the output projection.
Each rank uses its heads' rows of the per-head parameters (`cp_share`); their gradients are
summed over CP with the rest (the DP x CP gradient reduction).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.parallel.context_parallel.attention import gather_sequence
from threefold.parallel.context_parallel.masks import derived
from threefold.parallel.context_parallel.sequence import Documents
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from threefold.parallel.tensor_parallel.sharding import (
    InitMethod,
    mark_tensor_parallel,
    uniform_init,
)

# megatron-core's A_init_range, both layers': the decay rates exp(A_log) start uniform in [1, 16]
A_INIT_RANGE = (1.0, 16.0)


def in_projection(
    config: ModelConfig, parallel: ParallelContext, sections: list[int], init: InitMethod
) -> ColumnParallelLinear:
    """`in_proj`: megatron-core's sections in one weight, each split over TP by heads
    (`partition_sizes`), so every rank projects for its own heads; no bias."""
    return ColumnParallelLinear(
        config.hidden_size,
        sum(sections),
        parallel=parallel,
        bias=False,
        init_method=init,
        partition_sizes=sections,
    )


def out_projection(
    width: int, config: ModelConfig, parallel: ParallelContext, init: InitMethod
) -> RowParallelLinear:
    """`out_proj`: row-parallel from the heads' `width`, as attention's; no bias."""
    hidden = config.hidden_size
    return RowParallelLinear(width, hidden, parallel=parallel, bias=False, init_method=init)


def depthwise_conv(conv: tuple[int, ...], kernel: int, tp: int, bias: bool) -> nn.Module:
    """`conv1d`: the depthwise causal convolution's weight (and bias) over the sections `conv`,
    each split over TP by heads; PyTorch's default Conv1d init (a bound of 1/sqrt(fan_in)),
    which megatron-core keeps."""
    conv1d, init = nn.Module(), uniform_init(1 / math.sqrt(kernel))
    shapes = [("weight", (sum(conv), 1, kernel))] + ([("bias", (sum(conv),))] if bias else [])
    for name, shape in shapes:
        parameter = nn.Parameter(torch.empty(shape[0] // tp, *shape[1:]))
        parameter = mark_tensor_parallel(parameter, 0, init, shape, partition_sizes=conv)
        setattr(conv1d, name, parameter)
    return conv1d


def split_vector(size: int, tp: int, init: InitMethod) -> nn.Parameter:
    """A parameter of one value a head (or channel), split over TP."""
    return mark_tensor_parallel(nn.Parameter(torch.empty(size // tp)), 0, init, (size,))


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


def document_ids(attention_mask) -> torch.Tensor | None:
    """The [b, s] ids of the packed documents the attention's mask stands for, in position
    order over the whole sequence (None: each sequence one document): from a [b, 1, s, s]
    mask, a new document wherever a token may not attend to the one before it; from CP's
    `Documents`, their ids (made once a mask, masks.py)."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, Documents):
        return derived(attention_mask.ranks, "document ids", attention_mask.whole)

    def build() -> torch.Tensor:
        follows = attention_mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # [b, s - 1]
        starts = torch.cat([torch.zeros_like(follows[:, :1]), ~follows], dim=1)
        return starts.long().cumsum(dim=1)

    return derived(attention_mask, "document ids", build)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of x [s, b, channels] (weight [channels, 1,
    kernel]: each token sees itself and the kernel - 1 before it) as [b, s, channels]; with
    `documents` ([b, s] ids of packed documents), each document's alone."""
    s, kernel = x.shape[0], weight.shape[-1]
    if documents is None:
        x = F.conv1d(x.permute(1, 2, 0), weight, bias, padding=kernel - 1, groups=weight.shape[0])
        return F.silu(x[..., :s]).transpose(1, 2)
    # kernel - 1 zero columns between the documents (the padding one of its own would get),
    # one convolution, and each token's output read back from where it was put
    b = x.shape[1]

    def build() -> tuple[torch.Tensor, torch.Tensor, int]:  # (once a micro-batch: one sync)
        starts = documents[:, 1:] != documents[:, :-1]
        index = torch.cat([torch.zeros_like(starts[:, :1]), starts], dim=1).long().cumsum(dim=1)
        where = torch.arange(s, device=x.device) + (kernel - 1) * index  # [b, s]
        rows = torch.arange(b, device=x.device)[:, None].expand(b, s)
        return where, rows, s + (kernel - 1) * int(index[:, -1].max())

    where, rows, length = derived(documents, ("spread", kernel), build)
    spread = x.new_zeros(b, length, x.shape[-1]).index_put((rows, where), x.transpose(0, 1))
    out = F.conv1d(spread.transpose(1, 2), weight, bias, padding=kernel - 1, groups=weight.shape[0])
    return F.silu(out.transpose(1, 2)[rows, where])
