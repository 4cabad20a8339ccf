"""Faults survived and reported, with real processes under torchrun: a rank killed with
SIGKILL under --max-restarts, a stalled rank, stragglers, nan losses (fp16 skips; bf16 with
--check-for-nan-in-loss-and-grad stops and keeps the last checkpoint), W&B offline logs and
tools/plot_logs.py on a real log."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.concurrent_runs import Runs, runs_test, selected
from tests.conftest import ROOT, TINY_MODEL, logged_losses, tiny_gpt_environment
from tests.distributed import free_port
from threefold.training.numerics import SpikyLossDetector

LAUNCHER = os.path.join(ROOT, "launch", "torchrun_gpt.sh")
TINY = TINY_MODEL + "--mock-data --vocab-size 128 --eval-iters 0 --log-interval 1".split()
TINY += "--distributed-backend gloo".split()


def _torchrun(nproc: int, argv: list[str], timeout: float = 180, drop: tuple = (), **environment):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *argv,
    ]
    start = time.monotonic()
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k not in drop}, **environment},
    )
    return result, time.monotonic() - start


def _final_parameters(save_dir, tmp_path) -> dict[str, torch.Tensor]:
    iteration = int(open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read())
    target = str(tmp_path / f"{os.path.basename(save_dir)}.pt")
    dcp_to_torch_save(os.path.join(save_dir, f"iter_{iteration:07d}"), target)
    state = torch.load(target, weights_only=False)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def _workers(tag: str, rank: int) -> list[int]:
    """Pids of the first-attempt training worker `rank` of the launch tagged `tag`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if (
            f"THREEFOLD_TEST_TAG={tag}".encode() in environ
            and f"RANK={rank}".encode() in environ
            and b"TORCHELASTIC_RESTART_COUNT=0" in environ
            and b"LOCAL_RANK=" + str(rank).encode() in environ
        ):
            pids.append(int(pid))
    return pids


def test_a_rank_killed_under_max_restarts_resumes_exactly(shakespeare_data, tmp_path):
    """SIGKILL one rank of a TP=2 x DP=2 run under torchrun --max-restarts 1: the restarted
    workers resume from the newest checkpoint; every iteration's loss and the final parameters
    equal an uninterrupted run's, bitwise."""

    def environment(name: str, **extra) -> dict[str, str]:
        return tiny_gpt_environment(
            shakespeare_data,
            TRAIN_ITERS=20,
            LOG_INTERVAL=1,
            SAVE_INTERVAL=10,
            EVAL_INTERVAL=20,
            TP=2,
            NPROC_PER_NODE=4,
            SAVE_DIR=tmp_path / name,
            MASTER_PORT=free_port(),
            **extra,
        )

    straight = subprocess.run(
        ["bash", LAUNCHER], env=environment("straight"), capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    tag = uuid.uuid4().hex
    log = open(tmp_path / "killed.log", "w+")
    launch = subprocess.Popen(
        ["bash", LAUNCHER],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environment("killed", MAX_RESTARTS=1, THREEFOLD_TEST_TAG=tag),
    )
    deadline = time.monotonic() + 240
    while not re.search(r" iteration +15/", open(log.name).read()):
        assert launch.poll() is None and time.monotonic() < deadline, open(log.name).read()
        time.sleep(0.1)
    (victim,) = _workers(tag, rank=1)
    os.kill(victim, signal.SIGKILL)
    assert launch.wait(timeout=300) == 0, open(log.name).read()[-3000:]
    killed = open(log.name).read()
    assert "resumed from" in killed and "at iteration 10" in killed  # restart 1 loaded iter 10
    assert logged_losses(killed)["train"] == logged_losses(straight.stdout)["train"]
    assert len(logged_losses(killed)["train"]) == 20
    expected = _final_parameters(tmp_path / "straight", tmp_path)
    actual = _final_parameters(tmp_path / "killed", tmp_path)
    assert expected.keys() == actual.keys() and len(expected) > 10
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


STALLS = {
    # NaN checking (on by default) is the first collective after backward
    "nan-check": ([], r"all_reduce at threefold/training/numerics\.py:\d+ in check_loss_and_grads"),
    "gradient-sync": (
        ["--no-check-for-nan-in-loss-and-grad"],
        r"a collective at threefold/parallel/data_parallel/gradient_buffer\.py:\d+ in "
        "finish_grad_sync",
    ),
    "tensor-parallel": (
        ["--tensor-model-parallel-size", "2"],
        r"all_reduce at threefold/parallel/tensor_parallel/mappings\.py:\d+ in _all_reduce",
    ),
}


def _stop_rank_1(log_path) -> str:
    """Train on 2 ranks, SIGSTOP rank 1 at iteration 5 and wait for the watchdog; the log."""
    tag = uuid.uuid4().hex
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *TINY,
        "--train-iters",
        "100000",
        "--global-batch-size",
        "4",
        "--distributed-timeout-minutes",
        "0.2",
    ]
    log = open(log_path, "w+")
    launch = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, THREEFOLD_TEST_TAG=tag),
    )

    def wait_for(pattern: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not re.search(pattern, open(log.name).read()):
            assert launch.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.1)

    try:
        wait_for(r" iteration +5/", 120)
        (victim,) = _workers(tag, rank=1)
        os.kill(victim, signal.SIGSTOP)  # frozen: its watchdog thread cannot answer either
        wait_for(r"threefold watchdog on rank 0: ", 60)
        # A stopped process ignores torchrun's SIGTERM; torchrun would wait 30 s to SIGKILL it.
        os.kill(victim, signal.SIGKILL)
        assert launch.wait(timeout=60) != 0
    finally:
        for pid in _workers(tag, rank=1):
            os.kill(pid, signal.SIGKILL)
        launch.kill()
    return open(log.name).read()


@pytest.fixture(scope="module")
def watchdog_runs(request, tmp_path_factory):
    """The selected stalls' runs and the stopped rank's, started together: each spends most of
    its time waiting for its watchdog's 12 s."""
    with Runs(jobs=len(STALLS) + 1) as runs:
        test = "test_a_stalled_rank_is_named_with_the_operation_the_others_wait_in"
        for stall in selected(request, test, "stall"):
            flags = ["--train-iters", "50", "--global-batch-size", "4"]
            flags += ["--distributed-timeout-minutes", "0.2"]
            runs.start(
                stall, _torchrun, 2, TINY + STALLS[stall][0] + flags, THREEFOLD_STALL_AT="1@5"
            )
        if runs_test(request, "test_a_stopped_rank_is_named_as_not_answering"):
            runs.start("stopped", _stop_rank_1, tmp_path_factory.mktemp("stopped") / "stopped.log")
        yield runs


@pytest.mark.parametrize("stall", STALLS)
def test_a_stalled_rank_is_named_with_the_operation_the_others_wait_in(stall, watchdog_runs):
    """Rank 1 hangs in forward-backward; DP: rank 0 waits in the NaN check's all-reduce (or,
    without it, the gradient all-reduce), TP: in the forward's tensor-parallel all-reduce, the
    same phase as rank 1."""
    result, seconds = watchdog_runs.result(stall)
    assert result.returncode != 0
    # Ended, not hung: the watchdog fires 8.4 s after the stall, but the four launches start
    # together on a 2-core machine (their imports and steps took 40-76 s there), so the
    # bound leaves room for a loaded machine; the "no progress for N s" below is the timing.
    assert seconds < 120
    output = result.stdout + result.stderr
    # Whichever rank's watchdog fires first reports it, after 70% of the 12 s timeout and before
    # the collective's own; torchrun then stops the other.
    found = re.search(
        r"threefold watchdog on rank \d: no progress for (\d+) s "
        r"\(--distributed-timeout-minutes 0\.2\): rank 1 stalled outside any "
        r"collective at threefold/training/faults\.py:\d+ in delay "
        r"\(forward-backward of iteration 5\); the others wait in " + STALLS[stall][1],
        output,
    )
    assert found and 8 <= int(found[1]) <= 12, output[-3000:]


def test_a_stopped_rank_is_named_as_not_answering(watchdog_runs):
    output = watchdog_runs.result("stopped")
    assert re.search(
        r"threefold watchdog on rank 0: no progress for \d+ s \(--distributed-"
        r"timeout-minutes 0\.2\): rank 1 did not answer \(process stopped, dead "
        r"or unreachable\); the others wait in (\w+|a collective) at threefold/",
        output,
    ), output[-3000:]


def test_stragglers_are_reported():
    result, _ = _torchrun(
        2,
        TINY
        + [
            "--train-iters",
            "4",
            "--global-batch-size",
            "4",
            "--log-interval",
            "2",
            "--log-straggler",
        ],
        THREEFOLD_SLOW_RANK="1:0.3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = re.findall(
        r"stragglers over iterations (\d+)-(\d+): rank (\d+) (\d+) ms", result.stdout
    )
    assert [(first, last, rank) for first, last, rank, _ in reports] == [
        ("1", "2", "1"),
        ("3", "4", "1"),
    ], result.stdout
    assert all(int(ms) >= 300 for *_, ms in reports)


def test_fp16_skips_a_nan_step_and_backs_off():
    result, _ = _torchrun(
        1,
        TINY
        + [
            "--train-iters",
            "6",
            "--global-batch-size",
            "2",
            "--fp16",
            "--initial-loss-scale",
            "1024",
            "--hysteresis",
            "1",
        ],
        THREEFOLD_NAN_AT="0@3",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(
        r" iteration +(\d+)/.*?loss scale: (\S+) \|.*?number of skipped "
        r"iterations: +(\d+) \| number of nan iterations: +(\d+)",
        result.stdout,
    )
    assert lines[1] == ("2", "1024.0", "0", "0")
    assert lines[2] == ("3", "512.0", "1", "1")  # skipped, scale halved
    assert lines[-1] == ("6", "512.0", "0", "0")  # (each line counts its own, as Megatron-LM)


def test_check_for_nan_stops_naming_iteration_and_rank_and_keeps_the_checkpoint(tmp_path):
    save = str(tmp_path / "checkpoints")
    result, _ = _torchrun(
        2,
        TINY
        + [
            "--train-iters",
            "8",
            "--global-batch-size",
            "4",
            "--bf16",
            "--check-for-nan-in-loss-and-grad",
            "--save",
            save,
            "--save-interval",
            "2",
        ],
        THREEFOLD_NAN_AT="1@5",
    )
    assert result.returncode != 0
    assert (
        "--check-for-nan-in-loss-and-grad: non-finite loss on rank 1 at iteration 5; "
        f"stopping without saving: the last checkpoint, iteration 4 in {save}, is "
        "untouched"
    ) in result.stderr, result.stderr[-3000:]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "4"
    assert sorted(n for n in os.listdir(save) if n != ".threefold.lock") == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]


def test_spiky_loss_detector_names_the_batch():
    detector = SpikyLossDetector(factor=3.0)
    for iteration in range(1, 8):
        assert detector.observe(2.0, iteration, (iteration - 1) * 8, 8) is None
    report = detector.observe(9.0, 8, 56, 8)
    assert report == (
        "  spiky loss at iteration 8: lm loss 9.000000E+00 is 4.5x the mean of "
        "the last 7 iterations (--spiky-loss-factor 3); global batch 7, samples "
        "56 to 63"
    )
    assert detector.observe(2.1, 9, 64, 8) is None  # the spike stayed out of the mean


def test_wandb_offline_and_plot_logs_from_a_real_log(tmp_path):
    # No credentials and no WANDB_MODE: threefold chooses offline itself.
    environment = {"HOME": str(tmp_path), "WANDB_SILENT": "true"}
    result, _ = _torchrun(
        1,
        TINY
        + [
            "--train-iters",
            "6",
            "--global-batch-size",
            "2",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--wandb-project",
            "threefold-test",
            "--wandb-exp-name",
            "tiny",
            "--wandb-save-dir",
            str(tmp_path / "wb"),
        ],
        drop=("WANDB_MODE", "WANDB_API_KEY"),
        **environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no W&B credentials; logging offline" in result.stdout
    (run_dir,) = [d for d in os.listdir(tmp_path / "wb" / "wandb") if d.startswith("offline-run")]
    (records,) = [
        f for f in os.listdir(tmp_path / "wb" / "wandb" / run_dir) if f.endswith(".wandb")
    ]
    data = open(tmp_path / "wb" / "wandb" / run_dir / records, "rb").read()
    # History items are protobuf key/value_json pairs: the key, field 16, a length, the value.
    logged = {
        float(m.group(2))
        for m in re.finditer(rb"lm loss\x82\x01(.)([-0-9.e]+)", data)
        if len(m.group(2)) == m.group(1)[0]
    }
    printed = [float(v) for v in logged_losses(result.stdout)["train"].values()]
    assert len(printed) == 6
    for value in printed:  # the log prints 7 significant digits
        assert any(abs(value - w) <= 1e-6 * abs(value) for w in logged), (value, logged)
    for name in (b"learning-rate", b"grad-norm", b"tokens-per-second", b"lm loss validation"):
        assert name in data

    log = tmp_path / "train.log"
    log.write_text(result.stdout)
    other = tmp_path / "other.log"  # a second run to compare: every other line of the first
    other.write_text("\n".join(result.stdout.splitlines()[::2]))
    png = tmp_path / "plot.png"
    plotted = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "plot_logs.py"),
            str(log),
            str(other),
            "--labels",
            "run",
            "half",
            "--output",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    image = Image.open(png)
    image.verify()
    assert image.format == "PNG" and image.size[0] >= 600
    series = json.loads(Image.open(png).info["threefold-series"])
    assert series["lm loss"]["run"] == 6 and series["learning rate"]["run"] == 6
    assert series["tokens per second"]["run"] == 6 and series["validation loss"]["run"] == 2
    assert 0 < series["lm loss"]["half"] < 6
