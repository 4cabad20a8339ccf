"""--eval-global-batch-size and --eval-micro-batch-size (Megatron-LM's): evaluation reads its
own global batches in its own micro-batches; the validation loss is the mean over the same
tokens however they are cut, on one process and across pipeline stages."""

import pytest

from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args

EVAL = ["--eval-iters", "2"]


def _validation_loss(argv: list[str]) -> float:
    trainer = _setup(argv)
    trainer.train_step()
    return trainer.evaluate()


def test_the_validation_loss_is_the_same_tokens_however_they_are_cut():
    """Training's global batch is 8 (2 per micro-batch): two evaluation steps of 8 read samples
    0-15, as four of 4 in micro-batches of 1 and one of 16 in micro-batches of 4 do."""
    argv = LLAMA_STYLE + TRAINING
    reference = _validation_loss(argv + EVAL)
    for flags in (
        ["--eval-iters", "4", "--eval-global-batch-size", "4", "--eval-micro-batch-size", "1"],
        ["--eval-iters", "1", "--eval-global-batch-size", "16", "--eval-micro-batch-size", "4"],
    ):
        assert _validation_loss(argv + flags) == pytest.approx(reference, rel=1e-6)
    # another set of tokens: another loss (the flags are not ignored)
    other = _validation_loss(argv + EVAL + ["--eval-global-batch-size", "4"])
    assert other != pytest.approx(reference, rel=1e-6)


def test_pipeline_stages_pass_evaluation_micro_batches_of_its_own_size():
    """Under PP2 what travels between the stages is an evaluation micro-batch (4 samples), not
    a training one (2)."""
    argv = LLAMA_STYLE + TRAINING + EVAL + ["--eval-micro-batch-size", "4"]
    reference = _validation_loss(argv)
    results = run_distributed(2, _validation_loss, argv + ["--pipeline-model-parallel-size", "2"])
    assert results[-1] == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--eval-global-batch-size", "6", "--eval-micro-batch-size", "4"], "not divisible"),
        (["--eval-micro-batch-size", "0"], "must be >= 1"),
    ],
)
def test_evaluation_batch_mistakes_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + flags)
    assert message in capsys.readouterr().err
