"""--profile with --use-pytorch-profiler writes a torch.profiler trace of exactly the requested
iterations; the nsys form needs CUDA and says so at start-up."""

import glob
import json

import pytest
import torch

from tests.parity import GPT2_STYLE, TRAINING, _setup
from tests.training.test_accumulation_and_determinism import _with
from threefold.arguments import parse_args
from threefold.config import ConfigError
from threefold.parallel.parallel_context import ParallelContext
from threefold.training.trainer import Trainer

PROFILE = [
    "--profile",
    "--use-pytorch-profiler",
    "--profile-step-start",
    "2",
    "--profile-step-end",
    "4",
]


def test_pytorch_profiler_traces_the_requested_iterations(tmp_path, capsys, monkeypatch):
    trainer = _setup(
        _with(GPT2_STYLE + TRAINING, train_iters=6) + PROFILE + ["--tensorboard-dir", str(tmp_path)]
    )
    steps = []
    original = trainer.train_step

    def recorded_step():  # mark each iteration in the trace by its log number
        with torch.profiler.record_function(f"threefold iteration {trainer.state.iteration + 1}"):
            steps.append(trainer.state.iteration + 1)
            return original()

    monkeypatch.setattr(trainer, "train_step", recorded_step)
    trainer.train()
    (trace,) = glob.glob(str(tmp_path / "rank0.*.pt.trace.json"))
    names = {event.get("name") for event in json.load(open(trace))["traceEvents"]}
    marked = sorted(int(n.split()[-1]) for n in names if str(n).startswith("threefold iter"))
    assert marked == [3, 4] and steps == [1, 2, 3, 4, 5, 6]
    assert "aten::mm" in names  # the model's work, not just the markers
    assert "profiler trace of iterations 3-4 written to" in capsys.readouterr().out


def test_profiler_flag_mistakes(capsys):
    with pytest.raises(SystemExit):
        parse_args(GPT2_STYLE + TRAINING + PROFILE)
    assert "--use-pytorch-profiler writes its trace to --tensorboard-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(
            GPT2_STYLE
            + TRAINING
            + ["--profile", "--profile-step-start", "3", "--profile-step-end", "3"]
        )
    assert (
        "--profile-step-start 3 must be >= 0 and below --profile-step-end 3"
        in capsys.readouterr().err
    )
    parse_args(GPT2_STYLE + TRAINING + ["--use-pytorch-profiler"])
    assert "--use-pytorch-profiler has no effect without --profile" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="needs a GPU; add --use-pytorch-profiler"):
        Trainer(
            parse_args(GPT2_STYLE + TRAINING + ["--profile"]),
            torch.device("cpu"),
            ParallelContext(),
        )
