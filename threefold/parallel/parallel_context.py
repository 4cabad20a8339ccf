"""The parallel context: every process group and rank this process uses, built once and passed.

Layers, schedules, the gradient buffer, optimizers, checkpointing and the training loop receive
a `ParallelContext` (or the one `Group` they need) instead of asking a global registry, so a
component written for one group works unchanged over another: the gradient buffer reduces over
whatever group it is given (`dp_cp` for dense weights, expert-DP when that exists).

    ParallelContext
      tp          tensor-parallel group (Megatron's rank order: TP varies fastest)
      pp          pipeline-parallel group (varies slowest; before DP with --use-tp-pp-dp-mapping)
      dp          data-parallel group: the replicas that read different samples
      cp          context-parallel group: the ranks that split each sample's sequence
      cp_a2a, cp_p2p  --cp-comm-type a2a+p2p's levels of cp: the all-to-all's consecutive
                  ranks, the ring's ranks at the same place of each (size 1 otherwise)
      dp_cp       DP x CP: the ranks holding the same weights, over which gradients are
                  averaged and the distributed optimizer shards (dp when CP is 1)
      tp_cp       TP x CP: the ranks that together hold one micro-batch's sequence under
                  sequence and context parallelism (an MoE router's token counts)
      ep          expert-parallel group: the ranks that split each MoE layer's experts, carved
                  out of TP x CP x DP of one pipeline stage (after expert TP)
      expert_tp   expert tensor-parallel group: the ranks that split each of those experts'
                  matrices (Megatron's ETP; varies fastest; the TP group when ETP = TP)
      expert_tp_ep  expert TP x EP: the ranks a token's expert computation is spread over,
                  over which the dispatcher exchanges tokens (rank = EP rank x ETP + ETP rank)
      expert_dp   the other ranks of the stage holding the same experts, over which expert
                  gradients are summed (scaled by 1 / DP x CP, as Megatron)
      dp_cp_intra, expert_dp_intra  the ranks one distributed-optimizer instance shards over
                  (--num-distributed-optimizer-instances; all of dp_cp / expert_dp at 1)
      dp_cp_inter, expert_dp_inter  the ranks at the same place of each instance, which
                  all-reduce their shards' gradients (size 1 with one instance)
      world       every rank
      embedding_group       first and last pipeline stage: holders of tied embeddings
      model_parallel_group  TP x PP: the ranks that together hold one model replica
      expert_model_parallel_group  ETP x EP x PP: the ranks that together hold every expert once
      sequence_parallel     activations between layers split along the sequence over TP
      tp_comm_overlap       the sequence-parallel linears' collectives overlapped with their
                            GEMMs (--tp-comm-overlap: tensor_parallel/comm_overlap.py)
      cp_comm_type          how attention exchanges keys/values over cp (p2p, allgather, a2a,
                            a2a+p2p)

`ParallelContext()` is one process: every size 1, every rank 0, no group. The context is built
from the groups `threefold.parallel.state` creates (in Megatron's rank order) by its
`parallel_context`, the one place that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """One parallel dimension as this rank sees it: its process group, size and rank."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over the group (nothing to do at size 1); returns `tensor`."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor


@dataclass(frozen=True)
class ParallelContext:
    tp: Group = field(default_factory=Group)
    pp: Group = field(default_factory=Group)
    dp: Group = field(default_factory=Group)
    cp: Group = field(default_factory=Group)
    cp_a2a: Group = field(default_factory=Group)
    cp_p2p: Group = field(default_factory=Group)
    dp_cp: Group = field(default_factory=Group)
    tp_cp: Group = field(default_factory=Group)
    ep: Group = field(default_factory=Group)
    expert_tp: Group = field(default_factory=Group)
    expert_tp_ep: Group = field(default_factory=Group)
    expert_dp: Group = field(default_factory=Group)
    dp_cp_intra: Group = field(default_factory=Group)
    dp_cp_inter: Group = field(default_factory=Group)
    expert_dp_intra: Group = field(default_factory=Group)
    expert_dp_inter: Group = field(default_factory=Group)
    world: Group = field(default_factory=Group)
    embedding_group: dist.ProcessGroup | None = None
    model_parallel_group: dist.ProcessGroup | None = None
    expert_model_parallel_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    cp_comm_type: str = "p2p"

    @property
    def is_first_pipeline_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_pipeline_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def pipeline_tensor_shape(
        self, seq_length: int, micro_batch_size: int, hidden_size: int
    ) -> tuple[int, int, int]:
        """What travels between pipeline stages: [sequence, micro-batch, hidden], the sequence
        divided over CP, and over TP under sequence parallelism."""
        sequence = seq_length // self.cp.size // (self.tp.size if self.sequence_parallel else 1)
        return (sequence, micro_batch_size, hidden_size)


# One process, no group: the default where a function may run without a layout.
ONE_DEVICE = Group()
