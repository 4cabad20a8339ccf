"""Megatron-LM's LR and weight-decay schedules (inverse-square-root, WSD with its four anneal
shapes, weight-decay increments) and the schedule check on resume
(--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler)."""

import math

import pytest
import torch

from tests.parity import GPT2_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.checkpoint.load import load_checkpoint
from threefold.checkpoint.loadable import check_before_start
from threefold.checkpoint.save import save_checkpoint
from threefold.config import ConfigError
from threefold.training.lr_scheduler import OptimizerParamScheduler

BASE = ["--mock-data", "--vocab-size", "100", "--lr", "1.0", "--min-lr", "0.1"]


def _schedule(flags: list[str], steps: int) -> list[tuple[float, float]]:
    """lr and weight decay after each of `steps` iterations, of a no-decay and a decay group."""
    groups = [
        {"params": [torch.zeros(1)], "wd_mult": 0.0},
        {"params": [torch.zeros(1, 1)], "wd_mult": 1.0},
    ]
    training = parse_args(BASE + flags).training
    scheduler = OptimizerParamScheduler(torch.optim.AdamW(groups), training)
    values = []
    for _ in range(steps):
        scheduler.iteration_done(training.global_batch_size)
        no_decay, decay = scheduler.optimizer.param_groups
        assert no_decay["weight_decay"] == 0.0 and no_decay["lr"] == decay["lr"]
        values.append((decay["lr"], decay["weight_decay"]))
    return values


def test_inverse_square_root_decays_from_the_end_of_warmup():
    lrs = [
        lr
        for lr, _ in _schedule(
            [
                "--lr-decay-style",
                "inverse-square-root",
                "--lr-warmup-iters",
                "4",
                "--train-iters",
                "1000",
            ],
            1001,
        )
    ]
    assert lrs[3] == 1.0  # step 4: the end of warmup
    assert lrs[15] == pytest.approx(math.sqrt(4 / 16))
    assert lrs[99] == pytest.approx(0.2)
    assert lrs[499] == lrs[999] == 0.1  # floored at --min-lr from step 400


@pytest.mark.parametrize(
    "style,halfway",
    [
        ("exponential", 2 * 0.5**0.5 - 1),
        ("linear", 0.5),
        ("cosine", 0.5),
        ("minus_sqrt", 1 - 0.5**0.5),
    ],
)
def test_wsd_holds_the_peak_then_anneals_over_its_last_iterations(style, halfway):
    lrs = [
        lr
        for lr, _ in _schedule(
            [
                "--lr-decay-style",
                "WSD",
                "--lr-warmup-iters",
                "2",
                "--train-iters",
                "20",
                "--lr-wsd-decay-iters",
                "8",
                "--lr-wsd-decay-style",
                style,
            ],
            21,
        )
    ]
    assert lrs[1] == 1.0 and lrs[11] == 1.0  # stable until iteration 12 = 20 - 8
    assert lrs[15] == pytest.approx(0.1 + 0.9 * halfway)  # iteration 16: halfway through
    assert lrs[19] == pytest.approx(0.1) and lrs[20] == 0.1


@pytest.mark.parametrize("style,quarter", [("linear", 0.25), ("cosine", 0.5 - 0.5**1.5)])
def test_weight_decay_increments_from_start_to_end(style, quarter):
    decays = [
        wd
        for _, wd in _schedule(
            [
                "--weight-decay-incr-style",
                style,
                "--start-weight-decay",
                "0.0",
                "--end-weight-decay",
                "0.4",
                "--train-iters",
                "8",
            ],
            8,
        )
    ]
    cosine_quarter = 0.5 * (math.cos(math.pi * 0.75) + 1)
    expected = 0.4 * (quarter if style == "linear" else cosine_quarter)
    assert decays[1] == pytest.approx(expected) and decays[7] == pytest.approx(0.4)


def test_samples_schedule_counts_wsd_in_samples():
    lrs = [
        lr
        for lr, _ in _schedule(
            [
                "--lr-decay-style",
                "WSD",
                "--train-samples",
                "40",
                "--global-batch-size",
                "4",
                "--lr-wsd-decay-samples",
                "8",
                "--lr-wsd-decay-style",
                "linear",
            ],
            10,
        )
    ]
    assert lrs[7] == 1.0 and lrs[8] == pytest.approx(0.55) and lrs[9] == pytest.approx(0.1)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (
            ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "500"],
            "--lr-wsd-decay-iters 500 must be in [1, --lr-decay-iters 100]",
        ),
        (
            ["--start-weight-decay", "0.1"],
            "--start/end-weight-decay need --weight-decay-incr-style",
        ),
        (["--weight-decay-incr-style", "linear"], "needs --start-weight-decay and"),
        (
            ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
            "contradict each other",
        ),
    ],
)
def test_incomplete_schedules_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + flags)
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    trainer = _setup(GPT2_STYLE + TRAINING + ["--save", directory])
    trainer.train_step()
    save_checkpoint(directory, trainer.checkpoint_components())
    return directory


def test_resume_with_another_schedule_is_refused_unless_settled(checkpoint):
    changed = GPT2_STYLE + TRAINING + ["--lr", "1e-3"]
    with pytest.raises(
        ConfigError,
        match=r"the checkpoint's schedule has --lr 0\.003 but this "
        r"run has 0\.001; .*--override-opt_param-scheduler",
    ):
        load_checkpoint(checkpoint, _setup(changed).checkpoint_components())
    # Before start-up too, from the metadata alone (pretrain_gpt.py's and finetune.py's look).
    config = parse_args(changed + ["--load", checkpoint])
    with pytest.raises(ConfigError, match=r"--load .*: the checkpoint's schedule has --lr 0\.003"):
        check_before_start(checkpoint, config.checkpoint, 1, config)
    overriding = _setup(changed + ["--override-opt_param-scheduler"])
    load_checkpoint(checkpoint, overriding.checkpoint_components())
    assert overriding.scheduler.schedule["max_lr"] == 1e-3
    from_checkpoint = _setup(changed + ["--use-checkpoint-opt-param-scheduler"])
    load_checkpoint(checkpoint, from_checkpoint.checkpoint_components())
    assert from_checkpoint.scheduler.schedule["max_lr"] == 3e-3
    same = _setup(GPT2_STYLE + TRAINING)
    load_checkpoint(checkpoint, same.checkpoint_components())
    assert same.scheduler.get_lr() == from_checkpoint.scheduler.get_lr()
    # Biases and norms stay without weight decay whatever the schedule sets.
    assert sorted(g["weight_decay"] for g in same.optimizer.param_groups) == [0.0, 0.01]


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_from_lr_warmup_init_is_megatron_cores(style):
    """--lr-warmup-init (Megatron-LM's): the warmup starts there, in every group (a muP group's
    lr_mult scales its peak and floor, not the start), then the decay as before: megatron-core's
    OptimizerParamScheduler, step by step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as Theirs

    flags = ["--lr-decay-style", style, "--lr-warmup-iters", "4", "--train-iters", "20"]
    flags += ["--lr-warmup-init", "0.25"] + (
        ["--lr-wsd-decay-iters", "8"] if style == "WSD" else []
    )
    training = parse_args(BASE + flags).training
    groups = [{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "lr_mult": 0.5}]
    ours = OptimizerParamScheduler(torch.optim.AdamW(groups), training)
    their_groups = [
        {"params": [torch.zeros(1)], "max_lr": 1.0, "min_lr": 0.1},
        {"params": [torch.zeros(1)], "max_lr": 0.5, "min_lr": 0.05},
    ]
    theirs = Theirs(
        torch.optim.AdamW(their_groups),
        init_lr=0.25,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=4,
        lr_decay_steps=20,
        lr_decay_style=style,
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=20,
        wd_incr_style="constant",
        wsd_decay_steps=8 if style == "WSD" else None,
        lr_wsd_decay_style="exponential" if style == "WSD" else None,
    )
    for step in range(21):
        expected = [group["lr"] for group in theirs.optimizer.param_groups]
        got = [group["lr"] for group in ours.optimizer.param_groups]
        assert got == pytest.approx(expected, rel=1e-12), step
        ours.iteration_done(training.global_batch_size)
        theirs.step(1)
    assert [g["lr"] for g in ours.optimizer.param_groups][0] == pytest.approx(0.1)
