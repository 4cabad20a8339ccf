"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --log-timers-to-tensorboard):
each level times exactly its phases, in every rank, and reports them in Megatron's format."""

import re

import pytest

from tests.distributed import run_distributed
from tests.parity import GPT2_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.training.timers import ITERATION, Timers

PP2 = ["--pipeline-model-parallel-size", "2"]


def _timed_job(argv: list[str]) -> tuple[dict[str, float], str | None]:
    """Two training steps; this rank's accumulated times and the report everyone prints."""
    trainer = _setup(argv)
    for _ in range(2):
        trainer.train_step()
    times = {name: trainer.timers.elapsed.get(name, 0.0) for name in ITERATION}
    text, _ = trainer.timers.report(list(ITERATION), normalizer=2)
    return times, text


def test_level_2_times_each_phase_on_the_ranks_that_run_it():
    argv = GPT2_STYLE + TRAINING + PP2 + ["--timing-log-level", "2", "--timing-log-option", "all"]
    (first, text), (last, same_text) = run_distributed(2, _timed_job, argv)
    assert text == same_text
    # Pipeline communication: the first stage sends activations and receives gradients.
    assert first["forward-send"] > 0 and first["backward-recv"] > 0
    assert first["forward-recv"] == first["backward-send"] == 0
    assert last["forward-recv"] > 0 and last["backward-send"] > 0
    assert last["forward-send"] == last["backward-recv"] == 0
    for times in (first, last):
        inside = times["forward-compute"] + times["backward-compute"] + times["batch-generator"]
        assert 0 < inside <= times["forward-backward"]
        assert times["optimizer"] > 0 and times["all-grads-sync"] > 0
    # `all`: every rank's time, only for the ranks that ran the timer.
    assert re.search(r"\n  forward-send:\n     rank  0: [\d.]+\n  backward-recv:", text)
    assert re.search(r"\n  forward-backward:\n     rank  0: [\d.]+\n     rank  1: [\d.]+", text)


@pytest.mark.parametrize(
    "level,expected", [(0, set()), (1, {"forward-backward", "all-grads-sync", "optimizer"})]
)
def test_lower_levels_time_only_their_phases(level, expected):
    trainer = _setup(GPT2_STYLE + TRAINING + ["--timing-log-level", str(level)])
    trainer.train_step()
    assert {name for name in ITERATION if name in trainer.timers.elapsed} == expected
    text, maxima = trainer.timers.report(list(ITERATION))
    assert (text is None) == (level == 0) and set(maxima) == expected
    assert not any(name in trainer.timers.elapsed for name in ITERATION)  # reported: reset


@pytest.mark.parametrize(
    "option,expected",
    [
        (
            "minmax",
            "(min, max) time across ranks (ms):\n"
            "    forward-backward ...............................: (12.50, 12.50)\n"
            "    optimizer ......................................: (0.50, 0.50)",
        ),
        (
            "max",
            "max time across ranks (ms):\n"
            "    forward-backward ...............................: 12.50\n"
            "    optimizer ......................................: 0.50",
        ),
        (
            "all",
            "times across ranks (ms):\n  forward-backward:\n     rank  0: 12.50\n"
            "  optimizer:\n     rank  0: 0.50",
        ),
    ],
)
def test_report_formats_follow_megatron(option, expected):
    timers = Timers(level=1, option=option)
    timers.elapsed.update({"forward-backward": 0.025, "optimizer": 0.001})
    text, maxima = timers.report(list(ITERATION), normalizer=2)  # averaged per iteration
    assert text == expected
    assert maxima == {"forward-backward": 12.5, "optimizer": 0.5}


def test_timers_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = _setup(
        GPT2_STYLE
        + TRAINING
        + [
            "--timing-log-level",
            "1",
            "--log-timers-to-tensorboard",
            "--tensorboard-dir",
            str(tmp_path),
            "--log-interval",
            "1",
            "--train-iters",
            "2",
        ]
    )
    trainer.train()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert {"forward-backward-time", "all-grads-sync-time", "optimizer-time"} <= set(
        events.Tags()["scalars"]
    )
    assert len(events.Scalars("optimizer-time")) == 2


def test_timers_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        parse_args(GPT2_STYLE + TRAINING + ["--log-timers-to-tensorboard"])
    assert (
        "--log-timers-to-tensorboard writes to --tensorboard-dir; give one"
        in capsys.readouterr().err
    )
    parse_args(GPT2_STYLE + TRAINING + ["--log-timers-to-tensorboard", "--tensorboard-dir", "tb"])
    assert "at level 0 there are none" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parse_args(GPT2_STYLE + TRAINING + ["--timing-log-level", "3"])
