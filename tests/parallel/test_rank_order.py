"""threefold builds its process groups itself (threefold/parallel/state.py), in Megatron's rank
order: the same members as megatron-core's `parallel_state` for every layout, compared as rank
lists against its `RankGenerator` and as real gloo groups against its own, in megatron-core's
default rank order and in `--use-tp-pp-dp-mapping`'s."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from threefold.parallel.rank_order import DEFAULT_ORDER, TP_PP_DP_ORDER, RankLayout, rank_groups

# (world, TP, PP, CP, EP, ETP)
LAYOUTS = [
    (1, 1, 1, 1, 1, 1),
    (8, 2, 2, 1, 1, 2),
    (8, 2, 1, 2, 1, 2),
    (8, 1, 2, 2, 2, 1),
    (16, 2, 2, 2, 2, 1),
    (16, 4, 1, 1, 2, 2),
    (24, 2, 3, 2, 2, 2),
    (32, 2, 2, 2, 4, 2),
    (64, 4, 2, 2, 8, 1),
    (64, 1, 4, 4, 4, 4),
]
DENSE = ["tp", "pp", "dp", "cp", "dp-cp", "tp-cp", "tp-pp", "tp-dp-cp", "tp-dp", "cp-dp-pp"]
EXPERTS = ["ep", "tp", "tp-ep", "dp", "tp-ep-pp", "pp"]


@pytest.mark.parametrize("order", [DEFAULT_ORDER, TP_PP_DP_ORDER])
@pytest.mark.parametrize("world, tp, pp, cp, ep, etp", LAYOUTS)
def test_groups_are_megatron_cores_rank_generators(world, tp, pp, cp, ep, etp, order):
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp * cp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    if dense.get_ranks("pp") != experts.get_ranks("pp"):
        # megatron-core asserts the two grids' pipelines are one; so does the layout
        assert order == TP_PP_DP_ORDER and etp * ep != tp * cp
        with pytest.raises(ValueError, match="its pipelines differ"):
            RankLayout(world, tp, pp, cp, ep, etp, order)
        return
    layout = RankLayout(world, tp, pp, cp, ep, etp, order)
    for members in DENSE:
        assert layout.dense(members) == dense.get_ranks(members), members
    for members in EXPERTS:
        assert layout.experts(members) == experts.get_ranks(members), members
    assert layout.experts("pp") == layout.dense("pp")  # megatron-core asserts this too


def test_the_grid_puts_tp_fastest_and_pp_slowest():
    # world 8, TP=2, PP=2: arange(8).view(pp=2, dp=2, tp=2) (docs/parallelism.md)
    layout = RankLayout(8, 2, 2)
    assert layout.dense("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dense("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dense("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.embedding() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert RankLayout(4, 2).embedding() == [[0], [1], [2], [3]]
    assert rank_groups({"tp": 2, "cp": 3}, "cp") == [[0, 2, 4], [1, 3, 5]]


def test_the_tp_pp_dp_mapping_puts_a_replicas_ranks_together():
    # world 8, TP=2, PP=2: arange(8).view(dp=2, pp=2, tp=2); a replica is ranks 0-3
    layout = RankLayout(8, 2, 2, order=TP_PP_DP_ORDER)
    assert layout.dense("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dense("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dense("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.dense("tp-pp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_layout_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="world size 6 is not divisible by TP 4"):
        RankLayout(6, 4)
    with pytest.raises(ValueError, match="expert TP 1 x EP 4 x PP 1"):
        RankLayout(6, 2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    with pytest.raises(ValueError, match="unknown dimension 'xp'"):
        rank_groups({"tp": 2}, "xp")
    with pytest.raises(ValueError, match="order 'tp-dp' is not an order of"):
        rank_groups({"tp": 2}, "tp", "tp-dp")


def _members(group) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def _threefold_and_megatron_core_groups(layouts) -> list:
    """On each rank, per layout: this rank's groups as threefold and megatron-core build them
    (members, size, rank of each kind)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.distributed import destroy_groups
    from threefold.parallel import state

    seen = []
    for tp, pp, cp, ep, etp, order, instances, *hierarchy in layouts:
        hierarchy = hierarchy[0] if hierarchy else None  # a2a+p2p's levels of CP
        state.initialize_model_parallel(tp, pp, None, 1, cp, ep, etp, order, instances, hierarchy)
        context = state.parallel_context()
        ps.initialize_model_parallel(
            tp,
            pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            create_gloo_process_groups=False,
            order=order,
            num_distributed_optimizer_instances=instances,
            hierarchical_context_parallel_sizes=hierarchy,
        )
        first_or_last = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
        theirs = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "cp": ps.get_context_parallel_group(),
            "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
            "tp_cp": ps.get_tensor_and_context_parallel_group(),
            "ep": ps.get_expert_model_parallel_group(),
            "expert_tp": ps.get_expert_tensor_parallel_group(),
            "expert_tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
            "expert_dp": ps.get_expert_data_parallel_group(),
            "embedding_group": ps.get_embedding_group() if first_or_last else None,
            "model_parallel_group": ps.get_model_parallel_group(),
            "expert_model_parallel_group": ps.get_expert_tensor_model_pipeline_parallel_group(),
            "dp_cp_intra": ps.get_data_parallel_group(True, partial_data_parallel=True),
            "expert_dp_intra": ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
        }
        if hierarchy:
            theirs["cp_a2a"], theirs["cp_p2p"] = ps.get_hierarchical_context_parallel_groups()
        if instances > 1:  # (megatron-core builds the experts' only, for both)
            theirs["expert_dp_inter"] = ps.get_inter_distributed_optimizer_instance_group()
        ours, megatron_cores = {}, {}
        for kind, group in theirs.items():
            mine = getattr(context, kind)
            if kind.endswith("_group"):
                ours[kind], megatron_cores[kind] = _members(mine), _members(group)
            else:
                ours[kind] = (_members(mine.group), mine.size, mine.rank)
                megatron_cores[kind] = (
                    _members(group),
                    dist.get_world_size(group),
                    dist.get_rank(group),
                )
        seen.append((ours, megatron_cores))
        destroy_groups(state)
    return seen


def test_the_groups_are_megatron_cores_on_eight_ranks():
    layouts = [
        (2, 2, 1, 1, 2, DEFAULT_ORDER, 1),
        (2, 1, 2, 2, 1, DEFAULT_ORDER, 1),
        (4, 1, 1, 2, 2, DEFAULT_ORDER, 1),
        (2, 2, 1, 1, 2, TP_PP_DP_ORDER, 1),
        (1, 2, 2, 2, 1, TP_PP_DP_ORDER, 1),
        # --num-distributed-optimizer-instances 2: DP x CP 4 in two runs of 2, expert DP 4 too
        (2, 1, 1, 1, 1, DEFAULT_ORDER, 2),
        (1, 1, 2, 2, 1, DEFAULT_ORDER, 2),
        # --cp-comm-type a2a+p2p: CP 4 as all-to-all pairs and a ring of 2, and CP 8 as 2 x 4
        (1, 2, 4, 1, 1, DEFAULT_ORDER, 1, [2, 2]),
        (1, 1, 8, 1, 1, DEFAULT_ORDER, 1, [2, 4]),
    ]
    for rank, seen in enumerate(run_distributed(8, _threefold_and_megatron_core_groups, layouts)):
        for layout, (ours, megatron_cores) in zip(layouts, seen):
            assert ours == megatron_cores, (rank, layout)
