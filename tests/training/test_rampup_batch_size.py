"""--rampup-batch-size START INCREMENT SAMPLES: the global batch grows as in Megatron-LM, every
layout reads the same samples per iteration, and the LR schedule counts samples."""

import re

import pytest

from tests.distributed import run_distributed
from tests.parity import (
    DP_TOLERANCE,
    LLAMA_STYLE,
    TRAINING,
    assert_losses_close,
    assert_matches_reference,
    train_job,
)
from tests.test_megatron_compat import _without
from threefold.arguments import parse_args

# Batches of 4, 4, then 8 from 8 consumed samples on: 6 iterations for 40 samples.
RAMP = _without(TRAINING, "--train-iters", "--lr-warmup-iters") + [
    "--train-samples",
    "40",
    "--rampup-batch-size",
    "4",
    "4",
    "8",
    "--lr-warmup-samples",
    "8",
]
SIZES = [4, 4, 8, 8, 8, 8]


def test_megatron_ramp_and_iteration_count():
    training = parse_args(LLAMA_STYLE + RAMP).training
    assert training.train_iters == 6
    consumed, sizes = 0, []
    for _ in range(training.train_iters):
        sizes.append(training.global_batch_size_at(consumed))
        consumed += sizes[-1]
    assert sizes == SIZES and consumed == 40
    # Megatron's formula over a longer ramp: 16 -> 64 in 4 steps over 1200 samples.
    long = parse_args(
        LLAMA_STYLE
        + _without(RAMP, "--rampup-batch-size", "--global-batch-size")
        + [
            "--rampup-batch-size",
            "16",
            "16",
            "1200",
            "--global-batch-size",
            "64",
            "--train-samples",
            "100000",
        ]
    ).training
    assert [long.global_batch_size_at(c) for c in (0, 399, 400, 801, 1200, 1201)] == [
        16,
        16,
        32,
        48,
        64,
        64,
    ]


def test_a_ramped_run_logs_its_batch_sizes(capsys):
    from tests.parity import _setup

    trainer = _setup(LLAMA_STYLE + RAMP + ["--log-interval", "1"])
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert [int(re.search(r"global batch size: +(\d+)", line).group(1)) for line in lines] == SIZES
    assert [int(re.search(r"consumed samples: +(\d+)", line).group(1)) for line in lines] == [
        4,
        8,
        16,
        24,
        32,
        40,
    ]


def test_the_first_ramped_iteration_is_a_batch_of_start_samples():
    ramped = train_job(LLAMA_STYLE + RAMP, 1)
    small = train_job(
        LLAMA_STYLE + _without(TRAINING, "--global-batch-size") + ["--global-batch-size", "4"], 1
    )
    assert_losses_close(ramped["losses"], small["losses"], 1e-6)


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "2000"],
        ["--pipeline-model-parallel-size", "2"],
    ],
    ids=["dp2", "dp2-distopt-overlap", "pp2"],
)
def test_ramped_layouts_match_single_process(flags):
    reference = train_job(LLAMA_STYLE + RAMP, 6)
    results = run_distributed(2, train_job, LLAMA_STYLE + RAMP + flags, 6)
    assert_matches_reference(results, reference, DP_TOLERANCE)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--train-iters", "10", "--rampup-batch-size", "4", "4", "8"],
            "--rampup-batch-size needs --train-samples",
        ),
        (
            RAMP[:-6] + ["--rampup-batch-size", "3", "4", "8"],
            "--global-batch-size 8 must be START 3 plus a multiple of INCREMENT 4",
        ),
        (
            _without(RAMP, "--micro-batch-size")
            + ["--micro-batch-size", "4", "--rampup-batch-size", "2", "2", "8"],
            "the global batch size 2 is not divisible by --micro-batch-size 4",
        ),
    ],
)
def test_ramp_mistakes_are_refused(extra, message, capsys):
    base = LLAMA_STYLE + _without(
        TRAINING, "--train-iters", "--lr-warmup-iters", "--rampup-batch-size"
    )
    with pytest.raises(SystemExit) as exit_info:
        parse_args(base + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_resuming_mid_ramp_is_bitwise(tmp_path):
    from tests.training.test_checkpointing import _resume_job

    result = _resume_job(LLAMA_STYLE + RAMP, str(tmp_path / "ckpt"))  # saved after 4, 4, 8
    assert result["resumed_losses"] == result["straight"]["losses"][3:]


# Megatron-LM's --step-batch-size-schedule: 4 from 0 tokens, 8 from 128 tokens (8 samples of
# 16): the same batches as RAMP.
STEPS = _without(RAMP, "--rampup-batch-size", "--global-batch-size")
STEPS += ["--step-batch-size-schedule", "0:4 0.128K:8"]


def test_a_step_schedule_trains_as_the_ramp_with_the_same_batch_sizes():
    training = parse_args(LLAMA_STYLE + STEPS).training
    assert (training.train_iters, training.global_batch_size) == (6, 8)
    assert [training.global_batch_size_at(c) for c in (0, 4, 7, 8, 1000)] == [4, 4, 4, 8, 8]
    # Megatron-LM's count: batches until the samples are passed, a last partial one included
    longer = _without(STEPS, "--train-samples") + ["--train-samples", "41"]
    assert parse_args(LLAMA_STYLE + longer).training.train_iters == 7
    reference = train_job(LLAMA_STYLE + RAMP, 6)
    assert train_job(LLAMA_STYLE + STEPS, 6)["losses"] == reference["losses"]
    results = run_distributed(2, train_job, LLAMA_STYLE + STEPS, 6)
    assert_matches_reference(results, reference, DP_TOLERANCE)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--global-batch-size", "16"], "ends at global batch size 8, and --global-batch-size 16"),
        (["--rampup-batch-size", "4", "4", "8"], "drop --rampup-batch-size"),
        (["--step-batch-size-schedule", "0:4 64"], "'64' is not THRESHOLD:SIZE"),
        (["--step-batch-size-schedule", "16:4 64:8"], "the first threshold must be 0"),
        (["--step-batch-size-schedule", "0:4 64:5"], "the global batch size 5 is not divisible"),
    ],
)
def test_step_schedule_mistakes_are_refused(extra, message, capsys):
    base = LLAMA_STYLE + _without(STEPS, "--step-batch-size-schedule")
    base += [] if "--step-batch-size-schedule" in extra else STEPS[-2:]
    with pytest.raises(SystemExit) as exit_info:
        parse_args(base + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
