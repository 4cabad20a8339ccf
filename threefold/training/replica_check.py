"""`--check-weight-hash-across-dp-replicas-interval N` (Megatron-LM's flag): the ranks that hold
the same weights must hold the same bytes. `--test-mode` (also Megatron-LM's, which compares the
QK norms across TP and DP in every forward) checks every iteration, and compares the weights
each tensor-parallel rank holds whole across TP too.

Every N iterations, and once before the first, each rank digests each of its parameters (SHA-1
of its values as fp32, as megatron-core's `check_param_hashes_across_dp_replicas`), and the
replicas gather the digests: dense weights over DP x CP, experts over expert DP. A difference
means a replica's update went wrong (a bit flip, a reduction that skipped a rank, a
nondeterministic kernel in a place that must not have one); the run stops in one line naming
the first parameter that differs and the ranks that hold it, with the last checkpoint the last
good state. Digests run on the CPU: a check costs a copy of the rank's weights to the host.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from threefold.config import ConfigError
from threefold.parallel.parallel_context import Group, ParallelContext
from threefold.parallel.tensor_parallel.sharding import is_expert


class ReplicaMismatchError(RuntimeError):
    """Parameters that differ between data-parallel replicas."""


def parameter_digests(params: list[nn.Parameter]) -> torch.Tensor:
    """[len(params), 20] bytes: each parameter's SHA-1 over its values as fp32."""
    digests = [
        torch.frombuffer(
            bytearray(hashlib.sha1(p.detach().float().cpu().numpy().tobytes()).digest()),
            dtype=torch.uint8,
        )
        for p in params
    ]
    return torch.stack(digests) if digests else torch.empty(0, 20, dtype=torch.uint8)


def differing(named: list[tuple[str, nn.Parameter]], replicas: Group) -> list[tuple[str, list]]:
    """(name, the group ranks whose copy differs from group rank 0's) for every parameter of
    `named` whose digest is not the same on every rank of `replicas` (collective)."""
    if replicas.size == 1 or not named:
        return []
    mine = parameter_digests([p for _, p in named]).to(named[0][1].device)  # (NCCL: on the GPU)
    everyone = [torch.empty_like(mine) for _ in range(replicas.size)]
    dist.all_gather(everyone, mine, group=replicas.group)
    found = []
    for i, (name, _) in enumerate(named):
        others = [
            r for r in range(replicas.size) if not torch.equal(everyone[r][i], everyone[0][i])
        ]
        if others:
            found.append((name, others))
    return found


class ReplicaCheck:
    """Compares the replicas' weights every `interval` iterations (None: never)."""

    def __init__(
        self,
        interval: int | None,
        parallel: ParallelContext,
        params: list[nn.Parameter],
        across_tp: bool = False,
    ) -> None:
        """`across_tp` (--test-mode): the weights every tensor-parallel rank holds whole (norms,
        QK norms, row-parallel biases) are compared across TP (expert TP) as well."""
        if interval is not None and any(hasattr(p, "device_mesh") for p in params):
            raise ConfigError(
                "--check-weight-hash-across-dp-replicas-interval: FSDP2 shards every weight "
                "over the data-parallel ranks, so there are no replicas to compare; drop the "
                "flag or use --distributed-strategy megatron or ddp"
            )
        self.interval, self.parallel, self.across_tp = interval, parallel, across_tp

    def due(self, iteration: int) -> bool:
        return self.interval is not None and iteration % self.interval == 0

    def check(self, iteration: int, named: list[tuple[str, nn.Parameter]]) -> str:
        """Megatron-LM's line when every replica holds the same `named` parameters (this
        rank's, complete); ReplicaMismatchError on every rank otherwise, naming what differs
        wherever it was seen."""
        parallel, problems = self.parallel, []
        dense = [(n, p) for n, p in named if not is_expert(p)]
        experts = [(n, p) for n, p in named if is_expert(p)]
        checks = [(dense, parallel.dp_cp), (experts, parallel.expert_dp)]
        if self.across_tp:
            whole = [(n, p) for n, p in dense if not getattr(p, "tensor_model_parallel", False)]
            checks.append((whole, parallel.tp))
            whole = [(n, p) for n, p in experts if not getattr(p, "tensor_model_parallel", False)]
            checks.append((whole, parallel.expert_tp))
        for params, replicas in checks:
            members = dist.get_process_group_ranks(replicas.group) if replicas.size > 1 else []
            for name, ranks in differing(params, replicas):
                held = ", ".join(str(members[r]) for r in ranks)
                problems.append(f"{name} on rank{'s' if len(ranks) > 1 else ''} {held}")
        if parallel.world.size > 1:  # every rank stops, or none
            everyone: list = [None] * parallel.world.size
            dist.all_gather_object(everyone, problems, group=parallel.world.group)
            problems = sorted({p for part in everyone for p in part})
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ReplicaMismatchError(
                "--check-weight-hash-across-dp-replicas-interval: the weights of data-parallel "
                f"replicas differ after iteration {iteration}: {problems[0]}{more}, against "
                "the first replica's"
            )
        return f">>> Weight hashes match after {iteration} iterations..."
