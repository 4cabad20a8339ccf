"""LoRA adapters on the tensor-parallel linear layers (`--lora-rank` and friends).

An adapter adds (alpha / rank) * B A x to a frozen layer's output, with A: rank x in and
B: out x rank, B starting at zero so the model starts unchanged. On a tensor-parallel layer the
adapter is split the way the layer is, so its output adds to the layer's before any collective:
- column-parallel (QKV, fc1): A is replicated and B split by rows like the weight (fc1's
  [gate; up] stride included); each rank's A gradient covers only its B rows, so it is summed
  over the TP group (marked like a sequence-parallel parameter);
- row-parallel (proj, fc2): A is split by columns like the weight and B replicated; the adapter's
  output is a partial sum that the layer's all-reduce (or reduce-scatter) completes, and B's
  gradient is likewise summed over TP.
An MoE expert's fc1/fc2 (on the one EP rank that holds the expert) get adapters split over
the expert-TP group the same way, handled as expert weights: reduced over expert DP, the
replicated factor summed over expert TP, not TP (--lora-freeze-experts: none). In multi-latent
attention the target linear_qkv means the column-parallel projections to queries, keys and
values (`MLA_QKV`); in a gated delta net linear_qkv means its in_proj (B split by heads in each
of its sections, as the weight) and linear_proj its out_proj (`GATED_DELTA_NET`). Names follow
Megatron-Bridge: `<layer>.adapter.linear_in.weight` (A) and `<layer>.adapter.linear_out.weight`
(B). `merged_weights` folds them into the weights for export.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from threefold.parallel.tensor_parallel.random import (
    EXPERT_MODEL_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    get_rng_tracker,
)
from threefold.parallel.tensor_parallel.sharding import (
    constant_init,
    mark_replicated,
    mark_tensor_parallel,
    normal_init,
)

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoRAAdapter(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        rank: int,
        alpha: float,
        dropout: float,
        row_parallel: bool,
        tp: int,
        partition_stride: int = 1,
        partition_sizes: tuple[int, ...] | None = None,
        expert: bool = False,
    ) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.dropout = dropout
        self.row_parallel = row_parallel
        # The stream its dropout draws from (parallel/tensor_parallel/random.py): a row-parallel
        # layer's input differs per (expert) TP rank, so do its masks; a column-parallel one's
        # is shared, so are they. None: the default stream.
        if expert:
            self.stream = EXPERT_PARALLEL_RNG if row_parallel else EXPERT_MODEL_PARALLEL_RNG
        else:
            self.stream = MODEL_PARALLEL_RNG if row_parallel else None
        init_a = normal_init(1.0 / math.sqrt(input_size))
        # The replicated factor's gradient is each TP rank's share, summed over TP (over
        # expert TP for an expert's); a whole adapter (tp 1) must not be summed again.
        partial = tp > 1
        if row_parallel:
            self.linear_in = nn.Linear(input_size // tp, rank, bias=False)
            mark_tensor_parallel(
                self.linear_in.weight,
                partition_dim=1,
                init_method=init_a,
                master_shape=(rank, input_size),
            )
            self.linear_out = nn.Linear(rank, output_size, bias=False)
            mark_replicated(self.linear_out.weight, constant_init(0.0), partial_grads=partial)
        else:
            self.linear_in = nn.Linear(input_size, rank, bias=False)
            mark_replicated(self.linear_in.weight, init_a, partial_grads=partial)
            self.linear_out = nn.Linear(rank, output_size // tp, bias=False)
            mark_tensor_parallel(
                self.linear_out.weight,
                partition_dim=0,
                init_method=constant_init(0.0),
                master_shape=(output_size, rank),
                partition_stride=partition_stride,
                partition_sizes=partition_sizes,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            fork = (
                contextlib.nullcontext()
                if self.stream is None
                else get_rng_tracker().fork(self.stream)
            )
            with fork:
                x = F.dropout(x, p=self.dropout, training=True)
        return self.linear_out(self.linear_in(x)) * self.scale


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    freeze_experts: bool = False,
) -> None:
    """Add adapters to the target layers and freeze every other parameter (routers always;
    MoE experts keep no adapters with `freeze_experts`)."""
    from threefold.model.moe.experts import ExpertLinear
    from threefold.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for param in model.parameters():
        param.requires_grad_(False)
    if "linear_qkv" in targets:  # a multi-latent attention's projections to query, key, value
        targets = [*targets, *MLA_QKV]
    targets = [*targets, *(GATED_DELTA_NET[t] for t in targets if t in GATED_DELTA_NET)]
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        if isinstance(module, ExpertLinear):
            if freeze_experts:
                continue
            # Split over the expert-TP group as the expert is, on the one EP rank that holds
            # it, reduced as expert weights (the replicated factor summed over expert TP).
            module.adapter = LoRAAdapter(
                module.input_size,
                module.output_size,
                rank,
                alpha,
                dropout,
                row_parallel=module.row_parallel,
                tp=module.expert_tp_size,
                partition_stride=module.weight.partition_stride,
                expert=True,
            )
            for param in module.adapter.parameters():
                param.expert_parallel = True
        elif isinstance(module, RowParallelLinear):
            module.adapter = LoRAAdapter(
                module.input_size,
                module.output_size,
                rank,
                alpha,
                dropout,
                row_parallel=True,
                tp=module.tp.size,
            )
        elif isinstance(module, ColumnParallelLinear):
            module.adapter = LoRAAdapter(
                module.input_size,
                module.output_size,
                rank,
                alpha,
                dropout,
                row_parallel=False,
                tp=module.tp.size,
                partition_stride=module.partition_stride,
                partition_sizes=getattr(module.weight, "partition_sizes", None),
            )


# The column-parallel layers of multi-latent attention that --lora-target-modules linear_qkv
# adapts (model/mla.py); its down projections, small and whole on every TP rank, keep none.
MLA_QKV = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
# A gated delta net's projections that linear_qkv and linear_proj adapt (model/gated_delta_net.py)
GATED_DELTA_NET = {"linear_qkv": "in_proj", "linear_proj": "out_proj"}


def is_adapter(name: str) -> bool:
    return ".adapter." in name


@torch.no_grad()
def merged_weights(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Full tensors by name with every adapter folded into its layer: W + scale * B A."""
    merged = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name in state:
        if name.endswith(".adapter.linear_in.weight"):
            layer = name.removesuffix(".adapter.linear_in.weight")
            delta = state[f"{layer}.adapter.linear_out.weight"] @ state[name]
            merged[f"{layer}.weight"] = merged[f"{layer}.weight"] + scale * delta
    return merged
