"""Token dropping over an expert's capacity where ranks route slices of a micro-batch: the
tokens one device drops (threefold/model/moe/capacity.py). The capacity's own choice, at one
device: tests/parallel/test_expert_parallel.py; at EP2 over DP, its router variants."""

import numpy as np
import pytest

from tests.distributed import run_distributed
from tests.parallel.test_expert_parallel import MOE, TOLERANCE, _train_with_statistics
from tests.parity import LLAMA_STYLE, TRAINING, assert_matches_reference


@pytest.mark.parametrize("policy, pad", [("probs", True), ("position", False)])
def test_capacity_is_the_micro_batchs_where_ranks_route_slices_of_it(policy, pad):
    """TP2 with sequence parallelism inside CP2: each rank routes a quarter of a micro-batch's
    tokens, and drops what one device drops from the whole of it (the same tokens routed,
    the same experts' weights). (before: each rank kept a quarter of the capacity among its
    own tokens, megatron-core's choice, and an expert's weights ended 24% from one device's
    after 5 steps)"""
    argv = LLAMA_STYLE + TRAINING + MOE + ["--moe-expert-capacity-factor", "0.75"]
    argv += ["--moe-token-drop-policy", policy] + (["--moe-pad-expert-input-to-capacity"] * pad)
    reference = _train_with_statistics(argv, 10)
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    layout += ["--context-parallel-size", "2"]
    results = run_distributed(4, _train_with_statistics, argv + layout, 10)
    assert_matches_reference(results, reference, TOLERANCE)
    for result in results:
        np.testing.assert_allclose(result["tokens"], reference["tokens"])
