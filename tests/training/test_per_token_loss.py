"""--calculate-per-token-loss: every loss token of the global batch weighs the same, whatever
micro-batch and rank it lands on. Samples here are split into documents (--eod-mask-loss,
--reset-position-ids, --reset-attention-mask with a 16-token vocabulary whose id 15 is the
end-of-document token), so micro-batches hold different numbers of loss tokens."""

import numpy as np
import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    LLAMA_STYLE,
    TRAINING,
    assert_close_dicts,
    assert_losses_close,
    assert_matches_reference,
    relative_error,
    train_job,
)
from tests.training.test_accumulation_and_determinism import _with
from threefold.arguments import parse_args
from threefold.data.loader import build_datasets
from threefold.data.tokenizer import build_tokenizer, model_vocab_size

DOCUMENTS = [
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "15",
    "--eod-mask-loss",
    "--reset-position-ids",
    "--reset-attention-mask",
]
PER_TOKEN = ["--calculate-per-token-loss"]
STEPS = 3


def _argv(*extra: str) -> list[str]:
    return LLAMA_STYLE + TRAINING + DOCUMENTS + list(extra)


def test_micro_batches_hold_different_numbers_of_loss_tokens():
    config = parse_args(_argv())
    tokenizer = build_tokenizer(config.data, config.model.vocab_size)
    config.model.vocab_size = model_vocab_size(tokenizer, config.model.vocab_size)  # as Trainer
    train = build_datasets(config, tokenizer)[0]
    counts = [sum(train[2 * i + j]["loss_mask"].sum() for j in range(2)) for i in range(4)]
    assert len(set(counts)) > 1, counts  # otherwise the tests below could not tell the modes


def test_per_token_loss_does_not_depend_on_the_micro_batch_size():
    """Four micro-batches of 2 give the run of one micro-batch of 8 (where the micro-batch
    mean is the per-token mean); without the flag they do not. The loss reported is the token
    mean either way (Megatron-LM's), so the first steps' agree: only the updates differ."""
    one = train_job(_with(_argv(*PER_TOKEN), micro_batch_size=8), STEPS)
    four = train_job(_argv(*PER_TOKEN), STEPS)
    assert_losses_close(four["losses"], one["losses"], 1e-6)
    assert_close_dicts(four["params"], one["params"], 1e-6, "parameter")
    averaged = train_job(_argv(), STEPS)
    assert_losses_close(averaged["losses"][:1], one["losses"][:1], 1e-6)
    errors = [
        relative_error(averaged["params"][name], one["params"][name]) for name in one["params"]
    ]
    assert max(errors) > 1e-3


@pytest.mark.parametrize("flags", [PER_TOKEN, []], ids=["per-token", "micro-batch-mean"])
def test_the_reported_loss_is_the_token_mean_of_the_global_batch(flags):
    """The first reported loss against the per-token losses written out by hand: the token
    mean of the global batch, as Megatron-LM's log line reports it, whichever way the
    gradient weighs the micro-batches; not the mean of the micro-batches' means."""
    import torch

    from tests.parity import _setup

    trainer = _setup(_argv(*flags))
    batches = [next(trainer.train_iterator()) for _ in range(trainer.num_microbatches)]
    trainer._train_iterator = None  # train_step re-reads the same first global batch
    with torch.no_grad():
        totals = [
            (
                trainer.model(
                    b["tokens"],
                    labels=b["labels"],
                    attention_mask=b["attention_mask"],
                    position_ids=b["position_ids"],
                )
                * b["loss_mask"]
            ).sum()
            for b in batches
        ]
    tokens = [b["loss_mask"].sum() for b in batches]
    loss, _, _ = trainer.train_step()
    assert np.isclose(loss, (sum(totals) / sum(tokens)).item(), rtol=1e-6)
    means = np.mean([(total / count).item() for total, count in zip(totals, tokens)])
    assert not np.isclose(loss, means, rtol=1e-4)


@pytest.mark.parametrize(
    "world_size,flags,tolerance",
    [
        (2, [], DP_TOLERANCE),
        (2, ["--use-distributed-optimizer"], DP_TOLERANCE),
        (2, ["--distributed-strategy", "ddp"], DP_TOLERANCE),
        (2, ["--distributed-strategy", "fsdp"], DP_TOLERANCE),
        (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 1e-5),
        (
            4,
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
            DP_TOLERANCE,
        ),
    ],
    ids=["dp2", "dp2-distopt", "ddp2", "fsdp2", "tp2-sp-dp2", "pp2-interleaved-dp2"],
)
def test_per_token_loss_layouts_match_single_process(world_size, flags, tolerance):
    reference = train_job(_argv(*PER_TOKEN), STEPS)
    results = run_distributed(world_size, train_job, _argv(*PER_TOKEN, *flags), STEPS)
    assert_matches_reference(results, reference, tolerance)
