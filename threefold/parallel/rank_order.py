"""Megatron's rank order: which global ranks form each parallel group.

A layout puts the ranks on a grid whose dimensions vary, fastest first, in the order

    tp, cp, ep, dp, pp

(megatron-core's default `order="tp-cp-ep-dp-pp"`): rank = tp_rank + TP x (cp_rank + CP x
(dp_rank + DP x pp_rank)). Megatron-LM's `--use-tp-pp-dp-mapping` swaps the last two
(`"tp-cp-ep-pp-dp"`): a model replica's TP x CP x PP ranks are then consecutive, so its
pipeline's point-to-point traffic stays inside a node and only the DP reductions leave it.

A group of one or more dimensions ("tp-cp") holds the ranks that differ only along those; its
members are in rank order, and the groups are ordered by their first rank, as megatron-core's
`RankGenerator.get_ranks` lists them (tests/parallel/test_rank_order.py compares the two), so
a rank holds the same shard here as in Megatron-LM and a checkpoint's files line up with its
layout.

Two grids share the pipeline dimension: the dense one (TP, CP, DP, PP; no EP), and the experts'
(expert TP, EP, expert DP, PP; no CP), which carves the same ranks of each pipeline stage into
expert-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"  # --use-tp-pp-dp-mapping
ORDER = tuple(DEFAULT_ORDER.split("-"))


def rank_groups(sizes: dict[str, int], members: str, order: str = DEFAULT_ORDER) -> list[list[int]]:
    """Every group of the grid of `sizes` (dimension -> size; a missing one is 1), its
    dimensions varying fastest first in `order`, along the dimensions `members` names ("tp",
    "dp-cp"); each group in rank order, the groups ordered by first rank."""
    dimensions = order.split("-")
    if sorted(dimensions) != sorted(ORDER):
        raise ValueError(f"rank_groups: order {order!r} is not an order of {ORDER}")
    inside = members.split("-")
    unknown = [name for name in [*inside, *sizes] if name not in ORDER]
    if unknown:
        raise ValueError(f"rank_groups: unknown dimension {unknown[0]!r}; known: {ORDER}")
    shape = [sizes.get(name, 1) for name in dimensions]
    world = 1
    for size in shape:
        world *= size
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        coordinates, rest = [], rank
        for size in shape:
            rest, coordinate = divmod(rest, size)
            coordinates.append(coordinate)
        # a rank's group: its coordinates along every dimension outside the group
        key = tuple(c for name, c in zip(dimensions, coordinates) if name not in inside)
        groups.setdefault(key, []).append(rank)  # ranks ascend: each group in rank order
    return sorted(groups.values())


@dataclass(frozen=True)
class RankLayout:
    """One layout's two grids over `world_size` ranks, in the rank order `order`.
    `expert_tensor_parallel_size` None: the tensor-parallel size (megatron-core's default)."""

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    order: str = DEFAULT_ORDER
    # --num-distributed-optimizer-instances: each group of replicas split into this many
    distributed_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        if self.world_size % (tp * pp * cp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by TP {tp} x PP {pp} x CP {cp}"
            )
        if self.world_size % (self.expert_tp * self.expert_model_parallel_size * pp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by expert TP {self.expert_tp} "
                f"x EP {self.expert_model_parallel_size} x PP {pp}"
            )
        count = self.distributed_optimizer_instances
        for replicas, what in ((self.dense("dp-cp"), "DP x CP"), (self.experts("dp"), "expert DP")):
            if len(replicas[0]) % count:
                raise ValueError(
                    f"{what} of {len(replicas[0])} ranks do not split into {count} "
                    "distributed-optimizer instances"
                )
        # The two grids must agree on the pipelines. With PP slowest they always do; with DP
        # after PP, only when a stage holds as many ranks before PP in each grid.
        if self.dense("pp") != self.experts("pp"):
            raise ValueError(
                f"rank order {self.order}: the experts' grid (expert TP {self.expert_tp} x EP "
                f"{self.expert_model_parallel_size}) must hold as many ranks per pipeline stage "
                f"before PP as the dense grid (TP {tp} x CP {cp}), or its pipelines differ"
            )

    @property
    def expert_tp(self) -> int:
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def data_parallel_size(self) -> int:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        return self.world_size // (tp * pp * self.context_parallel_size)

    def dense(self, members: str) -> list[list[int]]:
        """Groups of the dense grid (dimensions tp, cp, dp, pp)."""
        sizes = {
            "tp": self.tensor_model_parallel_size,
            "cp": self.context_parallel_size,
            "dp": self.data_parallel_size,
            "pp": self.pipeline_model_parallel_size,
        }
        return rank_groups(sizes, members, self.order)

    def experts(self, members: str) -> list[list[int]]:
        """Groups of the experts' grid (tp: expert TP, ep, dp: expert DP, pp)."""
        ep, pp = self.expert_model_parallel_size, self.pipeline_model_parallel_size
        sizes = {
            "tp": self.expert_tp,
            "ep": ep,
            "dp": self.world_size // (self.expert_tp * ep * pp),
            "pp": pp,
        }
        return rank_groups(sizes, members, self.order)

    def instances(self, replicas: list[list[int]], part: str) -> list[list[int]]:
        """--num-distributed-optimizer-instances I: each group of `replicas` (DP x CP, or expert
        DP) in I consecutive runs of its ranks, the "intra" groups one optimizer instance
        shards over (megatron-core's intra-partial groups), or (`part="inter"`) the ranks at
        the same place of each run, which all-reduce the instances' shards. None at I = 1."""
        count = self.distributed_optimizer_instances
        if count == 1:
            return []
        out = []
        for ranks in replicas:
            size = len(ranks) // count
            if part == "intra":
                out += [ranks[i * size : (i + 1) * size] for i in range(count)]
            else:
                out += [ranks[j::size] for j in range(size)]
        return sorted(out)

    def embedding(self) -> list[list[int]]:
        """Per pipeline, its first and last stage's ranks (the holders of tied embeddings;
        the one stage without pipeline parallelism)."""
        return [sorted({ranks[0], ranks[-1]}) for ranks in self.dense("pp")]
