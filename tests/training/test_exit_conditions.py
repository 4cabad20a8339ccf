"""--exit-interval, --exit-duration-in-mins and --exit-signal-handler leave with a checkpoint,
and a run whose --load is its --save resumes from it exactly."""

import os
import signal

import pytest
import torch

from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args
from threefold.checkpoint.files import TRACKER
from threefold.checkpoint.load import load_checkpoint
from threefold.training.exit_conditions import ExitConditions


def _run(*extra: str) -> tuple[list[float], object]:
    trainer = _setup(LLAMA_STYLE + TRAINING + list(extra))
    checkpoint = trainer.config.checkpoint
    if checkpoint.load:
        load_checkpoint(checkpoint.load, trainer.checkpoint_components())
    return trainer.train(), trainer


def test_exit_interval_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path):
    uninterrupted, _ = _run()
    directory = str(tmp_path / "run")  # does not exist yet: the first run starts from scratch
    first, trainer = _run("--save", directory, "--load", directory, "--exit-interval", "4")
    assert trainer.state.iteration == 4 and len(first) == 4
    assert open(os.path.join(directory, TRACKER)).read().strip() == "4"
    rest, trainer = _run("--save", directory, "--load", directory)
    assert trainer.state.iteration == 10
    assert first + rest == uninterrupted  # bitwise: the same floats


def test_exit_duration_stops_after_the_first_iteration_over_time(tmp_path):
    losses, trainer = _run("--save", str(tmp_path), "--exit-duration-in-mins", "1e-9")
    assert len(losses) == 1
    assert open(os.path.join(tmp_path, TRACKER)).read().strip() == "1"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_exit_signal_handler_records_the_signal_and_restores_the_handler(sig):
    before = signal.getsignal(sig)
    config = parse_args(["--exit-signal-handler", "--mock-data"])
    exits = ExitConditions(config.training, torch.device("cpu"))
    assert exits.reason(1) is None
    os.kill(os.getpid(), sig)  # recorded, not fatal
    assert exits.reason(2) == (
        f"--exit-signal-handler: received {sig.name} (on this or another rank)"
    )
    exits.close()
    assert signal.getsignal(sig) is before


def test_load_must_exist_unless_it_is_the_save_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--mock-data", "--load", str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "--load" in capsys.readouterr().err
    parse_args(["--mock-data", "--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")])
