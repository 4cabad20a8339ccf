"""--rerun-mode validate_results (Megatron-LM's rerun state machine): a bad loss is rerun in place;
one that does not reproduce is a transient fault (exit 17); one that does is saved for a job on
other devices (exit 16), which tells a persistent device fault from a correct result (exit 17).
Driven by Megatron-LM's own --error-injection-rate/-type and by a real NaN, as processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL
from tests.distributed import run_distributed
from tests.parity import LLAMA_STYLE, TRAINING, _setup
from threefold.arguments import parse_args

TINY = TINY_MODEL + "--mock-data --vocab-size 128 --eval-iters 0 --log-interval 1".split()
TINY += "--global-batch-size 4 --lr 1e-3 --train-iters 5 --rerun-mode validate_results".split()


def _pretrain(save: str, *flags: str, node: str = "first", **environment):
    """pretrain_gpt.py, saving into (and resuming from) `save`, on the named node."""
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *TINY, *flags]
    command += ["--save", save, "--load", save, "--save-interval", "2"]
    environment = {**os.environ, "THREEFOLD_NODE_NAME": node, **environment}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)


def _injected(kind: str) -> list[str]:
    return ["--error-injection-rate", "1", "--error-injection-type", kind]


def _listing(save: str) -> list[str]:
    return sorted(n for n in os.listdir(save) if not n.startswith("."))


def test_a_transient_fault_exits_17_and_saves_nothing(tmp_path):
    save = str(tmp_path / "run")
    result = _pretrain(save, *_injected("transient_error"))
    assert result.returncode == 17, result.stderr[-2000:]
    assert "WARNING: Result validation enabled" in result.stdout
    assert "WARNING: Injecting error type Transient error" in result.stdout
    assert "First rerun: unexpected result is not reproducible within the tolerance" in (
        result.stdout
    )
    assert "iteration #2: Possible transient error!!" in result.stdout
    assert result.stderr.strip().endswith(
        "pretrain_gpt.py: Exiting now. The job can be resumed from a previous checkpoint"
    )
    assert not os.path.exists(save) or "rerun_state.json" not in os.listdir(save)


def test_a_persistent_fault_is_rerun_elsewhere_and_named(tmp_path):
    save = str(tmp_path / "run")
    first = _pretrain(save, *_injected("persistent_error"))
    assert first.returncode == 16, first.stderr[-2000:]
    assert "First rerun: unexpected result is reproducible within the tolerance" in first.stdout
    assert "Saving a checkpoint and exiting now" in first.stderr
    # the state before iteration 2, and which rank saw what where
    assert _listing(save) == ["iter_0000001", "latest_checkpointed_iteration.txt"] + [
        "rerun_state.json"
    ]
    state = json.load(open(os.path.join(save, "rerun_state.json")))
    assert state["iteration"] == 2 and state["ranks"][0]["node"] == "first"
    assert state["ranks"][0]["rejected"] and state["ranks"][0]["injected"] == "persistent_error"
    same = _pretrain(save, *_injected("persistent_error"))
    assert same.returncode == 16, same.stderr[-2000:]
    assert "rerunning iteration 2 from the checkpoint to establish a diagnostic" in same.stdout
    assert "Got rescheduled on the same GPU. Need to resume again" in same.stdout
    moved = _pretrain(save, *_injected("persistent_error"), node="second")
    assert moved.returncode == 17, moved.stderr[-2000:]
    assert "Second rerun: unexpected result is not reproducible on a different GPU" in moved.stdout
    assert "node second, device 0, iteration #2: Possible persistent error!!" in moved.stdout
    assert "A checkpoint at the last iteration already exists" in moved.stderr
    assert _listing(save)[0] == "iter_0000001"  # nothing was trained or saved after it


def test_a_nan_the_model_makes_everywhere_is_a_correct_result(tmp_path):
    """A real NaN at iteration 3 (THREEFOLD_NAN_AT) comes back on the rerun and on another
    node: the model or data made it. The checkpoint of iteration 2, saved by --save-interval,
    is the one the rerun starts from and is not written again."""
    save = str(tmp_path / "run")
    first = _pretrain(save, THREEFOLD_NAN_AT="0@3")
    assert first.returncode == 16, first.stderr[-2000:]
    assert "ERROR: Unexpected result nan on rank 0 at iteration #3" in first.stdout
    assert "(nan = nan)" in first.stdout
    manifest = open(os.path.join(save, "iter_0000002", "manifest.json")).read()
    assert json.load(open(os.path.join(save, "rerun_state.json")))["iteration"] == 3
    moved = _pretrain(save, node="second", THREEFOLD_NAN_AT="0@3")
    assert moved.returncode == 17, moved.stderr[-2000:]
    assert "reproducible on a different GPU, therefore it was likely correct" in moved.stdout
    assert "Correct result (but possible Application error)" in moved.stdout
    assert open(os.path.join(save, "iter_0000002", "manifest.json")).read() == manifest
    # without the mode the saved request is named and passed over: training goes on
    plain = [f for f in TINY if f not in ("--rerun-mode", "validate_results")]
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *plain]
    command += ["--save", save, "--load", save, "--save-interval", "2", "--rerun-mode", "disabled"]
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "--rerun-mode disabled: ignoring the rerun of iteration 3" in resumed.stdout


def _validated_steps(argv: list[str]) -> dict:
    """Train until the validation stops the job: where and how, on this rank."""
    from threefold.training.rerun import RerunExit

    trainer = _setup(argv)
    for _ in range(4):
        try:
            trainer.train_step()
        except RerunExit as stop:
            return {"code": stop.code, "iteration": trainer.state.iteration + 1}
    return {"code": 0, "iteration": None}


def test_every_rank_stops_together_when_one_rank_is_rejected():
    """At DP2, one rank in every 2 is injected (Megatron-LM's rank-offset draw): both ranks
    rerun, and both leave with the transient fault's code at the same iteration."""
    argv = LLAMA_STYLE + TRAINING + ["--rerun-mode", "validate_results"]
    argv += ["--error-injection-rate", "2", "--error-injection-type", "transient_error"]
    results = run_distributed(2, _validated_steps, argv)
    assert results[0] == results[1] and results[0]["code"] == 17, results
    assert results[0]["iteration"] >= 2  # the first iteration is never validated


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rerun-mode", "report_stats"], "--rerun-mode report_stats"),
        (["--error-injection-rate", "10"], "belong to --rerun-mode validate_results"),
        (
            ["--rerun-mode", "validate_results", "--no-check-for-nan-in-loss-and-grad"],
            "validates the losses --check-for-nan-in-loss-and-grad checks",
        ),
    ],
)
def test_rerun_mistakes_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(LLAMA_STYLE + TRAINING + flags)
    assert message in capsys.readouterr().err
