"""Data parallelism reproduces the single-process run (real gloo ranks)."""

from tests.distributed import run_distributed
from tests.parity import (
    GPT2_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_losses_close,
    train_job,
)


def test_data_parallel_2_matches_single_process():
    argv = GPT2_STYLE + TRAINING
    reference = train_job(argv, 10)
    # DP=2 with the same global batch of 8: 2 micro-batches of 2 per rank instead of 4.
    results = run_distributed(2, train_job, argv, 10)
    for rank_result in results:
        assert_losses_close(rank_result["losses"], reference["losses"], 1e-6)
    assert_close_dicts(results[0]["params"], reference["params"], 1e-6, "parameter")
    # Replicas stay identical.
    assert_close_dicts(results[1]["params"], results[0]["params"], 0.0, "replica parameter")
