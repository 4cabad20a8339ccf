"""`torchrun pretrain_gpt.py` trains end to end and prints Megatron's log line."""

import os
import re
import subprocess
import sys

import pytest

from tests.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Megatron-LM's iteration line: its timestamp, then " iteration"
MEGATRON_LINE = re.compile(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration")


@pytest.mark.parametrize(
    "nproc,layout,expected",
    [
        (
            4,
            ["--tensor-model-parallel-size", "4", "--sequence-parallel"],
            "TP=4, PP=1, DP=1, sequence parallel",
        ),
        (
            8,
            [
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--virtual-pipeline-model-parallel-size",
                "2",
                "--use-tp-pp-dp-mapping",  # Megatron-LM's "dp_last" configs
            ],
            "TP=2, PP=2, DP=2, 2 virtual stages, rank order TP-CP-EP-PP-DP",
        ),
        (
            4,
            ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
            + ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
            "TP=2, PP=1, CP=2 (allgather), DP=1, sequence parallel",
        ),
    ],
)
def test_torchrun_mock_data_run(tmp_path, nproc, layout, expected):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        os.path.join(ROOT, "pretrain_gpt.py"),
        *layout,
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "6",
        "--lr",
        "1e-3",
        "--mock-data",
        "--vocab-size",
        "500",
        "--log-interval",
        "3",
        "--eval-interval",
        "6",
        "--eval-iters",
        "1",
        "--distributed-backend",
        "gloo",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if MEGATRON_LINE.match(line)]
    # Megatron-LM's line after the first iteration, then every --log-interval 3
    assert [re.search(r" iteration +(\d+)/", line).group(1) for line in lines] == ["1", "3", "6"]
    assert re.match(
        MEGATRON_LINE.pattern + r" +6/ +6 \| consumed samples: +48 \| elapsed time per iteration "
        r"\(ms\): [\d.]+ \| learning rate: [\d.E+-]+ \| global batch size: +8 \| "
        r"lm loss: [\d.E+-]+ \| loss scale: 1\.0 \| grad norm: [\d.]+ \| number of "
        r"skipped iterations: +0 \| number of nan iterations: +0 \|",
        lines[2],
    )
    assert expected in result.stdout
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    assert "validation loss at iteration 6" in result.stdout
    # For people, beside Megatron's lines: progress with time left, and a summary at the end.
    assert re.search(
        r"> progress: 3 of 6 iterations \(50\.0%\), [\d:]+ elapsed, about [\d:]+ left",
        result.stdout,
    )
    # Megatron-style parsers look for " iteration N": only Megatron's own lines have it.
    assert all(
        MEGATRON_LINE.match(line)
        for line in result.stdout.splitlines()
        if re.search(r" iteration \d", line) and "validation loss" not in line
    )
    summary = re.search(
        r"> done: 6 iterations \(to 6\) in [\d:]+; last training loss ([\d.]+); "
        r"best validation loss ([\d.]+) after 6 iterations; no checkpoint \(no --save\)",
        result.stdout,
    )
    assert summary, result.stdout[-2000:]
