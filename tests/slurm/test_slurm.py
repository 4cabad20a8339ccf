"""`sbatch launch/slurm_gpt.sh` on a real one-node Slurm cluster started on this machine
(tests/slurm/start_cluster.sh): a run to completion, and a run preempted with SIGUSR1 that saves,
is requeued and finishes with the uninterrupted run's losses.

Needs root (the cluster's daemons); THREEFOLD_SKIP_SLURM=1 skips it on machines without.
"""

import os
import re
import subprocess
import time

import pytest

from tests.conftest import ROOT, logged_losses, tiny_gpt_environment

pytestmark = pytest.mark.skipif(
    os.environ.get("THREEFOLD_SKIP_SLURM") == "1", reason="THREEFOLD_SKIP_SLURM=1"
)
TRAIN_ITERS = 150


@pytest.fixture(scope="module")
def slurm_cluster():
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "tests", "slurm", "start_cluster.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _submit(tmp_path, data, name: str) -> tuple[str, str]:
    log = str(tmp_path / f"{name}.log")
    environment = tiny_gpt_environment(
        data,
        TRAIN_ITERS=TRAIN_ITERS,
        SAVE_INTERVAL=100,
        EVAL_INTERVAL=TRAIN_ITERS,
        RUN_DIR=tmp_path / name,
    )
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--job-name",
            name,
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--cpus-per-task",
            "2",
            "--time",
            "10",
            "--output",
            log,
            os.path.join(ROOT, "launch", "slurm_gpt.sh"),
        ],
        env=environment,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return job, log


def _read(log: str) -> str:
    return open(log).read() if os.path.exists(log) else ""


def _wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _job_state(job: str) -> str | None:
    """ "STATE REASON" while the job is queued or running, "" once it has left the queue, None
    when squeue did not answer (slurmctld busy: not a sign that the job is gone)."""
    result = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else None


def _wait_for_job(job: str, timeout: float = 300) -> None:
    moved = []

    def finished() -> bool:
        state = _job_state(job)
        if state == "PENDING BeginTime" and not moved:  # Slurm delays a requeue by 2 minutes
            # Not to zero: slurmd rejects a relaunch whose credential is from the second in
            # which the previous run's was revoked ("Job credential revoked").
            subprocess.run(
                ["scontrol", "update", f"JobId={job}", "StartTime=now+3"], capture_output=True
            )
            moved.append(True)
        if state != "":
            return False
        time.sleep(1)  # a requeued job passes through states squeue may not list: ask again
        return _job_state(job) == ""

    _wait_until(finished, timeout, f"job {job} to finish")


def test_sbatch_runs_and_a_preempted_job_resumes_exactly(slurm_cluster, shakespeare_data, tmp_path):
    job, log = _submit(tmp_path, shakespeare_data, "uninterrupted")
    _wait_for_job(job)
    text = _read(log)
    assert f"training complete at iteration {TRAIN_ITERS}" in text, text[-3000:]
    losses = [float(v) for v in logged_losses(text)["train"].values()]
    assert len(losses) == 1 + TRAIN_ITERS // 5  # (and Megatron-LM's line after iteration 1)
    assert losses[-1] < losses[0] - 1.0, losses

    job, log = _submit(tmp_path, shakespeare_data, "preempted")
    _wait_until(lambda: re.search(r" iteration +40/", _read(log)), 120, "iteration 40")
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    _wait_for_job(job)
    preempted = _read(log)
    stop = re.search(
        r"exiting at iteration (\d+): --exit-signal-handler: received SIGUSR1", preempted
    )
    assert stop, preempted[-3000:]
    stopped_at = int(stop.group(1))
    assert 40 <= stopped_at < TRAIN_ITERS
    assert f"saved checkpoint at iteration {stopped_at}" in preempted
    assert f"stopped at iteration {stopped_at} of {TRAIN_ITERS}; requeueing" in preempted
    assert "(restart 1) on" in preempted
    assert f"resumed from {tmp_path}/preempted/checkpoints at iteration {stopped_at}" in preempted
    assert f"training complete at iteration {TRAIN_ITERS}" in preempted
    final = [
        (losses["train"][TRAIN_ITERS], losses["validation"][TRAIN_ITERS])
        for losses in (logged_losses(preempted), logged_losses(text))
    ]
    assert final[0] == final[1]
