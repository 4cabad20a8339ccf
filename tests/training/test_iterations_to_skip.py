"""--iterations-to-skip (Megatron-LM's): a skipped iteration's global batch is passed over, with
nothing trained; and the iterations a result-rejected tracker shows rejected twice on one rank
are skipped as Megatron-LM skips them."""

import types

import pytest
import torch

from tests.parity import GPT2_STYLE, TRAINING
from threefold.arguments import parse_args
from threefold.config.result_checks import rejected_iterations
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.rerun import ResultValidation
from threefold.training.trainer import Trainer

ARGV = GPT2_STYLE + TRAINING + ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _trainer(*flags: str) -> Trainer:
    return Trainer(parse_args(ARGV + list(flags)), torch.device("cpu"), ParallelContext())


def test_a_skipped_iteration_passes_over_its_batch_and_trains_nothing(capsys):
    plain = _trainer("--train-iters", "3")
    first = plain.train_step()[0]
    batch = plain.config.training.global_batch_size
    # What iteration 3 computes once 2 is skipped: the weights after iteration 1 (no update
    # since) on the third global batch.
    third = plain._batches(0, 2 * batch)
    expected = plain._mean_loss(plain._schedule(third, plain.num_microbatches, forward_only=True))

    skipping = _trainer("--train-iters", "3", "--iterations-to-skip", "2")
    losses = skipping.train()
    assert losses == [first, pytest.approx(expected, rel=1e-6, abs=0)]
    assert (skipping.state.iteration, skipping.state.consumed_train_samples) == (3, 3 * batch)
    assert skipping.scheduler.num_steps == 2  # (the LR schedule counts the updates made)
    assert "> iteration 2 skipped (--iterations-to-skip): its 8 samples passed over" in (
        capsys.readouterr().out
    )


def _tracked(path, lines: list[tuple[str, int, int, str]]) -> None:
    """The tracker lines threefold's rerun machine writes: (job, rank, iteration, status)."""
    for job, rank, iteration, status in lines:
        validation = ResultValidation.__new__(ResultValidation)
        validation.tracker_file, validation.device = str(path), torch.device("cpu")
        validation.world = types.SimpleNamespace(rank=rank)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_JOBID", job)
            validation._track(f"RerunValidationStatus.{status}", iteration, float("nan"))


def test_iterations_rejected_twice_on_one_rank_are_skipped(tmp_path):
    tracker = tmp_path / "rejected.txt"
    _tracked(
        tracker,
        [
            ("1", 0, 5, "FIRST_RERUN_REPRODUCIBLE"),  # twice on rank 0, in two jobs: skipped
            ("2", 0, 5, "SECOND_RERUN_REPRODUCIBLE"),
            ("1", 0, 7, "FIRST_RERUN_REPRODUCIBLE"),  # on two ranks of one job: not the data
            ("1", 1, 7, "FIRST_RERUN_REPRODUCIBLE"),
            ("2", 0, 7, "FIRST_RERUN_REPRODUCIBLE"),
            ("1", 0, 9, "INITIAL_RUN"),  # never reproduced
            ("2", 0, 9, "FIRST_RERUN_NOT_REPRODUCIBLE"),
        ],
    )
    assert rejected_iterations(str(tracker)) == [5]
    flags = ["--rerun-mode", "validate_results", "--result-rejected-tracker-filename"]
    config = parse_args(ARGV + flags + [str(tracker), "--iterations-to-skip", "3"])
    assert config.training.iterations_to_skip == [3, 5]


def test_an_iteration_before_the_first_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(ARGV + ["--iterations-to-skip", "0"])
    assert "--iterations-to-skip takes iterations from 1 on" in capsys.readouterr().err
