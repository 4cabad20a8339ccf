"""The ecosystem's launchers: `accelerate launch` and Ray Train (launch/ray_gpt.py) train TP=2
with every printed loss equal to `torchrun --nproc_per_node 2`'s, and a Ray worker killed
mid-run is replaced and the run resumes from its last checkpoint, still on torchrun's losses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, logged_losses
from tests.distributed import free_port

ITERS = 40
TRAIN_FLAGS = [
    *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64").split(),
    *("--max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8").split(),
    *("--lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 20 --eval-iters 1").split(),
    *("--mock-data --tokenizer-type NullTokenizer --vocab-size 512").split(),
    *"--tensor-model-parallel-size 2 --train-iters".split(),
    str(ITERS),
]
PRINTED = re.compile(r" iteration +(\d+)/ +\d+ .*?lm loss: (\S+) \|")


def _run(command: list[str], **env) -> str:
    result = subprocess.run(
        command, cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def torchrun_losses() -> dict[str, dict[int, str]]:
    output = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", str(free_port()), "pretrain_gpt.py", *TRAIN_FLAGS]
    )
    losses = logged_losses(output)
    assert len(losses["train"]) == ITERS and len(losses["validation"]) == ITERS // 20
    return losses


def test_accelerate_launch_trains_like_torchrun(torchrun_losses):
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # launch/accelerate_config.yaml (the README's): accelerate's torchrun path, which on a
    # machine without GPUs `--multi_gpu` also picks (`--cpu` would start one process).
    output = _run(
        [accelerate, "launch", "--config_file", "launch/accelerate_config.yaml"]
        + ["--num_processes", "2", "--main_process_port", str(free_port())]
        + ["pretrain_gpt.py", *TRAIN_FLAGS]
    )
    assert logged_losses(output) == torchrun_losses


def test_accelerate_settings_threefold_would_ignore_are_refused():
    check = [sys.executable, "pretrain_gpt.py", *TRAIN_FLAGS]
    common = dict(os.environ, THREEFOLD_VALIDATE_ONLY="1", WORLD_SIZE="2")
    for variable, value, named in [
        ("ACCELERATE_MIXED_PRECISION", "bf16", "--mixed_precision bf16"),
        ("ACCELERATE_USE_FSDP", "true", "--use-torch-fsdp2"),
        ("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR", "--dynamo_backend inductor"),
    ]:
        result = subprocess.run(
            check, cwd=ROOT, env=dict(common, **{variable: value}), capture_output=True, text=True
        )
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("pretrain_gpt.py: error: accelerate launch") and named in line
    agreed = dict(common, ACCELERATE_MIXED_PRECISION="bf16")
    assert subprocess.run([*check, "--bf16"], cwd=ROOT, env=agreed).returncode == 0


def _kill_a_worker_after_a_checkpoint(run: subprocess.Popen, save: str) -> int:
    """SIGKILL one Ray Train worker once the first checkpoint is complete; its pid."""
    import psutil

    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    deadline = time.monotonic() + 240
    while not os.path.exists(tracker):
        assert run.poll() is None and time.monotonic() < deadline, "no checkpoint was saved"
        time.sleep(0.05)
    ray_run = psutil.Process(run.pid)
    workers = [
        process
        for process in ray_run.children(recursive=True)
        if "RayTrainWorker" in " ".join(process.cmdline())
    ]
    assert len(workers) == 2, [" ".join(process.cmdline()) for process in workers]
    workers[-1].kill()
    return workers[-1].pid


def test_ray_train_matches_torchrun_and_resumes_after_a_killed_worker(torchrun_losses, tmp_path):
    pytest.importorskip("ray.train", reason="ray[train] is not installed")
    pytest.importorskip("psutil", reason="psutil is not installed")
    save = str(tmp_path / "checkpoints")
    run = subprocess.Popen(
        [sys.executable, "launch/ray_gpt.py", "--num-workers", "2"]
        + ["--storage-path", str(tmp_path / "ray"), "--max-failures", "1", "--"]
        + [*TRAIN_FLAGS, "--save", save, "--save-interval", "10"],
        cwd=ROOT,
        env=dict(os.environ, RAY_DEDUP_LOGS="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        killed = _kill_a_worker_after_a_checkpoint(run, save)
        output, _ = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, output[-4000:]
    assert f"--load {save} (--save)" in output
    resumed = re.findall(rf"> resumed from {re.escape(save)} at iteration (\d+)", output)
    assert len(resumed) == 1 and int(resumed[0]) >= 10, output[-4000:]
    assert f"pid={killed}" in output  # the killed worker had printed before it was replaced
    # Every line printed, before the kill and after the resume, has torchrun's loss.
    printed = PRINTED.findall(output)
    assert {(int(i), loss) for i, loss in printed} == set(torchrun_losses["train"].items())
    assert logged_losses(output)["validation"] == torchrun_losses["validation"]
