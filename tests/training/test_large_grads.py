"""--check-for-large-grads (Megatron-LM's; Nemotron 3.5's config gives it): each step every
gradient bucket's norm on each rank, before the data-parallel reduction, goes through
Megatron-LM's `is_unexpectedly_large` (the first 100 set the largest; 10 times that is
reported); the run goes on, as Megatron-LM's does with reruns disabled."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.training.numerics import LargeGradsDetector

CHECK = ["--check-for-large-grads", "--ddp-bucket-size", "4000"]


def test_the_first_hundred_set_the_largest_and_ten_times_it_is_reported():
    detector = LargeGradsDetector(rank=3)
    norms = [torch.tensor(float(v)) for v in range(1, 101)]
    assert detector.observe(norms, 1) == [] and detector.largest == 100.0
    assert detector.observe([torch.tensor(999.0), torch.tensor(math.nan)], 2) == []
    (report,) = detector.observe([torch.tensor(5.0), torch.tensor(-1000.0)], 3)
    assert report.startswith("Rank 3, node ") and "iteration 3: Unexpected result 1.0" in report
    assert "found unexpected large grads in bucket #1 in backward pass before" in report


def _bucket_norms(argv: list[str]) -> list[list[float]]:
    """Each step's bucket norms as the check reads them (before the reduction), 3 steps."""
    trainer = _setup(argv)
    seen = []
    observe = trainer.large_grads.observe
    trainer.large_grads.observe = lambda norms, iteration: (
        seen.append([float(n) for n in norms]) or observe(norms, iteration)
    )
    for _ in range(3):
        trainer.train_step()
    return seen


def test_the_norms_are_each_ranks_own_before_the_reduction_with_or_without_overlap():
    """At DP2 each rank's norms are its own micro-batches' (they differ between the ranks),
    and --overlap-grad-reduce takes them as each bucket's reduction starts: the same values
    as without it, where they are read after backward."""
    argv = LLAMA_STYLE + TRAINING + CHECK
    plain = run_distributed(2, _bucket_norms, argv)
    overlapped = run_distributed(2, _bucket_norms, argv + ["--overlap-grad-reduce"])
    for rank in range(2):
        assert len(plain[rank][0]) > 2  # (several buckets)
        for step in range(3):
            assert overlapped[rank][step] == pytest.approx(plain[rank][step], rel=1e-6)
    assert plain[0][0] != pytest.approx(plain[1][0], rel=1e-3)


def test_a_large_bucket_is_reported_and_the_run_goes_on(capsys):
    trainer = _setup(LLAMA_STYLE + TRAINING + CHECK)
    trainer.large_grads = LargeGradsDetector(0, samples=2)
    local = trainer.data_parallel.local_bucket_norms
    steps = iter([1.0, 1.0, 1000.0])
    trainer.data_parallel.local_bucket_norms = lambda: [n * next(steps) for n in local()[:1]]
    losses = [trainer.train_step()[0] for _ in range(3)]
    assert all(math.isfinite(loss) for loss in losses)
    out = capsys.readouterr().out
    assert out.count("found unexpected large grads in bucket #0") == 1
    assert "iteration 3: Unexpected result" in out


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--rerun-mode", "validate_results"], "threefold's reruns validate losses only"),
        (["--distributed-strategy", "ddp"], "use --distributed-strategy megatron or drop it"),
    ],
)
def test_what_it_cannot_check_is_refused_in_one_line(capsys, flags, named):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + ["--check-for-large-grads", *flags])
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error
