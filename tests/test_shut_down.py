"""A launched run that succeeds frees its process groups, and so joins their gloo threads,
before the interpreter tears itself down (`threefold.parallel.state.shut_down`).

A gloo thread still finishing a collective while the interpreter tears down needs the GIL it
can no longer take, and its rank aborts after a run that succeeded ("terminate called without
an active exception", exit -6, torchrun's ChildFailedError): seen once in a 4-rank FP8 run,
and in 4 of 20 launches that end with a collective in flight (bench/gloo_exit.py). Destroying
a gloo group does not join its threads; freeing the last reference to it does.

The same holds for a run every rank stops together (--rerun-mode's exit 16 and 17, a
non-finite loss): a rank aborting there turns the code a scheduler acts on into -6. And the
collection that frees the groups must find no data-loader worker still running.
"""

import os
import re
import subprocess
import sys
import time

from tests.conftest import ROOT
from tests.distributed import free_port
from tests.test_startup import reporting_environment, run_reporting

# Each rank's threads at exit, after the script's own exit handlers, before the teardown.
REPORT_AT_EXIT = """
import atexit, os, sys

def _report():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # (a thread that ended meanwhile)
            pass
    gloo = sum("gloo" in name for name in names)
    sys.stderr.write(f"rank {os.environ['RANK']} gloo threads at exit: {gloo}\\n")

if "RANK" in os.environ:  # the ranks, not torchrun's agent
    atexit.register(_report)
"""


def _torchrun(tmp_path, script: str, argv: list[str]) -> list[int]:
    """Launch `script` on 2 ranks; each rank's gloo threads left at exit."""
    result = run_reporting(
        tmp_path,
        REPORT_AT_EXIT,
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", str(free_port()), os.path.join(ROOT, script), *argv],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return _left_at_exit(result.stderr)


def _ranks_alone(tmp_path, argv: list[str], **environment) -> tuple[list[int], list[int]]:
    """pretrain_gpt.py on 2 ranks started as a scheduler starts one task per rank, no torchrun
    agent between (which would stop the slower rank once the first had exited): each rank's
    exit code, and its gloo threads left at exit."""
    environment = {**reporting_environment(tmp_path, REPORT_AT_EXIT), **environment}
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
            cwd=ROOT,
            env={**environment, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    stderr = "".join(rank.communicate(timeout=240)[1] for rank in ranks)
    return [rank.returncode for rank in ranks], _left_at_exit(stderr)


def _left_at_exit(stderr: str) -> list[int]:
    left = dict(re.findall(r"rank (\d) gloo threads at exit: (\d+)", stderr))
    assert sorted(left) == ["0", "1"], stderr[-2000:]
    return [int(left[rank]) for rank in sorted(left)]


def test_training_tuning_sampling_and_scoring_leave_no_gloo_thread_to_the_teardown(
    shakespeare_data, tmp_path
):
    save = str(tmp_path / "checkpoint")
    train = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
    train += "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 "
    train += "--eval-interval 2 --eval-iters 1 --tensor-model-parallel-size 2 "
    train += "--tokenizer-type SentencePieceTokenizer --distributed-backend gloo"
    train = train.split() + ["--data-path", shakespeare_data["DATA_PATH"]]
    train += ["--tokenizer-model", shakespeare_data["TOKENIZER_MODEL"], "--save", save]
    # Before: all 14 groups of the layout (42 threads a rank) lived on into the teardown.
    assert _torchrun(tmp_path, "pretrain_gpt.py", train) == [0, 0]

    records = tmp_path / "sft.jsonl"
    records.write_text('{"prompt": "ROMEO: ", "response": "Good morrow."}\n' * 8)
    tune = ["--load", save, "--save", str(tmp_path / "tuned"), "--train-iters", "1"]
    tune += ["--train-data-path", str(records), "--valid-data-path", str(records)]
    tune += ["--global-batch-size", "4", "--micro-batch-size", "2", "--eval-iters", "1"]
    assert _torchrun(tmp_path, "finetune.py", tune) == [0, 0]

    layout = ["--load", save, "--tensor-model-parallel-size", "2"]
    sample = layout + ["--prompt", "ROMEO:", "--max-new-tokens", "2"]
    assert _torchrun(tmp_path, "tools/generate.py", sample) == [0, 0]
    (tmp_path / "text.txt").write_text("ROMEO: Good morrow, cousin. " * 4)
    score = layout + ["--input", str(tmp_path / "text.txt")]
    assert _torchrun(tmp_path, "tools/score.py", score) == [0, 0]


def test_a_stop_every_rank_makes_together_leaves_no_gloo_thread_to_the_teardown(tmp_path):
    tiny = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    tiny += "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 4 --mock-data "
    tiny += "--vocab-size 128 --eval-iters 0 --tensor-model-parallel-size 2 "
    tiny = (tiny + "--distributed-backend gloo").split()
    # --rerun-mode validate_results finds a fault it reproduces: saved, exit 16 on every rank.
    rerun = ["--rerun-mode", "validate_results", "--error-injection-rate", "1"]
    rerun += ["--error-injection-type", "persistent_error", "--save", str(tmp_path / "saved")]
    assert _ranks_alone(tmp_path, tiny + rerun) == ([16, 16], [0, 0])
    # One rank's loss is nan: every rank stops, exit 1.
    nan = tiny + ["--bf16", "--check-for-nan-in-loss-and-grad"]
    assert _ranks_alone(tmp_path, nan, THREEFOLD_NAN_AT="1@2") == ([1, 1], [0, 0])


def test_a_run_with_data_loader_workers_ends_within_seconds_of_its_last_line():
    """The workers stop with the training loop, told by their queues. Freed by the collection
    in state.shut_down instead, their queues' finalizers had run first: no worker heard, and
    DataLoader killed each after its 5 s timeout (10 s here, 40 s with --num-workers 8)."""
    argv = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    argv += "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data "
    argv += "--vocab-size 128 --eval-iters 0 --num-workers 2"
    run = subprocess.Popen(
        [sys.executable, "-u", os.path.join(ROOT, "pretrain_gpt.py"), *argv.split()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    last_line_at = None
    for line in run.stdout:
        if line.startswith("> done:"):
            last_line_at = time.monotonic()
    assert run.wait(timeout=120) == 0 and last_line_at is not None
    assert time.monotonic() - last_line_at < 4
